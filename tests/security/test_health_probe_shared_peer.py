"""Any local user of the broker's Unix socket makes the broker's own readiness probe fail, for as long as it likes:
the health service's per-peer counts see every Unix-socket peer as ONE peer ("unix"), and every local TCP peer as
one peer ("ipv4").

The hole: ``StreamLimiter`` (broker/front/_health.py) counts health requests on their way in (and Watch and
reflection streams) per ``_peer_host(grpc_peer(context))``. ``grpc_peer`` names a gated connection's peer by its
uid (``unix:PATH uid=N``, ``ipv4:127.0.0.1:PORT uid=N``), but ``_peer_host`` keeps only the scheme of anything
that is not a remote address: "unix" for every Unix-socket peer, "ipv4" for every local TCP one (it cannot parse
the `` uid=N`` suffix). A health request whose message is announced and never completed is read with no deadline
(``Unread.read`` of an unauthenticated health call has no ``request_message_timeout_seconds``; only the
connection's keepalive ends it), so one local user
holding ``max_health_streams_per_peer`` (16) such Check requests on one connection takes the whole "unix" share:
every other local user's Check gets RESOURCE_EXHAUSTED. That includes the broker's own probes: the DaemonSet's
readinessProbe execs ``python -m gpubroker.broker.healthcheck --target unix:/run/gpubroker/gpubroker.sock``
(failureThreshold 2, period 10 s), so a tenant's pod that can reach the socket takes the node's broker out of the
Service within ~20 s and keeps it out; the SDK's multi-broker placement (``_endpoints._health_problem``) likewise
skips the broker for every other local client. docs/operator/monitoring.md says "every local peer of a Unix socket
counts as one", on the premise that gRPC does not say which uid a call came from: the gRPC gate now does.

Measured (2-core VM, PoCL, defaults; socket_mode 0666): uid 65534 held 16 health Check calls, each one byte short
of its 5-byte-header + 2-byte message, on one connection; the broker's readiness check run as root then got
``RESOURCE_EXHAUSTED: too many open requests: this peer has 16 Check requests open, max_health_streams_per_peer is
16`` on every try. (A holder that stopped answering gRPC's keepalive pings lost its calls within 30 s; the checks
were SERVING again at 30, 60 and 90 s. One that answers the pings, or opens 16 new calls when the old end, keeps
every other local peer's checks failing for as long as it likes.)

Suggested fix: count health requests and streams by ``Peer.key`` as the gate names it (the uid of a local peer,
the network of a remote one): ``grpc_peer``'s ``uid=N`` (or the gate's ``_Relay.peer.key``) rather than
``_peer_host``; and give an unauthenticated health request's message a deadline (request_message_timeout_seconds)
as authenticated calls have.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator

import pytest

from gpubroker.broker.healthcheck import check
from gpubroker.broker.launcher import BrokerProcess, TenantSpec

from ..test_grpc_partial_messages import FLOODER

ATTACKER_UID = 65534
PER_PEER = 16  # max_health_streams_per_peer (the default)
TRIES = 3  # readiness checks from root while the attacker holds its requests (the DaemonSet fails at 2)


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerProcess]:
    tmp = tmp_path_factory.mktemp("health-peer")
    settings = {"cache_dir": str(tmp / "caches"), "socket_mode": 0o666}
    with BrokerProcess([TenantSpec("alice")], backend="opencl", settings=settings) as proc:
        os.chmod(os.path.dirname(proc.target.removeprefix("unix:")), 0o755)  # (a local user in socket_group)
        yield proc


def test_one_local_user_cannot_fail_the_brokers_readiness_probe(broker: BrokerProcess) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to hold the requests as another uid")
    assert check(broker.target, timeout=10) == (True, "SERVING")

    def drop() -> None:
        os.setgid(ATTACKER_UID)
        os.setuid(ATTACKER_UID)

    # 16 Check calls, each message announced at 2 bytes and sent one byte short, for 2 s; then held for 60 s.
    attacker = subprocess.Popen(
        ["/usr/bin/python3", "-I", "-c", FLOODER, broker.target.removeprefix("unix:"),
         "/grpc.health.v1.Health/Check", "", str(PER_PEER), "2", "2", "60"],
        stdout=subprocess.PIPE, text=True, preexec_fn=drop)
    try:
        assert attacker.stdout is not None
        sent = attacker.stdout.readline().strip()  # (printed once its calls are open: it holds them from here)
        assert sent.startswith("sent "), sent
        seen = [check(broker.target, timeout=10) for _ in range(TRIES)]
    finally:
        attacker.kill()
        attacker.wait()
    print(f"\nuid {ATTACKER_UID}: {sent}; the readiness check from uid 0 meanwhile: {seen}")
    failed = [what for passed, what in seen if not passed]
    assert not failed, (f"uid {ATTACKER_UID}'s {PER_PEER} unfinished health requests failed {len(failed)} of {TRIES} "
                        f"readiness checks from uid 0: {failed[0]}")
