"""On a loopback TCP listener every local user has the address 127.0.0.1: each is a peer by its uid, not one by
the address, so one local user holding its connection cap leaves the tenants' connections alone.

(The hole, found by the last attacker: ``max_grpc_connections_per_peer`` counted TCP connections by remote address,
so a process holding that many idle connections (the HTTP/2 preface and SETTINGS, never a token) made every
tenant's loopback connection the newest past the cap, shut down within a fraction of a second: 0-11 of 20 calls
succeeded. Now the gate that accepts the gRPC listeners' connections counts a local TCP peer by the uid owning its
socket: ``src/gpubroker/broker/front/_grpc_peers.py``.)
"""

from __future__ import annotations

import os
import re
import subprocess
import textwrap
import time
from collections.abc import Iterator

import pytest

from gpubroker.broker.launcher import BrokerProcess, TenantSpec
from gpubroker.client import GpuBrokerError, Unauthenticated, connect

from ..helpers import wait_for

PER_PEER = 8
CALLS = 20
HOLDER_UID = 65533  # another local user, who has no token

# Opens PER_PEER + EXTRA connections, each sent the HTTP/2 preface and an empty SETTINGS, says how many the broker
# kept (a refused one reads as closed; a kept one has gRPC's SETTINGS), then holds those until its stdin closes.
HOLDER = textwrap.dedent("""
    import socket, sys
    host, port, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    PREFACE = b"PRI * HTTP/2.0\\r\\n\\r\\nSM\\r\\n\\r\\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])
    held = []
    for _ in range(n):
        s = socket.create_connection((host, port), timeout=5)
        try:
            s.sendall(PREFACE)
            if s.recv(1):  # gRPC's SETTINGS: the broker kept it
                held.append(s)
                continue
        except OSError:
            pass
        s.close()
    print(f"held {len(held)}", flush=True)
    sys.stdin.read()
""")
EXTRA = 4


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerProcess]:
    tmp = tmp_path_factory.mktemp("tcp-peer")
    settings = {"cache_dir": str(tmp / "caches"), "max_grpc_connections_per_peer": PER_PEER}
    with BrokerProcess([TenantSpec("alice")], backend="opencl", settings=settings, tcp=["127.0.0.1:0"]) as proc:
        yield proc


def calls_ok(broker: BrokerProcess) -> int:
    ok = 0
    with connect(broker.tcp_target, token=broker.tokens["alice"], timeout=5, transport="grpc",
                 shared_memory=False) as gpu:
        for _ in range(CALLS):
            try:
                gpu.free_memory(gpu.allocate_memory(4096))
                ok += 1
            except GpuBrokerError:
                pass
            time.sleep(0.1)
    return ok


def test_one_local_user_cannot_evict_the_tcp_tenants(broker: BrokerProcess) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to run the holder as another uid")
    assert calls_ok(broker) == CALLS
    host, port = broker.tcp_target.rsplit(":", 1)

    holder = subprocess.Popen(["/usr/bin/python3", "-I", "-c", HOLDER, host, port, str(PER_PEER + EXTRA)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                              user=HOLDER_UID, group=HOLDER_UID, extra_groups=[])
    try:
        assert holder.stdout is not None and holder.stdin is not None
        held = int(holder.stdout.readline().split()[1])
        try:
            ok = calls_ok(broker)
        except GpuBrokerError as exc:
            ok = 0
            print(f"\nthe tenant could not even open its session: {type(exc).__name__}: {exc}")
        holder.stdin.close()
        holder.wait(timeout=10)
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()
    print(f"\nanother local user (uid {HOLDER_UID}) kept {held} of its {PER_PEER + EXTRA} idle tokenless "
          f"connections; the tenant's calls over loopback TCP succeeded {ok} of {CALLS}")
    assert ok == CALLS, (f"a local user holding {PER_PEER} idle connections without a token made the tenant's calls "
                         f"fail ({ok} of {CALLS} succeeded): every local user is the same TCP peer")
    assert held == PER_PEER, f"the holder kept {held} connections, its cap is {PER_PEER}"


def test_the_audit_names_a_local_tcp_peer_by_its_uid(broker: BrokerProcess) -> None:
    """gRPC sees the gate's end of each connection; the audit lines name the peer the gate accepted."""
    with pytest.raises(Unauthenticated):
        connect(broker.tcp_target, token="gpb_000000000000_wrong", timeout=5, transport="grpc", shared_memory=False)
    pattern = re.compile(rf"auth failure: peer=ipv4:127\.0\.0\.1:\d+ uid={os.geteuid()} ")

    def audited() -> bool:
        return bool(pattern.search(broker.log_path.read_text(errors="replace")))

    wait_for(audited, 10.0, "an audit line naming the failed peer's address and uid")
