"""The GpuBroker gRPC service: authenticate, resolve session handles, forward to the tenant's worker."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Awaitable, Iterator
from typing import Any, TypeVar

from gpubroker.client import (
    DeadlineExceeded,
    DeviceInfo,
    GpuBrokerError,
    InvalidArgument,
    ModuleFormat,
    NotFound,
    OutOfRange,
    ResourceExhausted,
    Unauthenticated,
)
from gpubroker.v1 import broker_pb2 as pb
from gpubroker.v1 import broker_pb2_grpc as pb_grpc

from ..auth import Authenticator, Principal
from ..config import BrokerConfig
from ..scheduler import DeviceScheduler
from ..sessions import Session, SessionManager
from ..workers import device_info_from_dict
from ._copies import READ_DEPTH, WRITE_DEPTH, read_chunks, write_chunks
from ._params import WorkerParams, check_copy_range
from ._peer import PeerCopies
from ._staging import CopyStagings
from ._status import Context, admitted, principal_of, rpc, stream_rpc

__all__ = ["GpuBrokerService", "device_info_to_pb"]

_FORMATS = {
    pb.MODULE_FORMAT_CUDA_C: ModuleFormat.CUDA_C,
    pb.MODULE_FORMAT_OPENCL_C: ModuleFormat.OPENCL_C,
    pb.MODULE_FORMAT_PTX: ModuleFormat.PTX,
    pb.MODULE_FORMAT_CUBIN: ModuleFormat.CUBIN,
    pb.MODULE_FORMAT_FATBIN: ModuleFormat.FATBIN,
}
# A shared-memory copy takes one scheduler turn per piece of this size, so a huge copy cannot hold the device
# for long past its tenant's quantum (256 MiB: ~5 ms pinned on an H200, one quantum). Each piece costs a worker
# round trip and a sync: 64 MiB pieces cost a 512 MiB copy about an eighth of its bandwidth.
_SHARED_PIECE = 256 * 1024 * 1024
_STAGING_SLOTS = max(READ_DEPTH, WRITE_DEPTH)
REVOKED_MESSAGE = ("the token that opened this stream was rotated or its tenant removed; reconnect with the "
                   "current token")
T = TypeVar("T")


class _Revocable:
    """A stream's hold on its credential: at a revocation, whatever the stream awaits is cancelled and the stream
    ends with UNAUTHENTICATED (its session stays; the client reconnects with the current token)."""

    def __init__(self) -> None:
        self.revoked = False
        self._pending: asyncio.Future[Any] | None = None

    def revoke(self) -> None:
        self.revoked = True
        if self._pending is not None:
            self._pending.cancel()

    async def run(self, awaitable: Awaitable[T]) -> T:
        if self.revoked:
            raise Unauthenticated(REVOKED_MESSAGE)
        future = asyncio.ensure_future(awaitable)
        self._pending = future
        try:
            return await future
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if self.revoked and (task is None or not task.cancelling()):  # ours, not the call's cancellation
                raise Unauthenticated(REVOKED_MESSAGE) from None
            raise
        finally:
            self._pending = None

    async def iterate(self, items: AsyncIterator[T]) -> AsyncIterator[T]:
        iterator = aiter(items)
        while True:
            try:
                item = await self.run(anext(iterator))
            except StopAsyncIteration:
                return
            yield item


def device_info_to_pb(info: DeviceInfo) -> pb.DeviceInfo:
    fields: dict[str, Any] = dataclasses.asdict(info)
    fields["compute_capability"] = list(info.compute_capability or ())
    fields["opencl_version"] = info.opencl_version or ""
    fields["health"] = info.health or ""
    for key in ("memory_quota", "memory_used", "memory_available"):
        if fields[key] is None:
            del fields[key]
    return pb.DeviceInfo(**fields)


class GpuBrokerService(PeerCopies, WorkerParams, pb_grpc.GpuBrokerServicer):
    def __init__(self, config: BrokerConfig, auth: Authenticator, sessions: SessionManager,
                 devices: list[DeviceInfo], schedulers: dict[int, DeviceScheduler]) -> None:
        self.config = config
        self.auth = auth
        self.sessions = sessions
        self.devices = devices
        self.schedulers = schedulers
        self.init_peer_copies()
        # Streamed copies' chunks pass to and from the worker through memory shared with it.
        self.stagings = CopyStagings(sessions)

    async def _device(self, session: Session, op: str, **params: Any) -> Any:
        """Device work (launches, copies, memsets) waits for the tenant's turn on the device."""
        async with self.schedulers[session.device].turn(session.tenant):
            return await session.worker.call(op, session.id, **params)

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
        """The caller's live session, holding one of its concurrent-RPC slots until the call ends."""
        session = self.sessions.get(session_id, tenant or self._tenant(context))
        session.check_alive()
        self.admit(session)
        admitted.set(session)
        return session

    def admit(self, session: Session) -> None:
        """Take one of the session's (and its tenant's) concurrent-call slots, or refuse."""
        if session.inflight >= self.config.max_concurrent_rpcs_per_session:
            raise ResourceExhausted(f"this session already has {session.inflight} calls in flight, the limit")
        tenant_inflight = self.sessions.inflight.get(session.tenant, 0)
        if tenant_inflight >= self.config.max_inflight_per_tenant:
            raise ResourceExhausted(f"tenant {session.tenant!r} already has {tenant_inflight} calls in flight, "
                                    "the limit")
        session.inflight += 1
        self.sessions.inflight[session.tenant] = tenant_inflight + 1

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
        return view

    # -- sessions ----------------------------------------------------------------------------------
    @rpc
    async def OpenSession(self, request: pb.OpenSessionRequest, context: Context) -> pb.OpenSessionResponse:
        tenant = self._tenant(context)
        if not request.any_device and request.device >= len(self.devices):
            raise NotFound(f"no device {request.device}; this broker serves {len(self.devices)}")
        session = await self.sessions.open(tenant, None if request.any_device else request.device)
        info = await session.worker.call("device_info", session.id)
        return pb.OpenSessionResponse(
            session=session.id, lease_seconds=session.lease_seconds, max_chunk_bytes=self.config.chunk_bytes,
            device=self._tenant_view(tenant, session.device, device_info_from_dict(info)))

    @rpc
    async def CloseSession(self, request: pb.SessionRequest, context: Context) -> pb.Empty:
        session = self.sessions.get(request.session, self._tenant(context))
        await self.sessions.close(session)
        return pb.Empty()

    @rpc
    async def Heartbeat(self, request: pb.SessionRequest, context: Context) -> pb.HeartbeatResponse:
        session = self._session(context, request.session)
        return pb.HeartbeatResponse(lease_seconds=session.lease_seconds)

    # -- devices -----------------------------------------------------------------------------------
    @rpc
    async def ListDevices(self, request: pb.ListDevicesRequest, context: Context) -> pb.ListDevicesResponse:
        tenant = self._tenant(context)
        return pb.ListDevicesResponse(devices=[self._tenant_view(tenant, i, d, live=False)
                                               for i, d in enumerate(self.devices)])

    @rpc
    async def GetDeviceInfo(self, request: pb.SessionRequest, context: Context) -> pb.DeviceInfo:
        session = self._session(context, request.session)
        info = device_info_from_dict(await session.worker.call("device_info", session.id))
        return self._tenant_view(session.tenant, session.device, info)

    # -- memory ------------------------------------------------------------------------------------
    @rpc
    async def Allocate(self, request: pb.AllocateRequest, context: Context) -> pb.BufferHandle:
        session = self._session(context, request.session)
        if request.size <= 0:
            raise InvalidArgument(f"allocation size must be > 0, got {request.size}")
        session.check_room()
        self.sessions.reserve(session, request.size)
        # The worker learns the client's handle too, for calls that reach it directly (same-host links).
        alias = session.new_handle("buf")
        try:
            backend_handle = await session.worker.call("allocate", session.id, size=request.size, alias=alias)
        except BaseException:
            self.sessions.release(session, request.size)
            raise
        return pb.BufferHandle(handle=session.add("buf", backend_handle, size=request.size, handle=alias),
                               size=request.size)

    @rpc
    async def Free(self, request: pb.FreeRequest, context: Context) -> pb.Empty:
        session = self._session(context, request.session)
        entry = session.resolve(request.buffer, "buf")
        await self.before_free(session, entry)  # not while CopyPeer uses it; unmapped from other workers first
        await session.worker.call("free", session.id, handle=entry.backend)
        del session.handles[request.buffer]
        self.sessions.release(session, entry.size)
        return pb.Empty()

    @rpc
    async def Memset(self, request: pb.MemsetRequest, context: Context) -> pb.Empty:
        session = self._session(context, request.session)
        await self._device(session, "memset", **self._memset_params(session, request))
        return pb.Empty()

    @rpc
    async def CopyDeviceToDevice(self, request: pb.CopyDeviceToDeviceRequest, context: Context) -> pb.Empty:
        session = self._session(context, request.session)
        await self._device(session, "copy_d2d", **self._d2d_params(session, request))
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
            buf = self._buffer_ref(session, header.buffer)
            stream = self._stream(session, header.stream)
            check_copy_range(buf, header.offset, header.size)
            async with self.stagings.use(session, _STAGING_SLOTS, self.config.chunk_bytes) as staging:
                await write_chunks(self._device, session, header, buf, stream, first, requests,
                                   self.config.chunk_bytes, staging=staging)
        return pb.Empty()

    @stream_rpc
    async def CopyDeviceToHost(self, request: pb.CopyDeviceToHostRequest, context: Context
                               ) -> AsyncIterator[pb.DeviceToHostChunk]:
        principal = principal_of(self.auth, context)
        session = self._session(context, request.session, principal.tenant)
        buf = self._buffer_ref(session, request.buffer)
        stream = self._stream(session, request.stream)
        check_copy_range(buf, request.offset, request.size)
        chunk = min(request.chunk_bytes or self.config.chunk_bytes, self.config.chunk_bytes)
        with self._revocable(principal) as guard:
            async with self.stagings.use(session, _STAGING_SLOTS, self.config.chunk_bytes) as staging:
                async for message in guard.iterate(read_chunks(self._device, session, buf, request.offset,
                                                               request.size, chunk, stream, staging=staging)):
                    yield message

    @rpc
    async def CopyShared(self, request: pb.CopySharedRequest, context: Context) -> pb.Empty:
        await self.copy_shared(self._session(context, request.session), request)
        return pb.Empty()

    async def copy_shared(self, session: Session, request: pb.CopySharedRequest) -> None:
        segment = session.resolve(request.segment, "segment")
        buf = self._buffer_ref(session, request.buffer)
        stream = self._stream(session, request.stream)
        check_copy_range(buf, request.offset, request.size)
        if request.segment_offset + request.size > segment.size:
            raise OutOfRange(f"{request.size} bytes at segment offset {request.segment_offset} run past the end of "
                             f"the {segment.size}-byte segment")
        done = 0
        while done < request.size:
            n = min(_SHARED_PIECE, request.size - done)
            await self._device(session, "copy_shared", segment=segment.backend,
                               segment_offset=request.segment_offset + done, buf=buf, offset=request.offset + done,
                               size=n, to_device=request.to_device, stream=stream)
            done += n
            session.touch()

    # -- code --------------------------------------------------------------------------------------
    @rpc
    async def LoadModule(self, request: pb.LoadModuleRequest, context: Context) -> pb.ModuleHandle:
        session = self._session(context, request.session)
        fmt = _FORMATS.get(request.format)
        if fmt is None:
            raise InvalidArgument("module format is missing or unknown")
        if len(request.image) > self.config.max_module_bytes:
            raise ResourceExhausted(f"module of {len(request.image)} bytes exceeds the limit of "
                                    f"{self.config.max_module_bytes}")
        session.check_room()
        image: bytes | str = request.image
        if fmt in (ModuleFormat.CUDA_C, ModuleFormat.OPENCL_C, ModuleFormat.PTX):
            try:
                image = request.image.decode()
            except UnicodeDecodeError:
                raise InvalidArgument("module source must be UTF-8 text") from None
        try:
            # A pathological source must not hold the tenant's worker (or this call) forever.
            result = await asyncio.wait_for(
                session.worker.call("load_module", session.id, format=fmt.value, image=image,
                                    options=list(request.options)),
                self.config.compile_timeout_seconds)
        except TimeoutError:
            error = DeadlineExceeded(
                f"compiling the module took longer than {self.config.compile_timeout_seconds:g} s; the tenant's "
                "worker was restarted, so this session's device state is lost")
            await self.sessions.pool.restart(session.worker, error)  # the tenant's failure (its crash budget)
            raise error from None
        handle = session.add("module", result["handle"])
        return pb.ModuleHandle(handle=handle, kernel_names=result["kernel_names"])

    @rpc
    async def GetKernel(self, request: pb.GetKernelRequest, context: Context) -> pb.KernelHandle:
        session = self._session(context, request.session)
        module = session.resolve(request.module, "module")
        session.check_room()
        alias = session.new_handle("kernel")
        backend = await session.worker.call("get_kernel", session.id, module=module.backend, name=request.name,
                                            alias=alias)
        return pb.KernelHandle(handle=session.add("kernel", backend, name=request.name, handle=alias),
                               name=request.name)

    @rpc
    async def LaunchKernel(self, request: pb.LaunchKernelRequest, context: Context) -> pb.Empty:
        session = self._session(context, request.session)
        await self._device(session, "launch", **self._launch_params(session, request))
        return pb.Empty()

    @stream_rpc
    async def Commands(self, request_iterator: AsyncIterator[pb.CommandBatch], context: Context
                       ) -> AsyncIterator[pb.BatchAck]:
        """Batches run in order, each under one scheduler turn; a failure is acknowledged, not raised."""
        principal = principal_of(self.auth, context)
        session: Session | None = None
        with self._revocable(principal) as guard:
            async for batch in guard.iterate(request_iterator):
                if session is None:
                    session = self.sessions.get(batch.session, principal.tenant)
                yield await guard.run(self.run_batch(session, batch))

    async def run_batch(self, session: Session, batch: pb.CommandBatch) -> pb.BatchAck:
        """Run a batch's commands in order under one turn; the first failure is acknowledged, not raised."""
        session.check_alive()
        session.touch()
        commands: list[list[Any]] = []
        error: pb.CommandError | None = None
        for command in batch.commands:
            kind = command.WhichOneof("kind")
            what = kind or "empty command"
            try:
                if kind == "launch":
                    what = f"launch of {session.resolve(command.launch.kernel, 'kernel').name!r}"
                    commands.append([command.seq, "launch", what, self._launch_params(session, command.launch)])
                elif kind == "memset":
                    commands.append([command.seq, "memset", what, self._memset_params(session, command.memset)])
                elif kind == "copy_d2d":
                    commands.append([command.seq, "copy_d2d", what, self._d2d_params(session, command.copy_d2d)])
                elif kind == "synchronize":
                    commands.append([command.seq, "synchronize", what,
                                     {"stream": self._stream(session, command.synchronize.stream)}])
                else:
                    raise InvalidArgument("a command names no operation")
            except GpuBrokerError as exc:  # a bad handle: what came before it still runs
                error = pb.CommandError(seq=command.seq, command=what, code=exc.code, message=exc.message)
                break
        if commands:
            result = await self._device(session, "batch", commands=commands)
            failed = result["error"]
            if failed is not None:
                error = pb.CommandError(seq=failed["seq"], command=failed["command"], code=failed["code"],
                                        message=failed["message"])
        return pb.BatchAck(batch=batch.batch, error=error)

    # -- streams -----------------------------------------------------------------------------------
    @rpc
    async def CreateStream(self, request: pb.SessionRequest, context: Context) -> pb.StreamHandle:
        session = self._session(context, request.session)
        session.check_room()
        streams = sum(1 for h in session.handles.values() if h.kind == "stream")
        if streams >= self.config.max_streams_per_session:
            raise ResourceExhausted(f"this session already has {streams} streams, the limit")
        alias = session.new_handle("stream")
        backend = await session.worker.call("create_stream", session.id, alias=alias)
        return pb.StreamHandle(handle=session.add("stream", backend, handle=alias))

    @rpc
    async def DestroyStream(self, request: pb.StreamRequest, context: Context) -> pb.Empty:
        session = self._session(context, request.session)
        entry = session.resolve(request.stream, "stream")
        await session.worker.call("destroy_stream", session.id, stream=entry.backend)
        del session.handles[request.stream]
        return pb.Empty()

    @rpc
    async def Synchronize(self, request: pb.StreamRequest, context: Context) -> pb.Empty:
        session = self._session(context, request.session)
        await self._device(session, "synchronize", stream=self._stream(session, request.stream))
        return pb.Empty()
