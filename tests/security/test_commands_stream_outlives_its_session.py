"""A gRPC Commands stream keeps serving its session after the session was closed, cancelled or expired.

The hole (issue 24's CloseSession(cancel=True), attacked with copies and commands in flight): ``Commands``
(front/_service.py) resolves its session once, from its first batch, and ``CommandRunner.execute`` then only asks
``session.check_alive()`` (the worker's fault, ``lost``), never whether the session is still in the manager's list.
A close (``sessions.close``: CloseSession, with or without ``cancel``) or an expiry (``end``) runs the closing hooks,
which end the session's links (ring, link: those are refused at once, "has ended"), but nothing ends its Commands
streams. Their next batches run in the worker, whose ``HandleTables.session`` creates a new, empty table for the
closed id: a ghost session that the front no longer lists, counts or closes.

The attack (measured, a tenant on its own): alice connects with ``transport="grpc"``, closes her session from a
second stub (``CloseSession(cancel=True)``), and goes on over the same client: ``allocate_memory(100 MiB)``,
``memset`` and ``synchronize`` are all served. After the client closes, nobody frees it: ListDevices shows alice's
``memory_used`` at 100 MiB with none of her sessions holding anything, until her worker exits (never, while she
keeps any other session open). Four such ghosts served at once with ``max_sessions_per_tenant=2`` (one live):
the session limit, and per-session limits (handles, streams) that bound a worker, no longer bound a tenant. The
charge stays with the tenant (its quota, its turns), so other tenants are not hurt; it breaks the accounting the
close is for, and what a cancel promises (the session's work abandoned, nothing left running for it).

Suggested fix: a session ended (its ``_remove``) must end its calls too: keep its streams' guards (as the
revocation's ``_Revocable``) and cancel them in ``_remove``, or check in ``CommandRunner.execute`` that
``sessions.sessions.get(session.id) is session`` (NOT_FOUND "has ended" otherwise); and the worker should refuse a
batch for a session it closed (a set of closed ids) rather than create its table again.

The fix (front/_sessions.py, front/_commands.py): a session taken off the list is marked ended (``Session.ended``,
with why), and ``check_alive`` refuses it ("has ended: ..., open a new session"): every batch is checked as it
starts and again once it has its turn, so none reaches the worker after the session's CloseSession.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from gpubroker.broker.launcher import BrokerProcess, TenantSpec
from gpubroker.client import GpuBrokerError, connect
from gpubroker.client._channel import make_channel
from gpubroker.v1 import broker_pb2 as pb
from gpubroker.v1 import broker_pb2_grpc as pb_grpc

MIB = 1 << 20


@pytest.fixture(scope="module")
def broker() -> Iterator[BrokerProcess]:
    with BrokerProcess([TenantSpec("alice"), TenantSpec("bob")], backend="opencl",
                       settings={"max_sessions_per_tenant": 2}) as proc:
        yield proc


def test_a_closed_sessions_commands_stream_is_refused_and_leaves_nothing(broker: BrokerProcess) -> None:
    stub = pb_grpc.GpuBrokerStub(make_channel(broker.target, broker.tokens["alice"])[0])
    with connect(broker.target, token=broker.tokens["alice"]) as keep:  # (keeps alice's worker)
        gpu = connect(broker.target, token=broker.tokens["alice"], transport="grpc")
        gpu.allocate_memory(64)  # (the Commands stream is open)
        stub.CloseSession(pb.CloseSessionRequest(session=gpu.session, cancel=True), timeout=10)
        served = True
        try:
            buf = gpu.allocate_memory(100 * MIB)
            gpu.memset(buf, 9)
            gpu.synchronize(timeout=30)
        except GpuBrokerError:
            served = False
        try:
            gpu.close()
        except GpuBrokerError:
            pass
        used = stub.ListDevices(pb.ListDevicesRequest(), timeout=10).devices[0].memory_used
        keep.allocate_memory(64)
        assert not served, "a cancelled session's Commands stream went on allocating (a ghost session)"
        assert used < MIB, f"{used} bytes held by alice's worker for a session that has ended"


def test_ghost_sessions_do_not_escape_the_session_limit(broker: BrokerProcess) -> None:
    stub = pb_grpc.GpuBrokerStub(make_channel(broker.target, broker.tokens["alice"])[0])
    ghosts = []
    try:
        for _ in range(4):
            gpu = connect(broker.target, token=broker.tokens["alice"], transport="grpc")
            gpu.allocate_memory(64)
            stub.CloseSession(pb.CloseSessionRequest(session=gpu.session), timeout=10)
            ghosts.append(gpu)
        serving = 0
        for gpu in ghosts:
            try:
                gpu.allocate_memory(MIB)
                gpu.synchronize(timeout=30)
                serving += 1
            except GpuBrokerError:
                pass
        assert serving == 0, f"{serving} closed sessions still served (max_sessions_per_tenant is 2)"
    finally:
        for gpu in ghosts:
            try:
                gpu.close()
            except GpuBrokerError:
                pass
