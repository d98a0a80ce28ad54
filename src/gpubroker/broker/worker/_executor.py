"""The worker's one execution path: a batch of protocol commands, run in order, answered by one Ack.

Batches come from the front (the ``batch`` request: typed gRPC calls turned into commands, module loads under the
front's compile time limit) and from links straight from the client (workers/_links.py); a single synchronous call
is a batch of one. Each command class has one handler, registered with ``@handles(TheCommand)``: a method here, or
a function of an operation defined elsewhere (it takes the executor first), registered before the worker builds its
Executor. The first failure stops the batch: the Ack says how many ran and names the failed command by its sequence
number and what it was (``Command.describe``: "launch of 'scale'"); nothing after it runs, but the torch frees
(``_free_tensors_after``: they only let go of tensors).

The launch path is the hot one: a launch is cached per session by its kernel handle and its arguments as sent
(frozen, hashable protocol structs). The CUDA backend's entry is a prepared launch (its arguments packed once
for cuLaunchKernel, the launch shapes that passed its checks), so a repeated launch is two dict lookups and the
driver call, rebuilding no Python object; another backend's entry is the resolved argument list. A cached entry
is dropped with any object of the session that goes (free, stream destroyed, module unloaded), since a later
object may take its handle.
"""

from __future__ import annotations

import logging
import types
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, NamedTuple, TypeVar, cast

import lz4.block
import numpy as np

from gpubroker.broker.backends import TorchAccounts, TorchSession
from gpubroker.broker.worker._handles import _CACHE_MAX, BufferEntry, HandleTables, KernelEntry, SessionObjects
from gpubroker.broker.worker._pacing import Pacer
from gpubroker.broker.worker._segments import SegmentTable
from gpubroker.wire.commands import (
    CODECS,
    Ack,
    Allocate,
    Batch,
    BufferArg,
    Bytes,
    Command,
    CommandError,
    CopyD2D,
    CopyShared,
    CreateEvent,
    CreateStream,
    DestroyEvent,
    DestroyStream,
    DeviceInfoQuery,
    Dims,
    Free,
    GetKernel,
    KernelArg,
    Launch,
    LoadModule,
    Memset,
    Read,
    RecordEvent,
    RunLibrary,
    Synchronize,
    SynchronizeEvent,
    UnloadModule,
    WaitEvent,
    Write,
    tag_of,
)
from gpubroker.wire.compute import GpuCompute
from gpubroker.wire.errors import (
    FailedPrecondition,
    GpuBrokerError,
    Internal,
    InvalidArgument,
    ResourceExhausted,
    Unimplemented,
)
from gpubroker.wire.host import check_device_range
from gpubroker.wire.torch import (
    OpResult,
    TorchFree,
    TorchFromBuffer,
    TorchOp,
    TorchOpSync,
    TorchRead,
    TorchSeed,
    TorchToBuffer,
)
from gpubroker.wire.types import ArrayRef, Buffer, Kernel, Module, ModuleFormat, Stream

__all__ = ["Done", "Executor", "Handler", "Paused", "handles"]

log = logging.getLogger("gpubroker.worker")

_DTYPES: dict[str, np.dtype[Any]] = {}  # scalar dtype names already accepted


C = TypeVar("C", bound=Command)
# A command's handler: the executor, the session's objects, the command; it returns the command's result (the
# type its class's ``result`` says), or None.
Handler = Callable[["Executor", SessionObjects, C], Any]
# Every command's handler, by the command's class (``handles``).
_HANDLERS: dict[type[Command], Handler[Any]] = {}
# What a pacing worker paces (worker/_pacing.py): the commands that queue kernels and return at once.
_PACED: frozenset[type[Command]] = frozenset({Launch, RunLibrary})


class Paused(NamedTuple):
    """A link batch stopped before a paced command: how many of its commands ran, and the last one's result."""

    done: int
    result: Any


def handles(command: type[C]) -> Callable[[Handler[C]], Handler[C]]:
    """Register the decorated function as ``command``'s handler (one per command: TypeError for a second)."""
    def register(handler: Handler[C]) -> Handler[C]:
        if command in _HANDLERS:
            raise TypeError(f"{command.__name__} has a handler already: {_HANDLERS[command].__qualname__}")
        _HANDLERS[command] = handler
        return handler
    return register


def _scalar(dtype: str, raw: bytes) -> np.generic:
    dt = _DTYPES.get(dtype)
    if dt is None:
        try:
            dt = np.dtype(dtype)
        except Exception:  # TypeError mostly; ValueError, SyntaxError and others for some strings numpy half-parses
            raise InvalidArgument(f"unknown scalar dtype {dtype!r}") from None
        if dt.kind not in "iuf" or dt.itemsize > 8:
            raise InvalidArgument(f"scalar of dtype {dtype!r} must be an int or float of at most 8 bytes")
        if len(_DTYPES) < 64:
            _DTYPES[dtype] = dt
    if len(raw) != dt.itemsize:
        raise InvalidArgument(f"scalar of dtype {dtype!r} must be {dt.itemsize} bytes, got {len(raw)}")
    value: np.generic = np.frombuffer(raw, dtype=dt)[0]
    return value


# Reads sent raw untried after one that lz4 did not shrink (a compressible chunk after that waits this long).
_RAW_READS = 15


def _lz4_block_exact(block: Bytes, size: int) -> bytes:
    """``block`` decompressed, which must be exactly ``size`` bytes: lz4 writes no more than ``size`` (a bomb is
    refused, not inflated), and a block that holds fewer is a lie; both INVALID_ARGUMENT."""
    if size == 0:
        if block:
            raise InvalidArgument("an lz4 block for 0 bytes must be empty")
        return b""
    try:
        data = cast("bytes", lz4.block.decompress(block, uncompressed_size=size))
    except lz4.block.LZ4BlockError as exc:
        raise InvalidArgument(f"an lz4 block that is not {size} bytes once decompressed ({exc})") from None
    if len(data) != size:
        raise InvalidArgument(f"an lz4 block of {len(data)} bytes once decompressed; the write says {size}")
    return data


def _describe(objs: SessionObjects, command: Command) -> str:
    """What a failed command was, for its CommandError (the error path only: never on a success): the command's
    own description, a launch's with its kernel's name where the session knows it."""
    if isinstance(command, Launch):
        entry = objs.kernels.get(command.kernel)
        if entry is not None:
            return f"launch of {entry.name!r}"
    return command.describe()


class _SessionAccounts(TorchAccounts):
    """A session's torch tensors in the worker's handle table: their handles in the session's one namespace (and
    its handle limit), their storages' bytes against the tenant's memory quota."""

    def __init__(self, tables: HandleTables, objs: SessionObjects) -> None:
        self.tables = tables
        self.objs = objs

    def claim(self, handles: Sequence[str]) -> None:
        objs, limit = self.objs, self.tables.limits.max_handles
        if limit is not None and len(objs.kinds) + len(handles) > limit:
            raise ResourceExhausted(f"this session already holds {len(objs.kinds)} handles and the limit is {limit}; "
                                    "free some", limit=limit)
        kinds = objs.kinds
        for handle in handles:
            if handle in kinds:
                self.tables.claim(objs, "tensor", handle)  # (raises, naming what the handle is)

    def bind(self, handle: str) -> None:
        self.objs.kinds[handle] = "tensor"

    def unbind(self, handles: Sequence[str]) -> None:
        kinds = self.objs.kinds
        for handle in handles:
            kinds.pop(handle, None)

    def reserve(self, nbytes: int) -> None:
        if nbytes:
            self.tables.reserve(nbytes)
            self.objs.memory_used += nbytes

    def unreserve(self, nbytes: int) -> None:
        if nbytes:
            self.tables.unreserve(nbytes)
            self.objs.memory_used -= nbytes

    def quota(self) -> int | None:
        return self.tables.limits.memory_quota


class _Unprepared(NamedTuple):
    kernel: Kernel
    args: list[object]


@dataclass
class Done:
    """What the worker ran since it started, for the front's metrics (``usage``): kernel launches (Launch commands;
    library and torch operators are not counted) and the bytes of its copies, by direction."""

    launches: int = 0
    h2d_bytes: int = 0
    d2h_bytes: int = 0
    d2d_bytes: int = 0


class Executor:
    """Runs batches for every session of the worker against its backend, through the one handle table."""

    def __init__(self, backend: GpuCompute, tables: HandleTables, segments: SegmentTable) -> None:
        self.backend = backend
        self.done = Done()
        self.tables = tables
        self.segments = segments
        self._codec = ""  # what the link of the batch being run negotiated (see run)
        # The most a compressed Write may inflate to: a link's max frame (what it could have sent raw); the links
        # set it from the front's limits.
        self.max_inflate = 1 << 20 | 1 << 16
        self.fatal = False  # a command corrupted the device context: the worker exits after replying
        # Where a Read's bytes land on their way to the client: page-locked memory where the backend offers it
        # (CUDA's pinned_buffer: one DMA, no staging copy), else plain.
        self.host_buffer: Callable[[int], bytearray | memoryview] = getattr(backend, "pinned_buffer", bytearray)
        # A copy between device memory and host memory the backend page-locked, by its address (CUDA's
        # copy_registered: a shared-memory segment's copies make no view of the mapping each time), or None.
        self._copy_registered: Callable[[int, int, Buffer, int, bool, Stream | None], None] | None = getattr(
            backend, "copy_registered", None)
        # The backend's device-time segments (CUDA: a pair of timing events per stream) stay open while batches
        # keep coming, and end when the worker is about to wait for input (``idle``, from the serve loop): idle
        # host time is never charged, and back-to-back batches put no timing event between their kernels (each
        # one drains the GPU's queue: on an H200, 2000 dependent 15 us kernels took 1.2-1.5x as long with a pair
        # per batch).
        self._segments_open: Callable[[], bool] | None = getattr(backend, "device_time_open", None)
        self._end_segments: Callable[[], object] | None = getattr(backend, "flush_device_time", None)
        # What the backend does ahead for the next batch while a client reads its answer (CUDA: the next
        # segment's start mark, where the device is quiet: a synchronous round trip then records no event).
        self._anchor: Callable[[], object] | None = getattr(backend, "anchor_device_time", None)
        # A backend that packs a launch's arguments once (CUDA) is given them once per (kernel, arguments);
        # any other gets the resolved arguments at each launch.
        prepare = getattr(backend, "prepare_launch", None)
        launch = getattr(backend, "launch_prepared", None)
        if prepare is None or launch is None:
            execute = backend.execute_kernel

            def launch(p: _Unprepared, grid: Dims, block: Dims, shared_mem: int, stream: Stream | None) -> None:
                execute(p.kernel, grid, block, p.args, shared_mem, stream)
            prepare = _Unprepared
        self._prepare: Callable[[Kernel, list[object]], Any] = prepare
        self._launch_prepared: Callable[[Any, Dims, Dims, int, Stream | None], None] = launch
        # Every registered handler, bound to this executor (those registered later are not: see ``handles``).
        self.handlers: dict[type[Command], Callable[[SessionObjects, Any], Any]] = {
            kind: types.MethodType(handler, self) for kind, handler in _HANDLERS.items()}
        # What a link may send: device work, and the memory and streams it uses (not compiles: ``Command.link``).
        self.link_handlers = {kind: fn for kind, fn in self.handlers.items() if kind.link}

    # -- batches -----------------------------------------------------------------------------------
    def run(self, session: str, batch: Batch) -> Ack:
        """Run a batch the front sent (``RunBatch``: any command, module loads included) for ``session``; the
        first failure stops it and is reported in the Ack."""
        outcome = self._run(session, batch, self.handlers, None, None)
        assert type(outcome) is Ack  # (never paused without a pacer)
        return outcome

    def run_link(self, session: str, batch: Batch, codec: str = "", resume: Paused | None = None,
                 pacer: Pacer | None = None) -> Ack | Paused:
        """Run (or, with ``resume``, go on with) a batch from a client's link: link commands only. ``codec`` is
        what the link negotiated for Read results. While ``pacer`` is active, its launches and library calls are
        paced (worker/_pacing.py), and the batch may stop before one of them: ``Paused``, to be passed back as
        ``resume``."""
        self._codec = codec
        try:
            return self._run(session, batch, self.link_handlers, resume,
                             pacer if pacer is not None and pacer.active else None)
        finally:
            self._codec = ""  # ("" elsewhere: the front checks results are raw bytes)

    def _run(self, session: str, batch: Batch, handlers: dict[type[Command], Callable[[SessionObjects, Any], Any]],
             resume: Paused | None, pacer: Pacer | None) -> Ack | Paused:
        objs = self.tables.session(session)
        start = resume or Paused(0, None)
        result: Any = start.result
        done = start.done
        command: Command | None = None
        commands = batch.commands
        try:
            for command in commands[done:] if done else commands:
                handler = handlers.get(type(command))
                if handler is None:
                    if type(command) in self.handlers:
                        raise InvalidArgument(f"{tag_of(command)} cannot be sent on a link; it goes through the "
                                              "front")
                    raise Unimplemented(f"this worker has no handler for {tag_of(command)}")
                if pacer is not None and type(command) in _PACED:
                    # (a batch that goes on runs one command before it stops again: it always gets on)
                    if pacer.before() and (done > start.done or resume is None):
                        return Paused(done, result)
                    result = handler(objs, command)
                    stream = command.stream  # type: ignore[attr-defined]  # (every paced command has one)
                    pacer.after(objs.stream(stream) if stream else None)
                else:
                    result = handler(objs, command)
                done += 1
        except GpuBrokerError as exc:
            if exc.details.get("fatal"):
                self.fatal = True
            else:
                self._free_tensors_after(objs, commands[done + 1:])
            return Ack(batch.id, done, self._error(batch, done, objs, command, exc))
        except Exception as exc:  # a bug or an untranslated runtime error: report it, keep the worker
            log.exception("%s failed", tag_of(command) if command is not None else "a batch")
            return Ack(batch.id, done, self._error(batch, done, objs, command,
                                                   Internal(f"{type(exc).__name__}: {exc}")))
        return Ack(batch.id, done, None, result)

    @staticmethod
    def _free_tensors_after(objs: SessionObjects, skipped: list[Command]) -> None:
        """The torch frees a failure skipped still let go of their tensors. The torch device queues one per few
        operators and cannot tell which batch a failure cut short; a tenant that catches the error and goes on
        (a training loop) would otherwise hold those tensors on its quota until its session ends. A free only
        drops references (an unknown handle is skipped), so running it changes nothing else; the Ack still counts
        it as not run, and sending it again is harmless."""
        torch = objs.torch
        if torch is not None:
            for command in skipped:
                if isinstance(command, TorchFree):
                    torch.free(command.handles)

    def issuing(self) -> bool:
        """Whether device-time segments are open: then the worker calls ``idle`` before it waits for input."""
        return self._segments_open is not None and not self.fatal and self._segments_open()

    def idle(self) -> None:
        """The worker is about to wait for input: end the device-time segments, so the wait is not charged."""
        if self._end_segments is not None and not self.fatal:
            self._end_segments()

    def answered(self) -> None:
        """A link's batch was answered: its client reads the answer now, and the backend may do ahead what the
        next batch's first command would otherwise pay for (``anchor_device_time``)."""
        if self._anchor is not None and not self.fatal:
            self._anchor()

    @staticmethod
    def _error(batch: Batch, done: int, objs: SessionObjects, command: Command | None,
               exc: GpuBrokerError) -> CommandError:
        # (as_wire keeps only details that encode for certain: an Ack that failed to encode would leave its link or
        # request unanswered)
        return CommandError.of(batch.first + done, _describe(objs, command) if command is not None else "batch", exc)

    # -- memory ------------------------------------------------------------------------------------
    @handles(Allocate)
    def _allocate(self, objs: SessionObjects, cmd: Allocate) -> None:
        tables = self.tables
        tables.claim(objs, "buf", cmd.handle)
        tables.reserve(cmd.size)
        try:
            buf = self.backend.allocate_memory(cmd.size)
        except BaseException:
            tables.unreserve(cmd.size)
            raise
        objs.kinds[cmd.handle] = "buf"
        objs.buffers[cmd.handle] = BufferEntry(buf, cmd.size)
        objs.memory_used += cmd.size

    @handles(Free)
    def _free(self, objs: SessionObjects, cmd: Free) -> None:
        entry = objs.buffer(cmd.handle)
        if entry.pins:
            raise FailedPrecondition("buffer in use by a copy to another device")
        self.backend.free_memory(entry.buffer)
        self.forget_buffer(objs, cmd.handle, entry)

    def forget_buffer(self, objs: SessionObjects, handle: str, entry: BufferEntry) -> None:
        """The buffer was freed on the device: take it out of the table and the accounts."""
        del objs.buffers[handle], objs.kinds[handle]
        objs.memory_used -= entry.size
        self.tables.unreserve(entry.size)
        objs.forget_caches()

    @handles(Memset)
    def _memset(self, objs: SessionObjects, cmd: Memset) -> None:
        size = cmd.size
        if size < -1:
            raise InvalidArgument(f"memset size must be >= 0, or -1 for the rest of the view; got {size}")
        self.backend.memset(objs.view(*cmd.buf), cmd.value, None if size == -1 else size, cmd.offset,
                            objs.stream(cmd.stream))

    @handles(CopyD2D)
    def _copy_d2d(self, objs: SessionObjects, cmd: CopyD2D) -> None:
        self.backend.copy_d2d(objs.view(*cmd.src), objs.view(*cmd.dst), cmd.size, cmd.src_offset, cmd.dst_offset,
                              objs.stream(cmd.stream))
        self.done.d2d_bytes += cmd.size

    @handles(Write)
    def _write(self, objs: SessionObjects, cmd: Write) -> None:
        view = objs.view(*cmd.buf)
        data: Bytes = cmd.data  # (a view of the frame it came in: no copy)
        if cmd.codec:
            if cmd.codec not in CODECS:
                raise InvalidArgument(f"unknown codec {cmd.codec!r}; this worker knows {list(CODECS)}")
            # The range first: what the block claims to hold is bounded by the buffer before a byte is made for it.
            check_device_range(view, cmd.offset, cmd.size, "copy_h2d")
            if cmd.size > self.max_inflate:
                raise InvalidArgument(f"an {cmd.codec} write inflates to at most {self.max_inflate} bytes (the link's "
                                      f"max frame), this one says {cmd.size}")
            data = _lz4_block_exact(cmd.data, cmd.size)
        self.backend.copy_h2d(data, view, cmd.offset, objs.stream(cmd.stream))
        self.done.h2d_bytes += len(data)

    @handles(Read)
    def _read(self, objs: SessionObjects, cmd: Read) -> bytearray | memoryview | list[Any]:
        view = objs.view(*cmd.buf)
        check_device_range(view, cmd.offset, cmd.size, "copy_d2h")  # before the host buffer is made for it
        out = self.host_buffer(cmd.size)  # encoded as bin as it is: no copy to bytes first
        self.backend.copy_d2h(view, out, cmd.offset, objs.stream(cmd.stream))
        self.done.d2h_bytes += cmd.size
        if not cmd.codec or cmd.codec != self._codec:  # not asked, or not negotiated on this path: raw bytes
            return out
        if objs.raw_reads > 0:
            objs.raw_reads -= 1
            return ["", out]
        packed = lz4.block.compress(out, store_size=False)
        # Only when it shrinks by a useful part: random data would come back as large, and the client would
        # decompress for nothing; then the next chunks go raw untried (the worker's CPU is the tenant's turn).
        if len(packed) <= cmd.size - (cmd.size >> 4):
            return [cmd.codec, packed]
        objs.raw_reads = _RAW_READS
        return ["", out]

    @handles(CopyShared)
    def _copy_shared(self, objs: SessionObjects, cmd: CopyShared) -> None:
        """Between a mapped segment and device memory: the backend reads or writes the mapping directly (by its
        page-locked address where it has one: no view of the mapping made for each copy)."""
        buf, stream, seg = objs.view(*cmd.buf), objs.stream(cmd.stream), objs.segment(cmd.segment)
        copy = self._copy_registered
        address = None if copy is None else self.segments.address(seg, cmd.segment_offset, cmd.size)
        if copy is not None and address is not None:
            copy(address, cmd.size, buf, cmd.offset, cmd.to_device, stream)
        else:
            with self.segments.view(seg, cmd.segment_offset, cmd.size) as host:
                if cmd.to_device:
                    self.backend.copy_h2d(host, buf, cmd.offset, stream)
                else:
                    self.backend.copy_d2h(buf, host, cmd.offset, stream)
        if cmd.to_device:
            self.done.h2d_bytes += cmd.size
        else:
            self.done.d2h_bytes += cmd.size

    # -- launches ----------------------------------------------------------------------------------
    @handles(Launch)
    def _launch(self, objs: SessionObjects, cmd: Launch) -> None:
        """Straight to the backend, which checks the dims and the args against the kernel and the device."""
        key = (cmd.kernel, tuple(cmd.args))
        prep = objs.launch_args.get(key)
        if prep is None:
            entry = objs.kernels.get(cmd.kernel)
            if entry is None:
                raise objs.missing("kernel", cmd.kernel)
            prep = self._prepare(entry.kernel, self._resolve_args(objs, cmd.args))
            if len(objs.launch_args) >= _CACHE_MAX:
                objs.launch_args.clear()
            objs.launch_args[key] = prep
        self._launch_prepared(prep, cmd.grid, cmd.block, cmd.shared_mem,
                              objs.stream(cmd.stream) if cmd.stream else None)
        self.done.launches += 1

    @handles(RunLibrary)
    def _run_library(self, objs: SessionObjects, cmd: RunLibrary) -> None:
        """The arrays on the session's buffer views (a handle of the session's, a view inside its allocation),
        then the backend's library, which checks everything else against the op table and the allocations
        (``check_library_call``, as it does for an in-process caller: the worker trusts nothing the client sends,
        and checks once)."""
        inputs = [ArrayRef(objs.view(*ref), dtype, shape) for ref, dtype, shape in cmd.inputs]
        outputs = [ArrayRef(objs.view(*ref), dtype, shape) for ref, dtype, shape in cmd.outputs]
        self.backend.run_library(cmd.name, inputs, outputs, cmd.params,
                                 objs.stream(cmd.stream) if cmd.stream else None)

    @staticmethod
    def _resolve_args(objs: SessionObjects, args: list[KernelArg]) -> list[object]:
        return [objs.view(arg.handle, arg.offset) if isinstance(arg, BufferArg) else _scalar(arg.dtype, arg.value)
                for arg in args]

    # -- the torch device ----------------------------------------------------------------------------
    def _torch(self, objs: SessionObjects) -> TorchSession:
        """The session's torch tensors, made at its first torch command (PyTorch is imported then)."""
        session = objs.torch
        if session is None:
            make: Callable[[TorchAccounts], TorchSession] | None = getattr(self.backend, "torch_session", None)
            if make is None:
                raise Unimplemented("this worker's backend has no torch device")
            session = objs.torch = make(_SessionAccounts(self.tables, objs))
        return session

    @handles(TorchOp)
    def _torch_op(self, objs: SessionObjects, cmd: TorchOp) -> None:
        self._torch(objs).op(cmd, objs.stream(cmd.stream))

    @handles(TorchOpSync)
    def _torch_op_sync(self, objs: SessionObjects, cmd: TorchOpSync) -> OpResult:
        return self._torch(objs).op_sync(cmd, objs.stream(cmd.stream))

    @handles(TorchFromBuffer)
    def _torch_from_buffer(self, objs: SessionObjects, cmd: TorchFromBuffer) -> None:
        self._torch(objs).from_buffer(cmd.handle, objs.view(*cmd.buf), cmd.meta, objs.stream(cmd.stream))

    @handles(TorchToBuffer)
    def _torch_to_buffer(self, objs: SessionObjects, cmd: TorchToBuffer) -> None:
        self._torch(objs).to_buffer(cmd.handle, objs.view(*cmd.buf), objs.stream(cmd.stream))

    @handles(TorchRead)
    def _torch_read(self, objs: SessionObjects, cmd: TorchRead) -> bytes:
        return self._torch(objs).read(cmd.handle, objs.stream(cmd.stream))

    @handles(TorchFree)
    def _torch_free(self, objs: SessionObjects, cmd: TorchFree) -> None:
        if objs.torch is not None:  # (no torch command yet: nothing to free, and no reason to import PyTorch)
            objs.torch.free(cmd.handles)

    @handles(TorchSeed)
    def _torch_seed(self, objs: SessionObjects, cmd: TorchSeed) -> None:
        self._torch(objs).seed(cmd.seed)

    # -- streams -----------------------------------------------------------------------------------
    @handles(CreateStream)
    def _create_stream(self, objs: SessionObjects, cmd: CreateStream) -> None:
        self.tables.claim(objs, "stream", cmd.handle)
        objs.streams[cmd.handle] = self.backend.create_stream()
        objs.kinds[cmd.handle] = "stream"

    @handles(DestroyStream)
    def _destroy_stream(self, objs: SessionObjects, cmd: DestroyStream) -> None:
        stream = objs.streams.get(cmd.handle)
        if stream is None:
            raise objs.missing("stream", cmd.handle)
        self.backend.destroy_stream(stream)
        del objs.streams[cmd.handle], objs.kinds[cmd.handle]
        objs.forget_caches()

    @handles(Synchronize)
    def _synchronize(self, objs: SessionObjects, cmd: Synchronize) -> None:
        self.backend.synchronize(objs.stream(cmd.stream))

    # -- events ------------------------------------------------------------------------------------
    @handles(CreateEvent)
    def _create_event(self, objs: SessionObjects, cmd: CreateEvent) -> None:
        self.tables.claim(objs, "event", cmd.handle)
        objs.events[cmd.handle] = self.backend.create_event()
        objs.kinds[cmd.handle] = "event"

    @handles(DestroyEvent)
    def _destroy_event(self, objs: SessionObjects, cmd: DestroyEvent) -> None:
        self.backend.destroy_event(objs.event(cmd.handle))
        del objs.events[cmd.handle], objs.kinds[cmd.handle]

    @handles(RecordEvent)
    def _record_event(self, objs: SessionObjects, cmd: RecordEvent) -> None:
        self.backend.record_event(objs.event(cmd.event), objs.stream(cmd.stream))

    @handles(WaitEvent)
    def _wait_event(self, objs: SessionObjects, cmd: WaitEvent) -> None:
        self.backend.wait_event(objs.event(cmd.event), objs.stream(cmd.stream))

    @handles(SynchronizeEvent)
    def _synchronize_event(self, objs: SessionObjects, cmd: SynchronizeEvent) -> None:
        self.backend.synchronize_event(objs.event(cmd.event))

    # -- the device --------------------------------------------------------------------------------
    @handles(DeviceInfoQuery)
    def _device_info(self, objs: SessionObjects, cmd: DeviceInfoQuery) -> dict[str, Any]:
        info = asdict(self.backend.device_info())
        info["memory_used"] = self.tables.memory_used
        quota = self.tables.limits.memory_quota
        if quota is not None:
            info["memory_quota"] = quota
            info["memory_available"] = max(0, quota - self.tables.memory_used)
        return info

    # -- modules and kernels (through the front only) -----------------------------------------------
    @handles(LoadModule)
    def _load_module(self, objs: SessionObjects, cmd: LoadModule) -> list[str]:
        self.tables.claim(objs, "module", cmd.handle)
        try:
            fmt = ModuleFormat(cmd.format)
        except ValueError:
            raise InvalidArgument(f"unknown module format {cmd.format!r}") from None
        module = self.backend.load_module(cmd.image, fmt, tuple(cmd.options))
        objs.modules[cmd.handle] = module
        objs.kinds[cmd.handle] = "module"
        return list(module.kernel_names)

    @handles(GetKernel)
    def _get_kernel(self, objs: SessionObjects, cmd: GetKernel) -> None:
        self.tables.claim(objs, "kernel", cmd.handle)
        kernel = self.backend.get_kernel(objs.module(cmd.module), cmd.name)
        objs.kernels[cmd.handle] = KernelEntry(kernel, cmd.name, cmd.module)
        objs.kinds[cmd.handle] = "kernel"

    @handles(UnloadModule)
    def _unload_module(self, objs: SessionObjects, cmd: UnloadModule) -> None:
        self.unload(objs, cmd.handle, objs.module(cmd.handle))

    def unload(self, objs: SessionObjects, handle: str, module: Module) -> None:
        # Every backend has it, but it is not part of the SDK's GpuCompute, the type open_backend returns
        self.backend.unload_module(module)  # type: ignore[attr-defined]
        del objs.modules[handle], objs.kinds[handle]
        for kernel in [k for k, entry in objs.kernels.items() if entry.module == handle]:
            del objs.kernels[kernel], objs.kinds[kernel]
        objs.forget_caches()
