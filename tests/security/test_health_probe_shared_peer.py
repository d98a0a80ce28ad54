"""One local user cannot make the broker's own readiness probe fail: the health service counts peers as the gRPC
listeners do (a uid locally, a /24 or /64 remotely), and a health request's message has
``request_message_timeout_seconds`` to arrive.

The hole (issue 21): ``StreamLimiter`` (broker/front/_health.py) counted health requests on their way in (and
Watch and reflection streams) per peer host, which made every Unix-socket peer one peer ("unix") and every local
TCP peer one peer ("ipv4"), dropping the uid the gRPC gate names; and an unauthenticated health request's message
was read with no deadline. One local user holding ``max_health_streams_per_peer`` (16) Check calls on one
connection, each one byte short of its message, took the whole "unix" share: the broker's readiness check
(``python -m gpubroker.broker.healthcheck``, what the DaemonSet's readinessProbe execs, as root) got
``RESOURCE_EXHAUSTED: too many open requests: this peer has 16 Check requests open, max_health_streams_per_peer is
16`` on 3 tries of 3, for as long as the holder liked. Now the limiter counts by the gate's ``Peer.key``
(``grpc_peer_key``), and a request that has not arrived within request_message_timeout_seconds ends with
DEADLINE_EXCEEDED, giving back its place.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator

import pytest
from grpc_health.v1 import health_pb2

from gpubroker.broker.healthcheck import check
from gpubroker.broker.launcher import BrokerProcess, TenantSpec

from ._probes import open_to_other_users
from .test_calls_staged_before_rotation import Staged
from .test_grpc_partial_messages import FLOODER

ATTACKER_UID = 65534
FOUR_UIDS = [20501, 20502, 20503, 20504]  # at PER_PEER each: max_health_streams (64) in all
PER_PEER = 16  # max_health_streams_per_peer (the default)
TRIES = 3  # readiness checks from root while the attacker holds its requests (the DaemonSet fails at 2)
# request_message_timeout_seconds: long enough that the attacker's calls are still held (none ended) when it says
# so, 2 s into its flood, on a loaded machine; short enough to wait for.
REQUEST_TIMEOUT = 8.0


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerProcess]:
    tmp = tmp_path_factory.mktemp("health-peer")
    settings = {"cache_dir": str(tmp / "caches"), "socket_mode": 0o666,
                "request_message_timeout_seconds": REQUEST_TIMEOUT}
    with BrokerProcess([TenantSpec("alice")], backend="opencl", settings=settings) as proc:
        open_to_other_users(proc)
        yield proc


def test_one_local_user_cannot_fail_the_brokers_readiness_probe(broker: BrokerProcess) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to hold the requests as another uid")
    assert check(broker.target, timeout=10) == (True, "SERVING")

    # 16 Check calls, each message announced at 2 bytes and sent one byte short, for 2 s; then held for 60 s.
    attacker = subprocess.Popen(
        ["/usr/bin/python3", "-I", "-c", FLOODER, broker.target.removeprefix("unix:"),
         "/grpc.health.v1.Health/Check", "", str(PER_PEER), "2", "2", "60"],
        stdout=subprocess.PIPE, text=True, user=ATTACKER_UID, group=ATTACKER_UID, extra_groups=[])
    try:
        assert attacker.stdout is not None
        sent = attacker.stdout.readline().strip()  # (printed once its calls are open: it holds them from here)
        # All its calls admitted and held (one refused, or ended by the broker, would be replaced: opened > 16).
        assert sent.startswith("sent ") and sent.endswith(f"opened {PER_PEER} calls, the server ended 0"), sent
        seen = [check(broker.target, timeout=10) for _ in range(TRIES)]
    finally:
        attacker.kill()
        attacker.wait()
    print(f"\nuid {ATTACKER_UID}: {sent}; the readiness check from uid 0 meanwhile: {seen}")
    failed = [what for passed, what in seen if not passed]
    assert not failed, (f"uid {ATTACKER_UID}'s {PER_PEER} unfinished health requests failed {len(failed)} of {TRIES} "
                        f"readiness checks from uid 0: {failed[0]}")


def test_four_local_users_cannot_fail_the_brokers_readiness_probe(broker: BrokerProcess) -> None:
    """The same hold from four uids, each at its own share: together they held all of max_health_streams (64) of
    the requests on their way in, and the readiness check got RESOURCE_EXHAUSTED ("64 Check requests open,
    max_health_streams is 64") 3 times of 3 (four local users, or four remote /24s, took a DaemonSet's broker out
    of its Service for as long as they liked). Now, at the total, a newcomer takes the place of the oldest request
    of the peer holding the most, if that peer holds more than the newcomer's: the probe, one request of its own,
    always gets one."""
    if os.geteuid() != 0:
        pytest.skip("needs root to hold the requests as other uids")
    attackers = [subprocess.Popen(
        ["/usr/bin/python3", "-I", "-c", FLOODER, broker.target.removeprefix("unix:"),
         "/grpc.health.v1.Health/Check", "", str(PER_PEER), "2", "2", "60"],
        stdout=subprocess.PIPE, text=True, user=uid, group=uid, extra_groups=[]) for uid in FOUR_UIDS]
    try:
        sent = []
        for attacker in attackers:
            assert attacker.stdout is not None
            sent.append(attacker.stdout.readline().strip())
        assert all(s.endswith(f"opened {PER_PEER} calls, the server ended 0") for s in sent), sent
        seen = [check(broker.target, timeout=10) for _ in range(TRIES)]
    finally:
        for attacker in attackers:
            attacker.kill()
            attacker.wait()
    print(f"\nuids {FOUR_UIDS} each held {PER_PEER} unfinished health requests; the readiness check: {seen}")
    failed = [what for passed, what in seen if not passed]
    assert not failed, (f"{len(FOUR_UIDS)} uids' {PER_PEER} unfinished health requests each failed {len(failed)} of "
                        f"{TRIES} readiness checks from uid 0: {failed[0]}")


def test_a_health_request_held_one_byte_short_ends_at_its_deadline(broker: BrokerProcess) -> None:
    request = health_pb2.HealthCheckRequest(service="").SerializeToString()
    call = Staged(broker.target.removeprefix("unix:"), "/grpc.health.v1.Health/Check", "", request)
    try:
        started = time.monotonic()
        ended = call.ended(REQUEST_TIMEOUT + 15)
        waited = time.monotonic() - started
    finally:
        call.close()
    print(f"\na Check held one byte short: ended by the broker: {ended}, after {waited:.1f} s "
          f"(request_message_timeout_seconds = {REQUEST_TIMEOUT:g}); trailers {call.trailers!r}")
    assert ended and not call.answered, (
        f"a health Check whose message never completed was still open {waited:.1f} s later "
        f"(request_message_timeout_seconds = {REQUEST_TIMEOUT:g})")
    assert b"request_message_timeout_seconds" in call.trailers, call.trailers  # (its grpc-message says why)
    assert waited >= REQUEST_TIMEOUT * 0.5, f"the held Check ended after {waited:.1f} s, before its deadline"
