"""One tenant cannot hold every gRPC connection of the broker and lock the other tenants out.

The hole (issue 21, a fresh attack on the gRPC gate): ``max_grpc_connections`` (512) is one pool for everyone, and
what bounded one party's share of it was ``max_grpc_connections_per_peer`` (64 per uid, /24, /64 or CID), and, for
connections that never authenticate, their eviction at the cap (``test_grpc_slots_held_by_eight_peers.py``). A
connection whose calls authenticate is never evicted, and nothing counted them per tenant: a tenant whose client
runs as eight uids (a container's user namespace) or from eight /64s (an IPv6 /56) held all 512 with its valid token,
each kept from gRPC's idle close (``grpc_idle_seconds``, 30 s) by a cheap call (ListDevices) now and then. Measured
here at a smaller scale (mallory from 4 uids x 8 connections, a pool of 32, a call on each every half second): bob,
another tenant, failed 5 of 5 connects (UNAVAILABLE), the log saying "32 gRPC connections open, the broker's
max_grpc_connections (32), none of them evictable for this peer".

Now a connection counts against the tenant of its first authenticated call, at most
``max_grpc_connections_per_tenant`` of them (here 8): a call that would take its tenant past it is refused
(RESOURCE_EXHAUSTED) and leaves its connection unauthenticated, closed after ``grpc_unauthenticated_seconds`` and
evictable at the cap as any other. Bob connects 5 times of 5.

And a connection stays authenticated no longer than its credential: the connections a token authenticated were
never evicted nor closed for want of an authenticated call after the token was rotated (or its tenant removed),
so whoever held the old token kept them for ever with failing calls (each resets gRPC's idle close), and with the
share above they held the tenant's whole share: carol, with her new token, was refused (RESOURCE_EXHAUSTED) 3
times of 3. Now a revocation makes them unauthenticated again (their places in the share given back, their
deadline running again): carol connects 3 times of 3, and the old token's connections are closed in time.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from gpubroker.broker.launcher import BrokerProcess, TenantSpec
from gpubroker.client import AdminClient

from ..helpers import wait_for
from ._probes import CONNECTION_HOLDER, failed_connects, open_to_other_users, scrape

PEERS = 4  # mallory's uids, each its own peer
PER_PEER = 8  # max_grpc_connections_per_peer
POOL = PEERS * PER_PEER  # max_grpc_connections: mallory's connections fill it exactly
PER_TENANT = 8  # max_grpc_connections_per_tenant
FIRST_UID = 20101
GRACE = 6.0  # grpc_unauthenticated_seconds
CONNECTS = 5  # bob's connects while mallory holds the pool


@pytest.fixture(scope="module")
def broker() -> Iterator[BrokerProcess]:
    settings = {"socket_mode": 0o666, "max_grpc_connections": POOL, "max_grpc_connections_per_peer": PER_PEER,
                "max_grpc_connections_per_tenant": PER_TENANT, "grpc_unauthenticated_seconds": GRACE,
                "metrics_listen": "127.0.0.1:0"}
    tenants = [TenantSpec("mallory"), TenantSpec("bob"), TenantSpec("carol"), TenantSpec("ops", admin=True)]
    with BrokerProcess(tenants, backend="opencl", settings=settings) as proc:
        open_to_other_users(proc)
        yield proc


def test_one_tenants_authenticated_connections_cannot_lock_another_out_of_grpc(broker: BrokerProcess) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to attack as other uids")
    # (mallory's uids: OK, or past her share RESOURCE_EXHAUSTED, from each connection the gate admitted)
    attackers = [subprocess.Popen([sys.executable, "-c", CONNECTION_HOLDER, broker.target, str(PER_PEER),
                                   str(FIRST_UID + n), broker.tokens["mallory"]], stdout=subprocess.PIPE, text=True)
                 for n in range(PEERS)]
    try:
        codes = []
        for attacker in attackers:  # every connection of every attacker admitted: the pool is full
            assert attacker.stdout is not None
            codes += attacker.stdout.readline().split()
        assert len(codes) == POOL and set(codes) <= {"OK", "RESOURCE_EXHAUSTED"}, f"mallory's first calls: {codes}"
        failures = failed_connects(broker, "bob", CONNECTS)
        assert all(attacker.poll() is None for attacker in attackers), "an attacker stopped"
    finally:
        for attacker in attackers:
            attacker.kill()
            attacker.wait()
    held = codes.count("OK")
    print(f"\nbob connected {CONNECTS - len(failures)} times of {CONNECTS} while mallory held {held} authenticated "
          f"connections of a pool of {POOL} from {PEERS} uids")
    assert not failures, (f"bob failed {len(failures)} of {CONNECTS} connects while mallory's valid calls held "
                          f"{held} connections of {POOL}: {failures[0]}\n" + broker.log_tail(1500))
    assert held <= PER_TENANT, f"mallory authenticated {held} connections, over max_grpc_connections_per_tenant"


def _timeouts(broker: BrokerProcess) -> float:
    return scrape(broker).get(("gpubroker_endpoint_refusals_total",
                               (("endpoint", "grpc"), ("reason", "unauthenticated timeout"))), 0.0)


def test_a_rotated_tokens_connections_do_not_keep_the_tenants_share(broker: BrokerProcess) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to attack as another uid")
    old = broker.tokens["carol"]
    # Whoever holds carol's token: her whole share of connections, from one uid, a call on each every half second.
    holder = subprocess.Popen([sys.executable, "-c", CONNECTION_HOLDER, broker.target, str(PER_TENANT),
                               str(FIRST_UID + PEERS), old], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None
        codes = holder.stdout.readline().split()
        assert codes == ["OK"] * PER_TENANT, f"the old token's first calls: {codes}"
        timeouts = _timeouts(broker)
        out = subprocess.run([sys.executable, "-m", "gpubroker.broker.cli", "tenant", "rotate-token", "carol",
                              "--config", str(broker.config_path)], capture_output=True, text=True, check=True).stdout
        with AdminClient(broker.target, broker.tokens["ops"]) as admin:
            admin.reload()
        reloaded = time.monotonic()
        broker.tokens["carol"] = out.strip().splitlines()[-1]
        failures = failed_connects(broker, "carol", 3)
        assert holder.poll() is None, "the old token's holder stopped"
        # Its connections, their calls failing now, are closed as any that never authenticated.
        wait_for(lambda: _timeouts(broker) >= timeouts + PER_TENANT, GRACE + 20.0,
                 f"the rotated token's {PER_TENANT} connections closed (grpc_unauthenticated_seconds)")
    finally:
        holder.kill()
        holder.wait()
    print(f"\ncarol, with her new token, connected {3 - len(failures)} times of 3 while the old token's holder kept "
          f"{PER_TENANT} connections busy; {time.monotonic() - reloaded:.1f} s after the reload")
    assert not failures, (f"carol failed {len(failures)} of 3 connects with her new token while the rotated token's "
                          f"{PER_TENANT} connections stayed: {failures[0]}")
