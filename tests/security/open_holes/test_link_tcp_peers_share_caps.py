"""Silent TCP connections to ``link_listen`` use up the pre-authentication caps of every raw listener: another
local user (no token, no uid of a tenant's) makes every tenant's ``.fast`` link and shared-memory connection fail.

The hole: ``PreAuthGate`` counts a TCP link connection by its source address (``_links._accept_tcp``:
``admit(None, ..., address=_host(address))``) and gives it no ``evict`` (so it is never "idle", never evicted to make
room), while ``max_unauthenticated_connections`` (256) is one count across every raw listener: the ``.fast`` Unix
sockets, vsock and the TCP link. So whoever holds 64 silent connections from each of 4 addresses holds all 256 for
``hello_timeout_seconds``, reconnects as each is closed, and every other connection on every raw listener is refused
at once: the tenants' ``.fast`` links (and their shared-memory segments, which ride that socket) included. Every
address of 127.0.0.0/8 is the host's own, so one local process binds 127.0.0.2 .. 127.0.0.5 and needs nothing else;
remotely, 4 IPv4 addresses (or one IPv6 /64) do the same. Even with one address, every local user is "127.0.0.1":
one of them holding 64 connections refuses every other local user's TCP links (the hole the gRPC gate closed for
its own listeners by counting a loopback peer by the uid owning its socket, ``_grpc_peers._Owners``).

Measured (2-core VM, PoCL, defaults + link_listen = "127.0.0.1:0"): alice's ``connect(unix, transport="link")`` +
allocate/free succeeded 10 of 10 before; with uid 65533 holding 4 x 64 silent TCP connections from 127.0.0.2-5:
0 of 10 ("the broker's unix link did not answer its hello: Connection reset by peer").

Suggested fix: name a loopback (or the host's own address) TCP link peer by the uid owning its socket, as the gRPC
gate does (sock_diag), so that it shares its uid's per-uid cap; count remote peers by a prefix (/24, /64), not one
address; and keep separate totals per listener kind (or reserve part of the total for the Unix ``.fast`` sockets,
whose peers are known by uid), so that TCP peers can never take the local fast path's places.
"""

from __future__ import annotations

import os
import subprocess
import textwrap
import time
from collections.abc import Iterator

import pytest

from gpubroker.broker.launcher import BrokerProcess, TenantSpec
from gpubroker.client import GpuBrokerError, connect

CALLS = 10
HOLDER_UID = 65533  # another local user, without a token
SOURCES = "127.0.0.2,127.0.0.3,127.0.0.4,127.0.0.5"  # 4 x max_unauthenticated_per_uid (64) = the total (256)

# Holds N silent connections from each source address to the link port, reopening each one the broker closes.
HOLDER = textwrap.dedent("""
    import selectors, socket, sys, time
    port, n, sources = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3].split(",")
    sel = selectors.DefaultSelector()
    def open_one(src):
        s = socket.socket()
        s.bind((src, 0))
        try:
            s.connect(("127.0.0.1", port))
        except OSError:
            s.close()
            return
        s.setblocking(False)
        sel.register(s, selectors.EVENT_READ, src)
    for src in sources:
        for _ in range(n):
            open_one(src)
    print("holding", flush=True)
    while True:
        for key, _ in sel.select(0.05):
            try:
                data = key.fileobj.recv(4096)
            except OSError:
                data = b""
            if not data:
                sel.unregister(key.fileobj)
                key.fileobj.close()
                open_one(key.data)
""")


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerProcess]:
    tmp = tmp_path_factory.mktemp("link-tcp-peers")
    settings = {"cache_dir": str(tmp / "caches"), "link_listen": "127.0.0.1:0"}
    with BrokerProcess([TenantSpec("alice")], backend="opencl", settings=settings) as proc:
        yield proc


def links_ok(broker: BrokerProcess) -> tuple[int, list[str]]:
    ok, errors = 0, []
    for _ in range(CALLS):
        try:
            with connect(broker.target, token=broker.tokens["alice"], timeout=10, transport="link") as gpu:
                gpu.free_memory(gpu.allocate_memory(4096))
                ok += 1
        except GpuBrokerError as exc:
            errors.append(f"{type(exc).__name__}: {exc}")
        time.sleep(0.2)
    return ok, errors


def test_silent_tcp_link_connections_cannot_refuse_the_tenants_unix_links(broker: BrokerProcess) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to run the holder as another uid")
    assert links_ok(broker)[0] == CALLS

    def drop() -> None:
        os.setgid(HOLDER_UID)
        os.setuid(HOLDER_UID)

    holder = subprocess.Popen(["/usr/bin/python3", "-I", "-c", HOLDER, str(broker.link_port), "64", SOURCES],
                              stdout=subprocess.PIPE, text=True, preexec_fn=drop)
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline().strip() == "holding"
        time.sleep(1.0)
        ok, errors = links_ok(broker)
    finally:
        holder.kill()
        holder.wait()
    print(f"\nwith uid {HOLDER_UID} holding 4 x 64 silent TCP link connections, alice's unix links: {ok} of {CALLS}; "
          f"{errors[:1]}")
    assert ok == CALLS, (f"another local user's silent TCP connections to link_listen made {CALLS - ok} of {CALLS} "
                         f"of alice's .fast links fail: {errors[:1]}")
