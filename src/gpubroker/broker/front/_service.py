"""The GpuBroker gRPC service: authenticate, turn each typed call into protocol commands, run them in the tenant's
worker (server/_commands.py), and answer from the worker's Ack."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import functools
import logging
from collections.abc import AsyncIterator, Awaitable, Iterable, Iterator
from typing import Any, TypeVar

from gpubroker.broker.config import BrokerConfig
from gpubroker.broker.front import _commands as commands
from gpubroker.broker.front._commands import CommandRunner
from gpubroker.broker.front._copies import read_chunks, write_chunks
from gpubroker.broker.front._peer import PeerCopier
from gpubroker.broker.front._retire import WorkerCredentials
from gpubroker.broker.front._sessions import Session, SessionManager
from gpubroker.broker.front._status import Context, admitted, principal_of, release_slot, rpc, stream_rpc
from gpubroker.broker.front.auth import Authenticator, Principal
from gpubroker.broker.front.scheduler import DeviceScheduler
from gpubroker.broker.front.workers import device_info_from_dict
from gpubroker.v1 import broker_pb2 as pb
from gpubroker.v1 import broker_pb2_grpc as pb_grpc
from gpubroker.wire.commands import (
    MAX_FRONT_COMMANDS,
    Allocate,
    Command,
    CreateStream,
    GetKernel,
    LoadModule,
    Read,
    Synchronize,
    encode,
    outline_batch,
)
from gpubroker.wire.errors import (
    Cancelled,
    GpuBrokerError,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    Unauthenticated,
)
from gpubroker.wire.types import DeviceInfo

__all__ = ["GpuBrokerService", "device_info_to_pb"]

# Batches of one Commands stream read before their acks went out: a client keeps at most 4 unacknowledged (its
# window, gpubroker/client/_transports/_core.py), so this overlaps all it sends; the front holds no more than 4 batches
# (each at most chunk_bytes + 64 KiB) of a stream, whatever a client sends, and all of a tenant's streams together
# no more than max_read_ahead_bytes_per_tenant of them (_ReadAheadBudget).
READ_AHEAD = 4
REVOKED_MESSAGE = ("the token that opened this stream was rotated or its tenant removed; reconnect with the "
                   "current token")
T = TypeVar("T")
# How long a cancelled session's work may take to finish before its worker is stopped (CloseSession with cancel).
CANCEL_GRACE = 1.0

log = logging.getLogger("gpubroker.sessions")


class _Revocable:
    """A stream's hold on its credential: at a revocation, whatever the stream awaits is cancelled and the stream
    ends with UNAUTHENTICATED (the same revocation retires the session's worker: _retire.py)."""

    def __init__(self) -> None:
        self.revoked = False
        # What the stream awaits: its next request and, while batches run ahead (Commands), the next ack.
        self._pending: set[asyncio.Future[Any]] = set()

    def revoke(self) -> None:
        self.revoked = True
        for future in self._pending:
            future.cancel()

    async def run(self, awaitable: Awaitable[T]) -> T:
        if self.revoked:
            raise Unauthenticated(REVOKED_MESSAGE)
        future = asyncio.ensure_future(awaitable)
        self._pending.add(future)
        try:
            return await future
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if self.revoked and (task is None or not task.cancelling()):  # ours, not the call's cancellation
                raise Unauthenticated(REVOKED_MESSAGE) from None
            raise
        finally:
            self._pending.discard(future)

    async def iterate(self, items: AsyncIterator[T]) -> AsyncIterator[T]:
        iterator = aiter(items)
        while True:
            try:
                item = await self.run(anext(iterator))
            except StopAsyncIteration:
                return
            yield item


class _ReadAheadBudget:
    """The bytes of a tenant's batches that its Commands streams have read and not yet finished running, shared by
    all of them: a stream decodes a batch it has read only once the tenant's budget has room for it (a batch
    larger than the whole budget waits until the tenant holds nothing else). Decoding and queueing multiply a
    batch's size several times over in the front, so this, not the count per stream, is what bounds a tenant's
    share of the front's memory however many streams the call limits let it open. Waiters are served in order."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self._waiters: collections.deque[tuple[int, asyncio.Future[None]]] = collections.deque()

    def _fits(self, size: int) -> bool:
        return self.used == 0 or self.used + size <= self.limit

    def try_acquire(self, size: int) -> bool:
        """Take ``size`` now if it fits and nobody waits ahead of it."""
        if not self._waiters and self._fits(size):
            self.used += size
            return True
        return False

    async def acquire(self, size: int) -> None:
        if self.try_acquire(size):
            return
        entry = (size, asyncio.get_running_loop().create_future())
        self._waiters.append(entry)
        try:
            await entry[1]
        except asyncio.CancelledError:
            if entry in self._waiters:
                self._waiters.remove(entry)
                self._grant()  # (a big batch that left may have held smaller ones back)
            elif not entry[1].cancelled():
                self.release(size)  # granted as the stream was cancelled
            raise

    def release(self, size: int) -> None:
        self.used -= size
        self._grant()

    def charge(self, size: int) -> None:
        """Count ``size`` more (what was taken turned out larger), room or not: later takers wait until it is
        released."""
        self.used += size

    def _grant(self) -> None:
        while self._waiters and self._fits(self._waiters[0][0]):
            size, granted = self._waiters.popleft()
            if granted.done():  # (cancelled with its task, which has yet to run to take itself out: nothing held)
                continue
            self.used += size
            granted.set_result(None)


class _Replies:
    """One call's share of its tenant's budget of replies not yet sent (``max_unsent_reply_bytes_per_tenant``): a
    reply's bytes are taken before the work that produces them starts (a Read's size is known from its command),
    settled to the reply's real size once it is there, and released when gRPC has taken it (the ``yield`` that
    hands it over returns once gRPC has written it out, which HTTP/2 flow control holds back while the client
    does not read). What the call still holds at its end is released then."""

    def __init__(self, budget: _ReadAheadBudget) -> None:
        self.budget = budget
        self.held = 0
        self.closed = False

    def try_reserve(self, size: int) -> bool:
        if self.closed or not self.budget.try_acquire(size):
            return self.closed
        self.held += size
        return True

    async def reserve(self, size: int) -> None:
        if not self.closed:
            await self.budget.acquire(size)
            if self.closed:  # (granted as the call ended: what it produces now goes nowhere)
                self.budget.release(size)
            else:
                self.held += size

    def settle(self, reserved: int, size: int) -> None:
        """The reply reserved as ``reserved`` bytes is ``size`` (a larger one is counted all the same)."""
        if size > reserved and not self.closed:
            self.budget.charge(size - reserved)
            self.held += size - reserved
        elif size < reserved:
            self.release(reserved - size)

    def release(self, size: int) -> None:
        size = min(size, self.held)
        self.held -= size
        self.budget.release(size)

    def close(self) -> None:
        self.release(self.held)
        self.closed = True


def _reply_bytes(commands: Iterable[Command], limit: int) -> int:
    """What a batch's ack will carry, as far as its commands say: its Reads' bytes (an ack larger than ``limit``,
    the largest message, is refused rather than sent)."""
    return min(sum(command.size for command in commands if isinstance(command, Read)), limit)


def _passed(sent: asyncio.Future[None], task: asyncio.Future[Any]) -> None:
    """A batch that finished without reaching the worker (nothing to run) lets the next one go; one that failed
    stops it (the stream ends with the failure)."""
    if not sent.done():
        if task.cancelled() or task.exception() is not None:
            sent.cancel()
        else:
            sent.set_result(None)


def _released(budget: _ReadAheadBudget, size: int, task: asyncio.Future[Any]) -> None:
    budget.release(size)


def _consume(future: asyncio.Future[Any]) -> None:
    """Retrieve an abandoned future's outcome so asyncio does not log 'exception was never retrieved'."""
    if not future.cancelled():
        future.exception()


def _tenant_budget(budgets: dict[str, _ReadAheadBudget], tenant: str, limit: int) -> _ReadAheadBudget:
    budget = budgets.get(tenant)
    if budget is None:
        budget = budgets[tenant] = _ReadAheadBudget(limit)
    budget.limit = limit  # (a reload may change it)
    return budget


def device_info_to_pb(info: DeviceInfo) -> pb.DeviceInfo:
    fields: dict[str, Any] = dataclasses.asdict(info)
    fields["compute_capability"] = list(info.compute_capability or ())
    fields["opencl_version"] = info.opencl_version or ""
    fields["health"] = info.health or ""
    fields["sandbox"] = info.sandbox or ""
    for key in ("memory_quota", "memory_used", "memory_available"):
        if fields[key] is None:
            del fields[key]
    return pb.DeviceInfo(**fields)


class GpuBrokerService(pb_grpc.GpuBrokerServicer):
    def __init__(self, config: BrokerConfig, auth: Authenticator, sessions: SessionManager,
                 devices: list[DeviceInfo], schedulers: dict[int, DeviceScheduler], sandbox: str = "") -> None:
        self.config = config
        self.sandbox = sandbox  # how workers are sandboxed, told to every tenant with its devices
        self.auth = auth
        self.sessions = sessions
        self.devices = devices
        self.schedulers = schedulers
        self.peers = PeerCopier(config, sessions, schedulers)
        self.runner = CommandRunner(config, sessions, schedulers, self.peers.before_free)
        # Which credentials each worker ran something for: a revocation of one ends those workers (_retire.py).
        self.credentials = WorkerCredentials(auth, sessions.pool)
        sessions.abandon = self._abandon_work  # an expired session's work, as a cancelled one's
        self._budgets: dict[str, _ReadAheadBudget] = {}  # per tenant: its Commands streams' read-ahead
        self._reply_budgets: dict[str, _ReadAheadBudget] = {}  # per tenant: its calls' replies not yet sent
        # Where the session's link is served besides <socket>.fast (the Broker sets them once listening).
        self.link_port = 0
        self.link_vsock_port = 0

    # -- helpers -----------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _revocable(self, principal: Principal) -> Iterator[_Revocable]:
        """Streams outlive the call that authenticated them: they end when that credential is revoked."""
        guard = _Revocable()
        watch = self.auth.revocations.watch(principal, guard.revoke)
        try:
            yield guard
        finally:
            self.auth.revocations.unwatch(principal, watch)

    def _tenant(self, context: Context) -> str:
        return principal_of(self.auth, context).tenant

    def _session(self, context: Context, session_id: str, tenant: str | None = None) -> Session:
        """The caller's live session, holding one of its concurrent-RPC slots until the call ends; its worker is
        retired if the caller's credential is revoked."""
        principal = principal_of(self.auth, context)
        session = self.sessions.get(session_id, tenant or principal.tenant)
        self.credentials.used(session.check_alive(), principal)
        self.admit(session)
        admitted.set(session)
        return session

    def admit(self, session: Session) -> None:
        """Take one of the session's concurrent-call slots, or refuse (the call holds its tenant's already: every
        call counts against max_inflight_per_tenant from its authentication, server/_status.py)."""
        if session.inflight >= self.config.max_concurrent_rpcs_per_session:
            raise ResourceExhausted(f"this session already has {session.inflight} calls in flight, the limit")
        session.inflight += 1

    def _tenant_view(self, tenant: str, device: int, info: DeviceInfo, live: bool = True) -> pb.DeviceInfo:
        """The device as ``tenant`` sees it: the broker's index, its quota and use there, and the device's health."""
        quota = self.sessions.quota(tenant, device)
        used = self.sessions.used(tenant, device)
        available = max(0, min(quota - used, info.free_memory)) if live else None
        view = device_info_to_pb(dataclasses.replace(info, id=device, memory_quota=quota, memory_used=used,
                                                     memory_available=available))
        admission = self.sessions.admission
        problem = admission.problem(device) if admission is not None else None
        if self.sessions.draining:
            problem = "the broker is draining"
        view.health, view.health_reason = ("NOT_SERVING", problem) if problem else ("SERVING", "")
        view.sandbox = self.sandbox
        return view

    # -- sessions ----------------------------------------------------------------------------------
    @rpc
    async def OpenSession(self, request: pb.OpenSessionRequest, context: Context) -> pb.OpenSessionResponse:
        principal = principal_of(self.auth, context)
        tenant = principal.tenant
        if not request.any_device and request.device >= len(self.devices):
            raise NotFound(f"no device {request.device}: this broker serves {len(self.devices)} (device=0 to "
                           f"{len(self.devices) - 1}; list_devices() or `gpubroker devices --target ...` lists them)")
        session = await self.sessions.open(tenant, None if request.any_device else request.device)
        try:
            self.credentials.used(session.worker, principal)  # (revoked while the worker started: no session)
        except Unauthenticated:
            await self.sessions.close(session, reason="closed: its token was revoked as it opened")
            raise
        try:
            info = await self._device_info(session)
        except BaseException:
            # (its worker failed, or the client gave up, before the open was answered: no client holds the session)
            self.sessions.end(session, reason="closed: its opening failed")
            raise
        session.answered = True
        return pb.OpenSessionResponse(
            session=session.id, lease_seconds=session.lease_seconds, max_chunk_bytes=self.config.chunk_bytes,
            device=self._tenant_view(tenant, session.device, info), link_port=self.link_port,
            link_vsock_port=self.link_vsock_port)

    async def _device_info(self, session: Session) -> DeviceInfo:
        """The device as the worker describes it now (its memory use then mirrored)."""
        ack = await self.runner.run(session, commands.device_info_commands(pb.SessionRequest()))
        info = device_info_from_dict(ack.result)  # (checked already, with the Ack)
        if info.memory_used is not None:
            session.worker.memory_reported(info.memory_used)
        return info

    @rpc
    async def CloseSession(self, request: pb.CloseSessionRequest, context: Context) -> pb.Empty:
        session = self.sessions.get(request.session, self._tenant(context))
        if request.cancel:
            await self._abandon_work(session, "was cancelled by its client")
            await self.sessions.close(session, reason="closed (cancelled by its client)")
        else:
            await self.sessions.close(session)
        return pb.Empty()

    async def _abandon_work(self, session: Session, what: str) -> None:
        """A cancel, or a lease that expired (its client is gone: killed in a wait, say): the session's work (a
        kernel still running, work queued before it) is waited for at most ``CANCEL_GRACE``; past it the session's
        worker is stopped, unless it serves the tenant's other sessions too: they go on, and the work finishes
        there unwaited for. (The wait covers the worker's whole queue, the other sessions' work too, and nothing
        tells whose work runs: so an idle session's expiry never stops a worker another session of the tenant
        keeps busy. A session still opening does not count: a killed script's rerun, whose open waits for the
        worker behind the abandoned work.) The stop is nobody's failure (the tenant's client asked for it, or
        left); the work's device time is charged up to it (the scheduler's fence)."""
        batch, data = commands.pack([Synchronize()])  # (waits for the session's work; runs nothing of its own)
        settled = asyncio.ensure_future(session.worker.run_batch(session.id, batch, data))
        settled.add_done_callback(_outcome_unread)
        done, _ = await asyncio.wait({settled}, timeout=CANCEL_GRACE)
        if done or not session.worker.alive:
            return
        # (a session still opening is not one to spare: its client has nothing yet, and its open waits behind the
        # very work abandoned here, as a killed script's rerun does)
        others = any(other is not session and other.worker is session.worker and other.answered
                     for other in self.sessions.sessions.values())
        if others:
            log.info("session %s of tenant %s %s: its work goes on in the worker the tenant's other sessions use",
                     session.id, session.tenant, what)
            return
        log.info("session %s of tenant %s %s while its work ran: its worker is stopped", session.id, session.tenant,
                 what)
        self.sessions.pool.retire(session.worker, Cancelled(
            f"session {session.id} of tenant {session.tenant} {what} while its work ran; the worker was stopped"))

    @rpc
    async def Heartbeat(self, request: pb.SessionRequest, context: Context) -> pb.HeartbeatResponse:
        session = self._session(context, request.session)
        return pb.HeartbeatResponse(lease_seconds=session.lease_seconds)

    # -- devices -----------------------------------------------------------------------------------
    @rpc
    async def ListDevices(self, request: pb.ListDevicesRequest, context: Context) -> pb.ListDevicesResponse:
        tenant = self._tenant(context)
        await self.sessions.refresh_tenant(tenant)
        return pb.ListDevicesResponse(devices=[self._tenant_view(tenant, i, d, live=False)
                                               for i, d in enumerate(self.devices)])

    @rpc
    async def GetDeviceInfo(self, request: pb.SessionRequest, context: Context) -> pb.DeviceInfo:
        session = self._session(context, request.session)
        return self._tenant_view(session.tenant, session.device, await self._device_info(session))

    # -- memory ------------------------------------------------------------------------------------
    @rpc
    async def Allocate(self, request: pb.AllocateRequest, context: Context) -> pb.BufferHandle:
        session = self._session(context, request.session)
        allocate = commands.allocate_commands(request)
        await self.runner.run(session, allocate)  # over the quota: the worker's RESOURCE_EXHAUSTED
        assert isinstance(allocate[0], Allocate)
        return pb.BufferHandle(handle=allocate[0].handle, size=request.size)

    @rpc
    async def Free(self, request: pb.FreeRequest, context: Context) -> pb.Empty:
        await self.runner.run(self._session(context, request.session), commands.free_commands(request))
        return pb.Empty()

    @rpc
    async def Memset(self, request: pb.MemsetRequest, context: Context) -> pb.Empty:
        await self.runner.run(self._session(context, request.session), commands.memset_commands(request))
        return pb.Empty()

    @rpc
    async def CopyDeviceToDevice(self, request: pb.CopyDeviceToDeviceRequest, context: Context) -> pb.Empty:
        await self.runner.run(self._session(context, request.session), commands.copy_d2d_commands(request))
        return pb.Empty()

    @rpc
    async def CopyHostToDevice(self, request_iterator: AsyncIterator[pb.HostToDeviceChunk],
                               context: Context) -> pb.Empty:
        principal = principal_of(self.auth, context)
        with self._revocable(principal) as guard:
            requests = guard.iterate(request_iterator)
            first = await anext(requests, None)
            if first is None or not first.HasField("header"):
                raise InvalidArgument("the first chunk must carry the copy header")
            header = first.header
            session = self._session(context, header.session, principal.tenant)
            if header.offset < 0 or header.size < 0:
                raise InvalidArgument(f"copy offset and size must be >= 0, got {header.offset} and {header.size}")
            await write_chunks(self.runner.run, session, header, first, requests, self.config.chunk_bytes)
        return pb.Empty()

    @stream_rpc
    async def CopyDeviceToHost(self, request: pb.CopyDeviceToHostRequest, context: Context
                               ) -> AsyncIterator[pb.DeviceToHostChunk]:
        principal = principal_of(self.auth, context)
        session = self._session(context, request.session, principal.tenant)
        if request.offset < 0 or request.size < 0:
            raise InvalidArgument(f"copy offset and size must be >= 0, got {request.offset} and {request.size}")
        chunk = min(request.chunk_bytes or self.config.chunk_bytes, self.config.chunk_bytes)
        replies = _Replies(self._reply_budget(principal.tenant))
        with self._revocable(principal) as guard:
            try:
                async for message in guard.iterate(read_chunks(self.runner.run, session, request, chunk, replies)):
                    yield message
            finally:
                replies.close()

    @rpc
    async def CopyShared(self, request: pb.CopySharedRequest, context: Context) -> pb.Empty:
        session = self._session(context, request.session)
        for piece in commands.copy_shared_commands(request):  # each piece its own turn
            await self.runner.run(session, [piece])
        return pb.Empty()

    # -- code --------------------------------------------------------------------------------------
    @rpc
    async def LoadModule(self, request: pb.LoadModuleRequest, context: Context) -> pb.ModuleHandle:
        session = self._session(context, request.session)
        load = commands.load_module_commands(request)
        ack = await self.runner.run(session, load)  # (compile_timeout_seconds and the restart: the runner's)
        assert isinstance(load[0], LoadModule)
        return pb.ModuleHandle(handle=load[0].handle, kernel_names=ack.result)

    @rpc
    async def GetKernel(self, request: pb.GetKernelRequest, context: Context) -> pb.KernelHandle:
        session = self._session(context, request.session)
        get = commands.get_kernel_commands(request)
        await self.runner.run(session, get)
        assert isinstance(get[0], GetKernel)
        return pb.KernelHandle(handle=get[0].handle, name=request.name)

    @rpc
    async def LaunchKernel(self, request: pb.LaunchKernelRequest, context: Context) -> pb.Empty:
        await self.runner.run(self._session(context, request.session), commands.launch_commands(request))
        return pb.Empty()

    @stream_rpc
    async def Commands(self, request_iterator: AsyncIterator[pb.CommandBatch], context: Context
                       ) -> AsyncIterator[pb.BatchAck]:
        """Batches run in order, each under one scheduler turn; a failure is acknowledged, not raised.

        The stream is one of its session's calls in flight (the call limits count it, like every call, for as long
        as it is open). It reads ahead: while a batch runs, the next ones are received, decoded and queued behind
        it in the worker, so a client's pipelined batches (a copy's chunks) overlap the stream, the front and the
        worker rather than taking turns. At most READ_AHEAD batches are read and not yet acknowledged, and all the
        tenant's streams together hold at most its read-ahead budget of batches not yet run.
        """
        principal = principal_of(self.auth, context)
        with self._revocable(principal) as guard:
            requests = guard.iterate(request_iterator)
            first = await anext(requests, None)
            if first is None:
                return
            session = self._session(context, first.session, principal.tenant)  # (the slot: the wrapper releases it)
            budget = self._read_ahead_budget(principal.tenant)
            replies = _Replies(self._reply_budget(principal.tenant))
            acks: asyncio.Queue[asyncio.Future[tuple[pb.BatchAck, int]] | None] = asyncio.Queue()
            room = asyncio.Semaphore(READ_AHEAD - 1)  # (the first batch holds one)
            reader = asyncio.ensure_future(self._read_ahead(first, requests, session, budget, replies, acks, room))
            try:
                while (ack := await guard.run(acks.get())) is not None:
                    message, counted = await guard.run(ack)
                    yield message
                    replies.release(counted)  # (gRPC has written it out: the client is reading)
                    room.release()
            finally:
                reader.cancel()
                reader.add_done_callback(_consume)
                while not acks.empty():
                    if (left := acks.get_nowait()) is not None:
                        left.cancel()
                        left.add_done_callback(_consume)
                replies.close()  # (the acks never sent; a batch still running counts nothing from here on)

    def _read_ahead_budget(self, tenant: str) -> _ReadAheadBudget:
        return _tenant_budget(self._budgets, tenant, self.config.max_read_ahead_bytes_per_tenant)

    def _reply_budget(self, tenant: str) -> _ReadAheadBudget:
        return _tenant_budget(self._reply_budgets, tenant, self.config.max_unsent_reply_bytes_per_tenant)

    async def _read_ahead(self, first: pb.CommandBatch, requests: AsyncIterator[pb.CommandBatch], session: Session,
                          budget: _ReadAheadBudget, replies: _Replies,
                          acks: asyncio.Queue[asyncio.Future[tuple[pb.BatchAck, int]] | None],
                          room: asyncio.Semaphore) -> None:
        """Read the stream's batches (``room`` and the tenant's ``budget`` permitting) and start each behind the
        one before it; the acks' futures go to ``acks`` in order, then None at the stream's end, or the failure
        that ended it. A batch's bytes count against the budget from before it is decoded until it has run; its
        ack's against ``replies`` from before it runs until gRPC has sent it."""
        loop = asyncio.get_running_loop()
        sent: asyncio.Future[None] | None = None
        batch: pb.CommandBatch | None = first
        running: set[asyncio.Future[tuple[pb.BatchAck, int]]] = set()
        try:
            while batch is not None:
                size = batch.ByteSize()
                await budget.acquire(size)
                after, sent = sent, loop.create_future()
                try:
                    task = asyncio.ensure_future(self.run_batch(session, batch, after, sent, replies))
                except BaseException:
                    budget.release(size)
                    raise
                running.add(task)
                task.add_done_callback(running.discard)
                task.add_done_callback(functools.partial(_passed, sent))
                task.add_done_callback(functools.partial(_released, budget, size))
                acks.put_nowait(task)
                del batch  # (its task holds it until it has run)
                await room.acquire()
                if running:
                    # Reading ahead: only while the tenant has room for another batch (not reserved: a stream
                    # whose client sends nothing must not hold the tenant's budget), so the message waits in
                    # gRPC's flow control rather than in the front, decoded.
                    hint = min(self.config.max_message_bytes, budget.limit)
                    await budget.acquire(hint)
                    budget.release(hint)
                batch = await anext(requests, None)
            acks.put_nowait(None)
        except Exception as exc:  # (a malformed message, an unknown session): the stream's end, after the acks
            failed: asyncio.Future[tuple[pb.BatchAck, int]] = loop.create_future()
            failed.set_exception(exc)
            acks.put_nowait(failed)

    async def run_batch(self, session: Session, batch: pb.CommandBatch, after: asyncio.Future[None] | None = None,
                        sent: asyncio.Future[None] | None = None, replies: _Replies | None = None
                        ) -> tuple[pb.BatchAck, int]:
        """An ``encoded`` batch runs as it is, its Ack returned encoded; typed commands go through the typed
        calls' conversions, a command that does not convert failing there (those before it still run).

        ``after`` (the stream's batch before it is on its way to the worker) is awaited before anything runs, so
        batches read ahead keep the stream's order; ``sent`` is this batch's, for the next one. ``replies``: the
        ack's bytes are taken from it before the batch runs (waiting while the tenant's unsent replies are over
        their budget); returned with the ack, the bytes it holds there (to release once it is sent).
        """
        if batch.encoded:
            # Only its outline: what the front checks and relays by (the worker decodes all of it, on the tenant's
            # CPU), as decoding the bytes a kernel's arguments or an operator's metadata take would cost this loop,
            # which serves every tenant, up to 25 ns a byte.
            decoded = outline_batch(batch.encoded)
            expected = _reply_bytes(decoded.commands, self.config.max_message_bytes)
            if replies is not None:
                await replies.reserve(expected)
            try:
                if after is not None:
                    await after
                ack = await self.runner.execute(session, decoded, batch.encoded, sent)
                data = encode(ack)
            except BaseException:
                if replies is not None:
                    replies.release(expected)
                raise
            # (its length, not the message's ByteSize(): that serialises the message, a copy of every ack)
            if replies is not None:
                replies.settle(expected, len(data))
            return pb.BatchAck(batch=batch.batch, encoded=data), len(data)
        # Converting a typed command costs this loop a microsecond or more (each kernel argument as much): so many
        # and no more per batch, checked before any is converted (the protobuf message is parsed already).
        if len(batch.commands) > MAX_FRONT_COMMANDS:
            raise InvalidArgument(f"a batch of {len(batch.commands)} commands; at most {MAX_FRONT_COMMANDS} a batch")
        if (args := sum(len(command.launch.args) for command in batch.commands)) > commands.MAX_KERNEL_ARGS:
            raise InvalidArgument(f"a batch of launches with {args} kernel arguments in all; at most "
                                  f"{commands.MAX_KERNEL_ARGS} a batch")
        converted: list[Command] = []
        error: pb.CommandError | None = None
        for command in batch.commands:
            try:
                converted.append(commands.command_of(command))
            except GpuBrokerError as exc:
                error = pb.CommandError(seq=command.seq, command=command.WhichOneof("kind") or "empty command",
                                        code=exc.code, message=exc.message)
                break
        if after is not None:
            await after
        if converted:
            decoded, data = commands.pack(converted)
            ack = await self.runner.execute(session, decoded, data, sent)
            if ack.error is not None:
                failed = ack.error
                error = pb.CommandError(seq=batch.commands[failed.seq].seq, command=failed.command, code=failed.code,
                                        message=failed.message)
        return pb.BatchAck(batch=batch.batch, error=error), 0  # (no results: a few bytes, not counted)

    # -- streams -----------------------------------------------------------------------------------
    @rpc
    async def CreateStream(self, request: pb.SessionRequest, context: Context) -> pb.StreamHandle:
        session = self._session(context, request.session)
        create = commands.create_stream_commands(request)
        await self.runner.run(session, create)  # (the per-session stream limit: the worker's)
        assert isinstance(create[0], CreateStream)
        return pb.StreamHandle(handle=create[0].handle)

    @rpc
    async def DestroyStream(self, request: pb.StreamRequest, context: Context) -> pb.Empty:
        await self.runner.run(self._session(context, request.session), commands.destroy_stream_commands(request))
        return pb.Empty()

    @rpc
    async def Synchronize(self, request: pb.StreamRequest, context: Context) -> pb.Empty:
        await self.runner.run(self._session(context, request.session), commands.synchronize_commands(request))
        return pb.Empty()

    @rpc
    async def CopyPeer(self, request: pb.CopyPeerRequest, context: Context) -> pb.CopyPeerResponse:
        tenant = self._tenant(context)
        src = self._session(context, request.src_session, tenant)
        # Another tenant's session, or a made-up one, is NOT_FOUND: nothing to learn by guessing.
        dst = self.sessions.get(request.dst_session, tenant)
        self.credentials.used(dst.check_alive(), principal_of(self.auth, context))
        if dst is not src:
            self.admit(dst)
        try:
            return pb.CopyPeerResponse(path=await self.peers.copy(src, dst, request))
        finally:
            if dst is not src:
                release_slot(dst)


def _outcome_unread(settled: asyncio.Future[Any]) -> None:
    """A cancel's wait for the work is not read past its grace: its outcome (the worker stopped) is nobody's news."""
    if not settled.cancelled():
        settled.exception()
