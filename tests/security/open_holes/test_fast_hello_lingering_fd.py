"""A descriptor attached to a hello on ``<socket>.fast`` hangs the whole front: the front closes it on its event loop,
and closing a TCP socket with SO_LINGER and unacknowledged data blocks until the data is acknowledged.

The hole: ``FdStream._fill`` receives up to one descriptor with any frame (``recv_fds(..., max(1, max_fds))``),
the hello included, and a surplus one is closed at once (``close_fds``: ``os.close`` on the event loop). Whoever
can connect to ``.fast`` (no token needed) sends one byte with SCM_RIGHTS carrying a TCP socket of its own that is
connected to a listener of its own that never reads, whose send queue is full, with SO_LINGER = (1, 3600), and
closes its copy: the front's ``os.close`` is then the last reference, and ``inet_release`` waits in
``sk_stream_wait_close`` (whatever O_NONBLOCK says) for the peer to acknowledge the data: up to the linger time,
which the attacker chose (SO_LINGER's limit is effectively forever), during which the front's event loop does
nothing at all: every tenant's calls, links, leases and sweeps stop. The same holds for the descriptor of a segment
registration (closed on the loop after the worker has mapped it, or after ``check_segment_fd`` refused it), and for a
file of a FUSE filesystem of the attacker's (every close sends FUSE_FLUSH and waits for the answer).

Measured (2-core VM, PoCL): a tenant's Allocate+Free took 0.56 s before; after one hello byte with such a socket
attached (4 MiB unsent), the same call failed with DEADLINE_EXCEEDED after its 10 s timeout, the front's main
thread in ``wait_woken``; it came back only when the attacker closed its listener.

Suggested fix: never close a peer's descriptor on the event loop: hand received descriptors to a thread of their
own to close (a bounded queue; the peer's connection refused while its closes are pending), or receive none before
authentication (``recv`` without ancillary space, so the kernel discards them: MSG_CTRUNC), and before closing one
that was accepted, make it harmless where possible (``SO_LINGER`` = (1, 0) on a socket via ``setsockopt`` on the
received descriptor turns the close into an immediate reset).
"""

from __future__ import annotations

import socket
import struct
import time
from collections.abc import Iterator

import pytest

from gpubroker.broker.launcher import BrokerProcess, TenantSpec
from gpubroker.client import GpuBrokerError, connect

CALL_TIMEOUT = 10.0


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerProcess]:
    tmp = tmp_path_factory.mktemp("linger")
    with BrokerProcess([TenantSpec("alice")], backend="opencl", settings={"cache_dir": str(tmp / "caches")}) as proc:
        yield proc


def call(broker: BrokerProcess) -> str:
    start = time.monotonic()
    try:
        with connect(broker.target, token=broker.tokens["alice"], timeout=CALL_TIMEOUT, transport="grpc",
                     shared_memory=False) as gpu:
            gpu.free_memory(gpu.allocate_memory(16))
        return f"ok in {time.monotonic() - start:.2f} s"
    except GpuBrokerError as exc:
        return f"{type(exc).__name__} after {time.monotonic() - start:.2f} s"


def test_a_descriptor_sent_with_a_hello_cannot_block_the_front(broker: BrokerProcess) -> None:
    assert broker.workdir is not None
    assert call(broker).startswith("ok")
    listener = socket.socket()  # never accepts, never reads: the connection's data is never acknowledged
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    try:
        lingering = socket.create_connection(listener.getsockname())
        lingering.setblocking(False)
        unsent = 0
        try:
            while True:
                unsent += lingering.send(bytes(65536))
        except BlockingIOError:
            pass
        lingering.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 3600))
        with socket.socket(socket.AF_UNIX) as fast:  # no token, no hello: one byte and a descriptor
            fast.connect(str(broker.workdir / "broker.sock.fast"))
            socket.send_fds(fast, [b"\x00"], [lingering.fileno()])
            lingering.close()  # the front's copy is the last one now
            time.sleep(1.0)
            after = call(broker)
    finally:
        listener.close()  # (resets the connection: the front's close returns)
    print(f"\nafter one hello byte carrying a lingering TCP socket ({unsent >> 10} KiB unsent): alice's call: {after}")
    assert after.startswith("ok"), f"a descriptor sent with a hello blocked the whole front: alice's call {after}"
