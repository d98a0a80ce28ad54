"""Another local user's connect/close churn fills the listeners' backlog: every other client's NEW connection fails.

The hole: every raw listener accepts in the front's acceptor process, at nice +10, which names each peer and closes
what its per-peer connection rate refuses. That keeps the front's loop free, but the acceptor is one process at a
low priority working through one backlog (``listen(128)``) shared by every peer: a local user connecting and
closing in a loop (no byte sent, no token) queues connections faster than the acceptor refuses them, the backlog
stays full, and a Unix-socket ``connect()`` by anyone else then fails at once (``EAGAIN``: a non-blocking connect to
a full backlog), which gRPC reports as ``UNAVAILABLE: ... Transport endpoint is not connected``. The per-peer rate
cannot help: the refused connections are still in the one queue before the rate is applied.

Measured (PoCL broker, 2 shared cores; churners of uid 65533, ``connect(); close()`` in a loop, ~33,000 a second
each): alice's new channel + one ``ListDevices``: before 4-5 ms p50, all succeed; one churner: 4 of 20 failed
UNAVAILABLE, the rest 34 ms p50; two churners: 16 of 20 failed. Connections already open are not affected (the
existing churn test measures only those). The audit log meanwhile gets a refusal line every 0.1 s for as long as
the churn lasts.

Suggested fix: give each listener a large backlog (``SOMAXCONN``) and accept at the front's priority (the acceptor
costs the front's loop nothing either way); better, make refusing cheaper than connecting: refuse a uid over its
rate in the kernel (an ``SO_ATTACH_BPF``/``SO_ATTACH_REUSEPORT_EBPF`` filter, or a separate socket per
``socket_group`` member) or, for Unix sockets, give clients a listener the churner cannot reach (a per-tenant
directory of sockets with its own mode), so one uid's queue is never every uid's.
"""

from __future__ import annotations

import os
import subprocess
import time

import grpc
import pytest

from gpubroker.broker.launcher import BrokerProcess, TenantSpec
from gpubroker.v1 import broker_pb2 as pb
from gpubroker.v1 import broker_pb2_grpc as pb_grpc

from ..test_connection_churn_latency import CHURNER

ATTACKER_UID = 65533
CHURNERS = 2
ATTEMPTS = 20


def _new_connections(broker: BrokerProcess, n: int) -> list[str]:
    """Open ``n`` new channels as alice, one call each: what failed."""
    credentials = grpc.composite_channel_credentials(grpc.local_channel_credentials(grpc.LocalConnectionType.UDS),
                                                     grpc.access_token_call_credentials(broker.tokens["alice"]))
    failed = []
    for _ in range(n):
        try:
            with grpc.secure_channel(broker.target, credentials) as channel:
                pb_grpc.GpuBrokerStub(channel).ListDevices(pb.ListDevicesRequest(), timeout=30)
        except grpc.RpcError as exc:
            failed.append(f"{exc.code().name}: {(exc.details() or '')[:160]}")
        time.sleep(0.05)
    return failed


def test_another_users_churn_does_not_fail_new_connections() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to run the churner as another uid")
    with BrokerProcess([TenantSpec("alice")], backend="opencl", settings={"socket_mode": 0o666}) as broker:
        os.chmod(os.path.dirname(broker.target.removeprefix("unix:")), 0o755)  # (a local user in socket_group)
        path = broker.target.removeprefix("unix:")
        assert not _new_connections(broker, 5)
        churners = [subprocess.Popen(["/usr/bin/python3", "-I", "-c", CHURNER, path, "8"], stdout=subprocess.PIPE,
                                     text=True, user=ATTACKER_UID, group=ATTACKER_UID, extra_groups=[])
                    for _ in range(CHURNERS)]
        try:
            for churner in churners:
                assert churner.stdout is not None and churner.stdout.readline().strip() == "churning"
            time.sleep(1.0)
            failed = _new_connections(broker, ATTEMPTS)
        finally:
            for churner in churners:
                churner.kill()
                churner.wait()
        assert not failed, (f"{len(failed)} of alice's {ATTEMPTS} new connections failed while uid {ATTACKER_UID} "
                            f"connected and closed in a loop ({CHURNERS} processes): {failed[0]}")
