"""A descriptor sent to any of the front's Unix sockets hangs the whole front: the front's own thread ends up
closing it, and closing a TCP socket with SO_LINGER and unacknowledged data blocks until the data is acknowledged.

The hole: a Unix stream socket's peer may attach descriptors (SCM_RIGHTS) to any bytes it sends, and whoever can
connect to the broker's sockets (no token needed) sends one byte carrying a TCP socket of its own that is connected
to a listener of its own that never reads, with a full send queue and SO_LINGER = (1, 3600), then closes its copy.
Whatever the front does with that byte, its thread drops the last reference: on ``<socket>.fast`` ``FdStream._fill``
receives up to one descriptor with any frame, the hello included, and closes a surplus one at once (``close_fds``:
``os.close`` on the event loop); on the gRPC socket the gate's relay reads with a plain ``recv``, so the kernel
discards the descriptor itself, and its final ``fput`` runs in the reading thread on its way back to user space.
Either way ``inet_release`` then waits in ``sk_stream_wait_close`` (whatever O_NONBLOCK says) for the peer to
acknowledge the data: up to the linger time the attacker chose (SO_LINGER's bound is effectively forever), while
the front's event loop does nothing at all: every tenant's calls, links, leases and sweeps stop. The same holds for
a segment registration's descriptor (closed on the loop after the worker mapped it, or after ``check_segment_fd``
refused it), and for a file of a FUSE filesystem of the attacker's (each close sends FUSE_FLUSH and waits).

Measured (2-core VM, Linux 6.18, PoCL): a tenant's connect + Allocate + Free took 0.56 s before; after one byte with
such a socket attached (4 MiB unsent), sent to ``broker.sock.fast`` (as a hello) or to ``broker.sock`` (the gRPC
socket, as an HTTP/2 preface's first byte), the same call failed with DEADLINE_EXCEEDED after its 10 s timeout, the
front's main thread in ``wait_woken``; it came back only when the attacker closed its listener.

Suggested fix: refuse descriptors where none are expected: ``SO_PASSRIGHTS`` = 0 (Linux 6.16) on every accepted
Unix socket (the sender's sendmsg then fails with EPERM), enabled on a ``.fast`` connection only once its hello has
authenticated a segments connection; where descriptors must be taken (segments), receive them with a control
buffer and hand each to a thread of its own to close (a bounded queue, the connection refused while its closes are
pending), never close one on the event loop; after ``check_segment_fd`` refuses a descriptor, set ``SO_LINGER`` =
(1, 0) on it if it is a socket before closing it. Where the kernel has no ``SO_PASSRIGHTS``, read the Unix peers'
sockets (the gRPC gate's relay included) with a control buffer and close what arrives off the loop.
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


@pytest.mark.parametrize("socket_name", ["broker.sock.fast", "broker.sock"])
def test_a_descriptor_sent_to_a_unix_socket_cannot_block_the_front(broker: BrokerProcess, socket_name: str) -> None:
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
        with socket.socket(socket.AF_UNIX) as fast:  # no token: one byte and a descriptor
            fast.connect(str(broker.workdir / socket_name))
            socket.send_fds(fast, [b"\x00"], [lingering.fileno()])
            lingering.close()  # the front's copy is the last one now
            time.sleep(1.0)
            after = call(broker)
    finally:
        listener.close()  # (resets the connection: the front's close returns)
    print(f"\nafter one byte to {socket_name} carrying a lingering TCP socket ({unsent >> 10} KiB unsent): alice's "
          f"call: {after}")
    assert after.startswith("ok"), f"a descriptor sent to {socket_name} blocked the whole front: alice's call {after}"
