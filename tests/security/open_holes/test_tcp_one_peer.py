"""attack3: on a loopback TCP listener every local user is one "peer", so any local process evicts the tenants.

``max_grpc_connections_per_peer`` counts TCP connections by remote address. On ``127.0.0.1`` (a supported listener:
loopback TCP with local credentials, no TLS needed) every local process has that address, so the cap is shared by
every local user. A process that holds the per-peer cap in idle connections (it sent the HTTP/2 preface and
SETTINGS, never a token: past the handshake timeout, closed only after ``grpc_idle_seconds``, and reopened) makes
every tenant's connection the newest over the cap: the census shuts it down within a fraction of a second, so
its calls fail UNAVAILABLE as long as the holder stays.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import pytest

from gpubroker.broker.launcher import BrokerProcess, TenantSpec
from gpubroker.client import GpuBrokerError, connect

PER_PEER = 8
CALLS = 20

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"  # + an empty SETTINGS


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


def test_one_local_process_cannot_evict_every_tcp_tenant(broker: BrokerProcess) -> None:
    assert calls_ok(broker) == CALLS
    host, port = broker.tcp_target.rsplit(":", 1)
    held = []
    try:
        for _ in range(PER_PEER):
            s = socket.create_connection((host, int(port)), timeout=5)
            s.sendall(PREFACE)
            held.append(s)
        time.sleep(1.5)  # (counted: the holder's connections are now the oldest of 127.0.0.1)
        try:
            ok = calls_ok(broker)
        except GpuBrokerError as exc:
            ok = 0
            print(f"\nthe tenant could not even open its session: {type(exc).__name__}: {exc}")
    finally:
        for s in held:
            s.close()
    print(f"\nwith {PER_PEER} idle tokenless connections from another local process, the tenant's calls over "
          f"loopback TCP succeeded {ok} of {CALLS}")
    assert ok == CALLS, (f"a local process holding {PER_PEER} idle connections without a token made the tenant's "
                         f"calls fail ({ok} of {CALLS} succeeded): every local user is the same TCP peer")
