"""Peers that never authenticate cannot hold every gRPC connection of the broker and lock the tenants out.

The hole (issue 21, found by a fresh attack): ``max_grpc_connections`` (512) was one pool for all peers, and
``max_grpc_connections_per_peer`` (64) the only thing between one party and that pool; gRPC's idle close
(``grpc_idle_seconds``) counts a failed, unauthenticated call as activity. A peer is a uid on a Unix socket or on
TCP from this host, a /24 or /64 on other TCP, a CID on vsock: eight of them are cheap (eight uids in a container's
user namespace, eight /64s of one IPv6 /56 a home line gets), and none needs a token. Each kept its 64 connections
from idling by a call with a wrong token every 5 s (about 100 calls a second in all, far below the per-peer call
rate), and the gate refused every other connection. Measured (8 uids x 64 connections): bob, a tenant with a valid
token, failed 10 of 10 connects (UNAVAILABLE: connection reset); the log said "512 gRPC connections open, the
broker's max_grpc_connections (512)".

Now (broker/front/_grpc_peers.py) a connection none of whose calls authenticated is closed
``grpc_unauthenticated_seconds`` after it was accepted, whatever calls it made; and at ``max_grpc_connections`` a
newcomer takes the place of the oldest unauthenticated connection of the peer holding the most of them, if that
peer holds more than the newcomer's. Here the same attack at a smaller scale (4 uids x 8 connections fill a pool of
32, each connection making a failing call every half second and reconnecting as soon as it is closed): bob connects
5 times out of 5, and a connection that only ever fails to authenticate is closed on time.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator

import grpc
import pytest

from gpubroker.broker.launcher import BrokerProcess, TenantSpec
from gpubroker.v1 import broker_pb2 as pb
from gpubroker.v1 import broker_pb2_grpc as pbg

from ..helpers import wait_for
from ._probes import CONNECTION_HOLDER, failed_connects, open_to_other_users

PEERS = 4  # attacking uids, each its own peer
PER_PEER = 8  # max_grpc_connections_per_peer
POOL = PEERS * PER_PEER  # max_grpc_connections: the attackers fill it exactly
FIRST_UID = 20001
# grpc_unauthenticated_seconds: long enough that the attackers' connections, all admitted, are still open when bob
# starts connecting on a loaded machine (each connect of his then evicts one); short enough to wait for.
GRACE = 6.0
CONNECTS = 5  # bob's connects while the attack goes on
WRONG_TOKEN = "gpb_x.y"


@pytest.fixture(scope="module")
def broker() -> Iterator[BrokerProcess]:
    settings = {"socket_mode": 0o666, "max_grpc_connections": POOL, "max_grpc_connections_per_peer": PER_PEER,
                "grpc_unauthenticated_seconds": GRACE, "metrics_listen": "127.0.0.1:0"}
    with BrokerProcess([TenantSpec("bob")], backend="opencl", settings=settings) as proc:
        open_to_other_users(proc)
        yield proc


def _refused(broker: BrokerProcess, reason: str) -> float:
    """gpubroker_endpoint_refusals_total{endpoint="grpc", reason=...} now (0 where it is missing: the attack's own
    assertions come first, and say what went wrong)."""
    with urllib.request.urlopen(broker.metrics_url, timeout=30) as answer:
        text = answer.read().decode()
    found = re.search(rf'^gpubroker_endpoint_refusals_total{{endpoint="grpc",reason="{reason}"}} (\S+)$', text,
                      re.MULTILINE)
    return float(found.group(1)) if found is not None else 0.0


def test_unauthenticated_peers_cannot_lock_a_tenant_out_of_grpc(broker: BrokerProcess) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to attack as other uids")
    # (each attacker's calls carry a wrong token: UNAUTHENTICATED from each connection the gate admitted)
    attackers = [subprocess.Popen([sys.executable, "-c", CONNECTION_HOLDER, broker.target, str(PER_PEER),
                                   str(FIRST_UID + n), WRONG_TOKEN], stdout=subprocess.PIPE, text=True)
                 for n in range(PEERS)]
    try:
        for attacker in attackers:  # every connection of every attacker admitted: the pool is full
            assert attacker.stdout is not None
            codes = attacker.stdout.readline().split()
            assert codes == ["UNAUTHENTICATED"] * PER_PEER, f"an attacker's first calls: {codes}"
        evicted = _refused(broker, "evicted unauthenticated")
        failures = failed_connects(broker, "bob", CONNECTS)
        assert all(attacker.poll() is None for attacker in attackers), "an attacker stopped"
    finally:
        for attacker in attackers:
            attacker.kill()
            attacker.wait()
    evicted = _refused(broker, "evicted unauthenticated") - evicted
    print(f"\nbob connected {CONNECTS - len(failures)} times of {CONNECTS} while {PEERS} peers held the pool; "
          f"{evicted:g} unauthenticated connections evicted")
    assert not failures, (f"bob, with a valid token, failed {len(failures)} of {CONNECTS} connects: {failures[0]}\n"
                          + broker.log_tail(1500))
    assert evicted >= 1, "bob was served, but evicted nobody: the attackers did not hold the pool"


def test_a_connection_whose_calls_never_authenticate_is_closed_in_time(broker: BrokerProcess) -> None:
    timeouts = _refused(broker, "unauthenticated timeout")
    with grpc.insecure_channel(broker.target, options=[("grpc.use_local_subchannel_pool", 1)]) as channel:
        states: list[tuple[float, grpc.ChannelConnectivity]] = []
        channel.subscribe(lambda state: states.append((time.monotonic(), state)), try_to_connect=True)
        stub = pbg.GpuBrokerStub(channel)

        def ready_at() -> float | None:
            return next((at for at, state in states if state == grpc.ChannelConnectivity.READY), None)

        def closed_at() -> float | None:  # (its first connection's end: READY gives way to IDLE or a failure)
            opened = ready_at()
            return next((at for at, state in states if opened is not None and at > opened
                         and state != grpc.ChannelConnectivity.READY), None)

        deadline = time.monotonic() + GRACE + 20.0
        calls = 0
        while closed_at() is None and time.monotonic() < deadline:
            # A wrong token's call every tenth of a second: gRPC's idle close (30 s) never comes.
            with pytest.raises(grpc.RpcError) as refused:
                stub.ListDevices(pb.ListDevicesRequest(), metadata=[("authorization", "Bearer gpb_x.y")], timeout=10)
            calls += refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
            time.sleep(0.1)
        opened, closed = ready_at(), closed_at()
        assert opened is not None and closed is not None, (
            f"a connection making only failing calls ({calls} refused) was still open {GRACE + 20:g} s later")
    print(f"\nclosed {closed - opened:.2f} s after it was ready, after {calls} calls with a wrong token")
    # (its deadline runs from its accept, a moment before gRPC's handshake made the channel ready)
    assert calls >= 3 and GRACE / 2 <= closed - opened <= GRACE + 20.0
    wait_for(lambda: _refused(broker, "unauthenticated timeout") > timeouts, 10.0,
             "the close counted in gpubroker_endpoint_refusals")
