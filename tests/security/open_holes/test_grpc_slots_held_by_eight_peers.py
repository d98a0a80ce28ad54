"""Eight unauthenticated peers hold every gRPC connection of the broker: every tenant is locked out.

The hole: ``max_grpc_connections`` (512) is one pool for all peers, and ``max_grpc_connections_per_peer`` (64) is
the only thing between one party and that pool; gRPC's idle close (``grpc_idle_seconds``) counts a failed,
unauthenticated call as activity. A peer is a uid on a Unix socket or on TCP from this host, a /24 or /64 on other
TCP, a CID on vsock: eight of them are cheap (eight uids in a container's user namespace, eight /64s of one
IPv6 /56 a home line gets), and none needs a token. Each keeps its 64 connections from idling by a call with a
wrong token every few seconds (about 100 calls a second in all, far below the per-peer call rate), and the gate
refuses every other connection.

Measured (8 uids x 64 connections, each a ListDevices with a bad token every 5 s): bob, a tenant with a valid
token, failed 20 of 20 connects in 20 s (UNAVAILABLE: connection reset), the log says "512 gRPC connections open,
the broker's max_grpc_connections (512)".

Suggested fix: never let unauthenticated connections fill the pool: a connection that has not carried an
authenticated call within ``hello_timeout_seconds`` (gRPC's handshake timeout) is closed, whatever calls it made,
and failing calls do not reset the idle clock; keep a share of ``max_grpc_connections`` for connections that have
authenticated (per tenant: max_grpc_connections / tenants at least), and when the pool is full evict the oldest
connection that never authenticated rather than refusing the newcomer.
"""

from __future__ import annotations

import os
import time

import grpc

from gpubroker.broker.launcher import BrokerProcess, TenantSpec
from gpubroker.client import connect
from gpubroker.v1 import broker_pb2 as pb
from gpubroker.v1 import broker_pb2_grpc as pbg

PEERS, PER_PEER, HOLD = 8, 64, 30


def _hold(target: str, uid: int) -> None:
    """One peer (a uid of its own): 64 connections, each kept busy by a failing call every 5 s."""
    os.setgid(uid)
    os.setuid(uid)
    stubs = [pbg.GpuBrokerStub(grpc.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)]))
             for _ in range(PER_PEER)]
    end = time.time() + HOLD
    while time.time() < end:
        calls = [s.ListDevices.future(pb.ListDevicesRequest(), metadata=[("authorization", "Bearer gpb_x.y")],
                                      timeout=20) for s in stubs]
        for call in calls:
            try:
                call.result()
            except grpc.RpcError:
                pass
        time.sleep(5)


def test_unauthenticated_peers_cannot_lock_a_tenant_out_of_grpc() -> None:
    with BrokerProcess([TenantSpec("bob")], backend="opencl", settings={"socket_mode": 0o666}) as broker:
        assert broker.workdir is not None
        os.chmod(broker.workdir, 0o755)  # (the socket open to other local users, as socket_mode/socket_group allow)
        pids = []
        for n in range(PEERS):
            pid = os.fork()
            if pid == 0:
                try:
                    _hold(broker.target, 20001 + n)
                finally:
                    os._exit(0)
            pids.append(pid)
        try:
            time.sleep(10)
            ok = failed = 0
            for _ in range(10):
                try:
                    gpu = connect(broker.target, token=broker.tokens["bob"], timeout=5)
                    gpu.device_info()
                    gpu.close()
                    ok += 1
                except Exception:
                    failed += 1
                time.sleep(1)
        finally:
            for pid in pids:
                os.kill(pid, 9)
                os.waitpid(pid, 0)
        assert failed == 0, f"bob, with a valid token, failed {failed} of {ok + failed} connects"
