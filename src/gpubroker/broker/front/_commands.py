"""The typed gRPC calls as protocol commands (gpubroker/wire/commands.py): one function per RPC, and the one runner.

The typed RPCs stay for other languages and grpcurl; each request becomes the same commands a client's link
sends, once, here. The front picks the handle of what a typed call creates (``new_handle``), as a client does
on its own link. Every batch, typed or sent ``encoded``, then goes through ``CommandRunner.execute``: decoded
(msgspec checks every type and range; of a client's encoded batch only its outline, ``outline_batch``, the worker
decoding the rest), admitted, sent to the session's worker as one ``batch`` request under
the tenant's scheduler turn when it holds device work, and answered by the worker's Ack, which the worker
client has already held to the batch (workers/_replies.py).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

from gpubroker.broker.config import BrokerConfig
from gpubroker.broker.front._sessions import Session, SessionManager
from gpubroker.broker.front.scheduler import DeviceScheduler
from gpubroker.v1 import broker_pb2 as pb
from gpubroker.wire.commands import (
    MAX_HANDLE,
    Ack,
    Allocate,
    Batch,
    BufferArg,
    BufRef,
    Command,
    CopyD2D,
    CopyShared,
    CreateStream,
    DestroyStream,
    DeviceInfoQuery,
    Free,
    GetKernel,
    KernelArg,
    Launch,
    LoadModule,
    Memset,
    Read,
    ScalarArg,
    Synchronize,
    Write,
    encode,
    new_handle,
    parse_batch,
)
from gpubroker.wire.errors import DeadlineExceeded, InvalidArgument, NotFound, ResourceExhausted, error_from_wire
from gpubroker.wire.types import ModuleFormat

__all__ = [
    "RPC_COMMANDS",
    "MAX_KERNEL_ARGS",
    "CommandRunner",
    "allocate_commands",
    "command_of",
    "copy_d2d_commands",
    "copy_shared_commands",
    "create_stream_commands",
    "destroy_stream_commands",
    "device_info_commands",
    "free_commands",
    "get_kernel_commands",
    "launch_commands",
    "load_module_commands",
    "memset_commands",
    "raise_for",
    "read_command",
    "synchronize_commands",
    "write_command",
]

_FORMATS = {
    pb.MODULE_FORMAT_CUDA_C: ModuleFormat.CUDA_C,
    pb.MODULE_FORMAT_OPENCL_C: ModuleFormat.OPENCL_C,
    pb.MODULE_FORMAT_PTX: ModuleFormat.PTX,
    pb.MODULE_FORMAT_CUBIN: ModuleFormat.CUBIN,
    pb.MODULE_FORMAT_FATBIN: ModuleFormat.FATBIN,
}
# A shared-memory copy takes one scheduler turn per piece of this size, so a huge copy cannot hold the device
# for long past its tenant's quantum (256 MiB: ~5 ms pinned on an H200, one quantum).
SHARED_PIECE = 256 * 1024 * 1024


# -- conversions: typed requests -> commands -----------------------------------------------------------------
# The most kernel arguments a typed launch (or a typed batch's launches together) may carry: CUDA takes at most 32
# KiB of parameters, 4096 pointers.
MAX_KERNEL_ARGS = 4096


def _handle(value: str, kind: str) -> str:
    """A handle of the session's (resolved by the worker); an empty or oversized one is no handle at all."""
    if not value or len(value) > MAX_HANDLE:
        raise NotFound(f"no {kind} {value[:80]!r} in this session")
    return value


def _stream(value: str) -> str:
    return _handle(value, "stream") if value else ""


def _ref(ref: pb.BufferRef) -> BufRef:
    return (_handle(ref.handle, "buf"), ref.offset)


def _non_negative(value: int, what: str) -> int:
    if value < 0:
        raise InvalidArgument(f"{what} must be >= 0, got {value}")
    return value


def _dims(values: Any, what: str) -> tuple[int, ...]:
    dims = tuple(values)
    if not 1 <= len(dims) <= 3:
        raise InvalidArgument(f"{what} needs 1 to 3 extents, got {len(dims)}")
    return dims


def allocate_commands(request: pb.AllocateRequest) -> list[Command]:
    if request.size <= 0:
        raise InvalidArgument(f"allocation size must be > 0, got {request.size}")
    return [Allocate(new_handle("buf"), request.size)]


def free_commands(request: pb.FreeRequest) -> list[Command]:
    return [Free(_handle(request.buffer, "buf"))]


def memset_commands(request: pb.MemsetRequest) -> list[Command]:
    if request.value > 255:
        raise InvalidArgument(f"memset value must be a byte (0-255), got {request.value}")
    if request.size < -1:
        raise InvalidArgument(f"memset size must be >= 0 (or -1: to the end), got {request.size}")
    return [Memset(_ref(request.buffer), request.value, request.size, _non_negative(request.offset, "memset offset"),
                   _stream(request.stream))]


def copy_d2d_commands(request: pb.CopyDeviceToDeviceRequest) -> list[Command]:
    return [CopyD2D(_ref(request.src), _ref(request.dst), _non_negative(request.size, "copy size"),
                    _non_negative(request.src_offset, "source offset"),
                    _non_negative(request.dst_offset, "destination offset"), _stream(request.stream))]


def launch_commands(request: pb.LaunchKernelRequest) -> list[Command]:
    if len(request.args) > MAX_KERNEL_ARGS:  # (each costs the front's event loop a microsecond to convert)
        raise InvalidArgument(f"a launch with {len(request.args)} kernel arguments; at most {MAX_KERNEL_ARGS}")
    args: list[KernelArg] = []
    for arg in request.args:
        kind = arg.WhichOneof("kind")
        if kind == "buffer":
            args.append(BufferArg(_handle(arg.buffer.handle, "buf"), arg.buffer.offset))
        elif kind == "scalar":
            if len(arg.scalar.value) > 8 or len(arg.scalar.dtype) > 16:
                raise InvalidArgument(f"kernel arg {len(args)}: a scalar is at most 8 bytes of a numpy dtype")
            args.append(ScalarArg(arg.scalar.dtype, arg.scalar.value))
        else:
            raise InvalidArgument(f"kernel arg {len(args)} is empty")
    return [Launch(_handle(request.kernel, "kernel"), _dims(request.grid, "grid"), _dims(request.block, "block"),
                   args, request.shared_mem, _stream(request.stream))]


def create_stream_commands(request: pb.SessionRequest) -> list[Command]:
    return [CreateStream(new_handle("stream"))]


def destroy_stream_commands(request: pb.StreamRequest) -> list[Command]:
    return [DestroyStream(_handle(request.stream, "stream"))]


def synchronize_commands(request: pb.StreamRequest) -> list[Command]:
    return [Synchronize(_stream(request.stream))]


def device_info_commands(request: pb.SessionRequest) -> list[Command]:
    return [DeviceInfoQuery()]


def load_module_commands(request: pb.LoadModuleRequest) -> list[Command]:
    fmt = _FORMATS.get(request.format)
    if fmt is None:
        raise InvalidArgument("module format is missing or unknown")
    return [LoadModule(new_handle("module"), fmt.value, request.image, list(request.options))]


def get_kernel_commands(request: pb.GetKernelRequest) -> list[Command]:
    return [GetKernel(new_handle("kernel"), _handle(request.module, "module"), request.name)]


def copy_shared_commands(request: pb.CopySharedRequest) -> Iterator[Command]:
    """One command per piece: each runs as its own batch, under its own turn. Made one at a time, as the caller
    runs them: the size is the client's (up to 2**63 - 1), and a list of its pieces built before the first ran
    (2**34 of them for 2**62 bytes) took the front's loop and all the host's memory, until the OOM killer ended the
    front; the first piece past the segment fails in the worker and ends the copy. (Its arguments are checked
    here, before the first piece.)"""
    size = _non_negative(request.size, "copy size")
    offset = _non_negative(request.offset, "copy offset")
    segment, buf, stream = _handle(request.segment, "segment"), _ref(request.buffer), _stream(request.stream)
    return _shared_pieces(segment, request.segment_offset, buf, offset, size, request.to_device, stream)


def _shared_pieces(segment: str, segment_offset: int, buf: BufRef, offset: int, size: int, to_device: bool,
                   stream: str) -> Iterator[Command]:
    if not size:
        yield CopyShared(segment, segment_offset, buf, offset, 0, to_device, stream)
    for done in range(0, size, SHARED_PIECE):
        yield CopyShared(segment, segment_offset + done, buf, offset + done, min(SHARED_PIECE, size - done),
                         to_device, stream)


def write_command(header: pb.HostToDeviceHeader, done: int, data: bytes) -> Command:
    """CopyHostToDevice: one chunk of the stream (``done`` bytes of it already sent)."""
    return Write(_ref(header.buffer), header.offset + done, data, _stream(header.stream))


def read_command(request: pb.CopyDeviceToHostRequest, done: int, size: int) -> Command:
    """CopyDeviceToHost: one chunk of ``size`` bytes, ``done`` bytes into the copy."""
    return Read(_ref(request.buffer), request.offset + done, size, _stream(request.stream))


_TYPED: dict[str, Callable[[Any], list[Command]]] = {
    "launch": launch_commands, "memset": memset_commands, "copy_d2d": copy_d2d_commands,
    "synchronize": synchronize_commands}


def command_of(command: pb.Command) -> Command:
    """One command of a typed ``Commands`` batch, through the same conversion as its RPC."""
    kind = command.WhichOneof("kind")
    convert = _TYPED.get(kind) if kind else None
    if convert is None or kind is None:
        raise InvalidArgument("a command names no operation")
    return convert(getattr(command, kind))[0]


# Every RPC of the GpuBroker service: the function that turns it into commands, or None for the control plane
# (sessions, devices, CopyPeer's front-driven pieces), which carries no device command of its own. Some commands
# have no typed RPC (events: CreateEvent, RecordEvent, WaitEvent, SynchronizeEvent, DestroyEvent): the Commands
# stream carries them for every language through ``CommandBatch.encoded``, as the links do.
RPC_COMMANDS: dict[str, Callable[..., Any] | None] = {
    "Allocate": allocate_commands, "Free": free_commands, "Memset": memset_commands,
    "CopyDeviceToDevice": copy_d2d_commands, "CopyHostToDevice": write_command, "CopyDeviceToHost": read_command,
    "LoadModule": load_module_commands, "GetKernel": get_kernel_commands, "LaunchKernel": launch_commands,
    "CreateStream": create_stream_commands, "DestroyStream": destroy_stream_commands,
    "Synchronize": synchronize_commands, "GetDeviceInfo": device_info_commands, "CopyShared": copy_shared_commands,
    "Commands": command_of,
    "OpenSession": None, "CloseSession": None, "Heartbeat": None, "ListDevices": None, "CopyPeer": None,
}


def raise_for(ack: Ack) -> Ack:
    """The Ack, or its error raised as the gpubroker error the worker reported (already bounded and checked)."""
    error = ack.error
    if error is not None:
        raise error_from_wire(error.error)
    return ack


def pack(commands: list[Command], batch_id: int = 0, first: int = 0) -> tuple[Batch, bytes]:
    """A batch of the front's own commands, encoded and decoded once: the decoding checks every field's type and
    range exactly as a client's batch is checked (a Struct built in Python is not)."""
    data = encode(Batch(batch_id, first, commands))
    return parse_batch(data), data


# -- the runner ----------------------------------------------------------------------------------------------
class CommandRunner:
    """Runs batches in a session's worker: the one path of every device operation that reaches the front."""

    def __init__(self, config: BrokerConfig, sessions: SessionManager, schedulers: dict[int, DeviceScheduler],
                 before_free: Callable[[Session, set[str]], Awaitable[None]]) -> None:
        self.config = config
        self.sessions = sessions
        self.schedulers = schedulers
        # Called with the session and the buffers a batch frees, before it runs (CopyPeer unmaps them elsewhere).
        self.before_free = before_free

    async def run(self, session: Session, commands: list[Command]) -> Ack:
        """The front's commands for a typed call; the Ack, or the command's error raised."""
        batch, data = pack(commands)
        return raise_for(await self.execute(session, batch, data))

    async def execute(self, session: Session, batch: Batch, data: bytes,
                      sent: asyncio.Future[None] | None = None) -> Ack:
        """Run ``batch`` (``data``: its encoding) in the session's worker; a failing command is in the Ack.

        ``sent`` (a stream's batches run ahead of their acks) is resolved once the batch is on its way to the worker:
        in the worker client's queue of requests, which it writes in order, so the stream's next batch may follow.
        """
        session.check_alive()
        session.touch()
        # Each command's class once (up to MAX_FRONT_COMMANDS of them): the front's own work on a batch stays a
        # pass at C speed, not Python's per command, where the commands are all the same.
        kinds: set[type[Command]] = set(map(type, batch.commands))
        # A command that uses the device (its class's ``device_work``) makes the batch wait for the tenant's turn.
        device_work = any(kind.device_work for kind in kinds)
        compile_ = any(issubclass(kind, LoadModule) for kind in kinds)
        if compile_:
            for command in batch.commands:
                if isinstance(command, LoadModule) and len(command.image) > self.config.max_module_bytes:
                    raise ResourceExhausted(f"module of {len(command.image)} bytes exceeds the limit of "
                                            f"{self.config.max_module_bytes}")
        if any(issubclass(kind, Free) for kind in kinds):
            await self.before_free(session, {command.handle for command in batch.commands
                                             if isinstance(command, Free)})
        async with self.schedulers[session.device].turn(session.tenant) if device_work else _no_turn():
            # (again: the session may have ended while the batch waited for its turn, and a batch sent after its
            # CloseSession would make the worker serve a session nobody counts any more)
            session.check_alive()
            if not compile_:
                _resolve(sent)  # (the call below runs on in this step, to its place in the worker's queue)
                return await session.worker.run_batch(session.id, batch, data)
            call = asyncio.ensure_future(session.worker.run_batch(session.id, batch, data))
            _resolve(sent)  # (after: the call's first step is scheduled before the next batch's)
            try:
                # A pathological source must not hold the tenant's worker (or this call) forever.
                return await asyncio.wait_for(call, self.config.compile_timeout_seconds)
            except TimeoutError:
                error = DeadlineExceeded(
                    f"compiling the module took longer than {self.config.compile_timeout_seconds:g} s; the "
                    "tenant's worker was restarted, so this session's device state is lost")
                await self.sessions.pool.restart(session.worker, error)  # the tenant's failure (its crash budget)
                raise error from None


def _resolve(sent: asyncio.Future[None] | None) -> None:
    if sent is not None and not sent.done():
        sent.set_result(None)


@contextlib.asynccontextmanager
async def _no_turn() -> AsyncIterator[None]:
    yield
