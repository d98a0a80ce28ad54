"""GpuCompute in-process on an OpenCL device through pyopencl (PoCL's CPU device when there is no GPU)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from types import TracebackType

import numpy as np
import pyopencl as cl

from gpubroker.client import (
    Buffer,
    DeviceInfo,
    FailedPrecondition,
    HostBuffer,
    InvalidArgument,
    Kernel,
    Module,
    ModuleFormat,
    NotFound,
    ResourceExhausted,
    Stream,
)
from gpubroker.client._host import check_device_range, readable_bytes, writable_bytes

from ._common import HandleTable, LaunchChecker, LaunchShape
from ._opencl_info import (
    KernelRec,
    all_devices,
    as_int,
    build_program,
    check_arg,
    cl_errors,
    describe_device,
    translate_cl_error,
)
from ._opencl_info import list_opencl_devices as list_opencl_devices

__all__ = ["OpenCLBackend", "list_opencl_devices"]

# Every queue profiles its commands, so take_device_time can charge what the device really spent.
_QUEUE_PROPS = cl.command_queue_properties.PROFILING_ENABLE
# Past this many untaken events, completed ones are folded into a running total (bounded memory).
_FOLD_EVENTS = 4096
_START, _END = cl.profiling_info.START, cl.profiling_info.END
_COMPLETE = cl.command_execution_status.COMPLETE


@dataclass
class _Alloc:
    mem: cl.Buffer
    size: int


@dataclass
class _ModuleRec:
    program: cl._cl._Program
    kernel_names: tuple[str, ...]
    kernels: set[str] = field(default_factory=set)


class OpenCLBackend:
    """One OpenCL device, driven in-process. Construct cheaply; ``initialize()`` opens the device."""

    def __init__(self, device: int = 0) -> None:
        self._index = as_int(device, "device")
        self._device: cl.Device | None = None
        self._context: cl.Context | None = None
        self._queue: cl.CommandQueue | None = None
        self._info: DeviceInfo | None = None
        self._checker: LaunchChecker | None = None  # device-limit launch checks, memoized per signature
        self._align = 1
        self._max_alloc = 0
        self._local_mem = 0
        self._allocated = 0
        self._closed = False
        # Guards bookkeeping and the set-args-then-enqueue pair (a cl.Kernel's args are shared state).
        self._lock = threading.RLock()
        self._buffers: HandleTable[_Alloc] = HandleTable("buf")
        self._streams: HandleTable[cl.CommandQueue] = HandleTable("stream")
        self._modules: HandleTable[_ModuleRec] = HandleTable("mod")
        self._kernels: HandleTable[KernelRec] = HandleTable("kern")
        # Sub-buffers made for launches stay referenced until their launch completes.
        self._in_flight: list[tuple[cl.CommandQueue, cl.Event, list[cl.Buffer]]] = []
        # Device-time accounting: events of commands issued since the last take_device_time, plus the
        # seconds of completed ones already folded out of the list.
        self._events: list[cl.Event] = []
        self._folded = 0.0
        self._fold_at = _FOLD_EVENTS

    # -- lifecycle -------------------------------------------------------------------------------

    def initialize(self) -> None:
        """Create the context and the default in-order queue; a second call does nothing."""
        with self._lock:
            if self._closed:
                raise FailedPrecondition("the opencl backend is closed")
            if self._context is not None:
                return
            devices = all_devices()
            if not 0 <= self._index < len(devices):
                raise NotFound(f"opencl device {self._index} not found ({len(devices)} device(s) available)")
            device = devices[self._index]
            with cl_errors("initialize"):
                context = cl.Context([device])
                self._queue = cl.CommandQueue(context, device, properties=_QUEUE_PROPS)
                # mem_base_addr_align is in bits; sub-buffer origins must be multiples of it.
                self._align = max(int(device.mem_base_addr_align) // 8, 1)
                self._max_alloc = int(device.max_mem_alloc_size)
                self._local_mem = int(device.local_mem_size)
            self._info = describe_device(device, self._index)
            self._checker = LaunchChecker(self._info)
            self._device, self._context = device, context

    def close(self) -> None:
        """Finish all queued work and release everything; safe to call twice."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for queue in self._all_queues():
                # Closing must release everything even if a queued command failed.
                with contextlib.suppress(cl.Error):
                    queue.finish()
            # Keep the finished work's device time: a take after close still charges it.
            self._fold_completed(drop_pending=True)
            for handle in self._buffers.handles():
                with contextlib.suppress(cl.Error):
                    self._buffers.pop(handle).mem.release()
            self._in_flight.clear()
            self._kernels = HandleTable("kern")
            self._modules = HandleTable("mod")
            self._streams = HandleTable("stream")
            self._allocated = 0
            self._queue = self._context = self._device = None

    def __enter__(self) -> OpenCLBackend:
        self.initialize()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def _ready(self) -> DeviceInfo:
        if self._closed:
            raise FailedPrecondition("the opencl backend is closed")
        if self._info is None:
            raise FailedPrecondition("the opencl backend is not initialized; call initialize() first")
        return self._info

    def _all_queues(self) -> list[cl.CommandQueue]:
        queues = [] if self._queue is None else [self._queue]
        return queues + [self._streams.get(h) for h in self._streams.handles()]

    def _queue_for(self, stream: Stream | None) -> cl.CommandQueue:
        self._ready()
        if stream is None:
            assert self._queue is not None
            return self._queue
        if not isinstance(stream, Stream):
            raise InvalidArgument(f"stream must be a Stream or None, got {type(stream).__name__}")
        return self._streams.get(stream.handle)

    # -- device and memory -----------------------------------------------------------------------

    def device_info(self) -> DeviceInfo:
        """Real device properties; free_memory is total minus what this instance has allocated."""
        info = self._ready()
        return replace(info, free_memory=max(info.total_memory - self._allocated, 0))

    def allocate_memory(self, size: int) -> Buffer:
        info = self._ready()
        size = as_int(size, "allocation size")
        if size <= 0:
            raise InvalidArgument(f"allocation size must be > 0, got {size}")
        if size > self._max_alloc:
            raise ResourceExhausted(
                f"cannot allocate {size} bytes: the device's largest single allocation is {self._max_alloc} bytes"
            )
        with self._lock:
            free = info.total_memory - self._allocated
            if size > free:
                raise ResourceExhausted(
                    f"cannot allocate {size} bytes: {free} of {info.total_memory} bytes of device memory are free"
                )
            with cl_errors("allocate_memory"):
                mem = cl.Buffer(self._context, cl.mem_flags.READ_WRITE, size)
            self._allocated += size
            return Buffer(self._buffers.add(_Alloc(mem, size)), size)

    def free_memory(self, buf: Buffer) -> None:
        self._ready()
        with self._lock:
            alloc = self._buffers.pop(self._handle_of(buf))
            self._allocated -= alloc.size
            # clReleaseMemObject defers the real free until queued commands using the buffer finish.
            with cl_errors("free_memory"):
                alloc.mem.release()

    @staticmethod
    def _handle_of(buf: object) -> str:
        if not isinstance(buf, Buffer):
            raise InvalidArgument(f"expected a Buffer, got {type(buf).__name__}")
        return buf.handle

    def _resolve(self, buf: Buffer) -> tuple[_Alloc, Buffer]:
        """The allocation behind a view, and the view re-sized to the real allocation (never trust buf.size)."""
        alloc = self._buffers.get(self._handle_of(buf))
        return alloc, Buffer(buf.handle, alloc.size, as_int(buf.offset, "buffer offset"))

    def copy_h2d(self, src: HostBuffer, buf: Buffer, offset: int = 0, stream: Stream | None = None) -> None:
        """Blocking: returns once ``src`` has been read."""
        queue = self._queue_for(stream)
        alloc, view = self._resolve(buf)
        data = readable_bytes(src)
        start = check_device_range(view, as_int(offset, "offset"), data.nbytes, "copy_h2d")
        if data.nbytes:
            with cl_errors("copy_h2d"):
                event = cl.enqueue_copy(queue, alloc.mem, data, dst_offset=start, is_blocking=True)
                # A blocking copy's NannyEvent pins the host buffer until waited on; it is complete already.
                event.wait()
            self._track(event)

    def copy_d2h(self, buf: Buffer, dst: HostBuffer, offset: int = 0, stream: Stream | None = None) -> None:
        """Blocking: returns once ``dst`` holds the data."""
        queue = self._queue_for(stream)
        alloc, view = self._resolve(buf)
        data = writable_bytes(dst)
        start = check_device_range(view, as_int(offset, "offset"), data.nbytes, "copy_d2h")
        if data.nbytes:
            with cl_errors("copy_d2h"):
                event = cl.enqueue_copy(queue, data, alloc.mem, src_offset=start, is_blocking=True)
                event.wait()  # releases the NannyEvent's hold on dst
            self._track(event)

    def copy_d2d(
        self,
        src: Buffer,
        dst: Buffer,
        size: int,
        src_offset: int = 0,
        dst_offset: int = 0,
        stream: Stream | None = None,
    ) -> None:
        """Asynchronous on the stream's queue."""
        queue = self._queue_for(stream)
        size = as_int(size, "size")
        src_alloc, src_view = self._resolve(src)
        dst_alloc, dst_view = self._resolve(dst)
        s = check_device_range(src_view, as_int(src_offset, "src_offset"), size, "copy_d2d source")
        d = check_device_range(dst_view, as_int(dst_offset, "dst_offset"), size, "copy_d2d destination")
        if size == 0:
            return
        if src_alloc is dst_alloc and s < d + size and d < s + size:
            # clEnqueueCopyBuffer refuses overlapping regions (CL_MEM_COPY_OVERLAP); say why up front.
            raise InvalidArgument(
                f"copy_d2d: source [{s}, {s + size}) and destination [{d}, {d + size}) overlap within one buffer"
            )
        with cl_errors("copy_d2d"):
            event = cl.enqueue_copy(queue, dst_alloc.mem, src_alloc.mem, byte_count=size, src_offset=s, dst_offset=d)
        self._track(event)

    def memset(
        self, buf: Buffer, value: int, size: int | None = None, offset: int = 0, stream: Stream | None = None
    ) -> None:
        """Fill ``size`` bytes (default: to the end of the view) with the byte ``value``; asynchronous."""
        queue = self._queue_for(stream)
        value = as_int(value, "memset value")
        if not 0 <= value <= 255:
            raise InvalidArgument(f"memset value must be a byte (0..255), got {value}")
        alloc, view = self._resolve(buf)
        offset = as_int(offset, "offset")
        size = max(view.nbytes - offset, 0) if size is None else as_int(size, "size")
        start = check_device_range(view, offset, size, "memset")
        if size:
            with cl_errors("memset"):
                event = cl.enqueue_fill_buffer(queue, alloc.mem, np.array([value], dtype=np.uint8), start, size)
            self._track(event)

    # -- programs and kernels --------------------------------------------------------------------

    def load_module(self, image: str | bytes, format: ModuleFormat, options: Sequence[str] = ()) -> Module:
        """Build OpenCL C source into a module; binary formats are CUDA-only."""
        self._ready()
        if format is not ModuleFormat.OPENCL_C:
            shown = format.value if isinstance(format, ModuleFormat) else repr(format)
            raise InvalidArgument(
                f"module format {shown} is not supported by the opencl backend (only {ModuleFormat.OPENCL_C.value} is)"
            )
        if isinstance(image, bytes):
            try:
                image = image.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise InvalidArgument(f"OpenCL C source is not valid UTF-8: {exc}") from None
        if not isinstance(image, str):
            raise InvalidArgument(f"OpenCL C source must be str or bytes, got {type(image).__name__}")
        handle = self._build(image, options)
        return Module(handle, self._modules.get(handle).kernel_names)

    def compile_kernel(self, source: str, name: str, options: Sequence[str] = ()) -> Kernel:
        """Build ``source`` and return its kernel ``name``; the program lives as long as the backend."""
        module = self.load_module(source, ModuleFormat.OPENCL_C, options)
        try:
            return self.get_kernel(module, name)
        except NotFound:
            self.unload_module(module)
            raise

    def _build(self, source: str, options: Sequence[str]) -> str:
        program, kernel_names = build_program(self._context, self._device, source, options)
        with self._lock:
            return self._modules.add(_ModuleRec(program, kernel_names))

    def get_kernel(self, module: Module, name: str) -> Kernel:
        """A fresh kernel object for ``name``; it belongs to ``module``."""
        self._ready()
        if not isinstance(module, Module):
            raise InvalidArgument(f"expected a Module, got {type(module).__name__}")
        rec = self._modules.get(module.handle)
        if name not in rec.kernel_names:
            raise NotFound(
                f"kernel {name!r} is not in module {module.handle!r}; "
                f"it has: {', '.join(rec.kernel_names) or '(no kernels)'}"
            )
        kernel_rec = KernelRec.create(rec.program, name, module.handle, self._device)
        with self._lock:
            handle = self._kernels.add(kernel_rec)
            rec.kernels.add(handle)
        return Kernel(handle, name)

    def unload_module(self, module: Module) -> None:
        """Drop a module and every kernel taken from it; launches already queued still run."""
        self._ready()
        if not isinstance(module, Module):
            raise InvalidArgument(f"expected a Module, got {type(module).__name__}")
        with self._lock:
            rec = self._modules.pop(module.handle)
            for handle in rec.kernels:
                self._kernels.pop(handle)

    def execute_kernel(
        self,
        kernel: Kernel,
        grid: int | Sequence[int],
        block: int | Sequence[int],
        args: Sequence[object],
        shared_mem: int = 0,
        stream: Stream | None = None,
    ) -> None:
        """Queue a launch: grid work-groups of block work-items. With shared_mem > 0 the kernel's last
        parameter must be a __local pointer, which receives shared_mem bytes (the caller does not pass it)."""
        self._ready()
        assert self._checker is not None
        shape = self._checker.check(grid, block, args, shared_mem)
        queue = self._queue_for(stream)
        if not isinstance(kernel, Kernel):
            raise InvalidArgument(f"expected a Kernel, got {type(kernel).__name__}")
        rec = self._kernels.get(kernel.handle)
        # The kernel-specific checks read only the block, shared_mem and the arg types: once a signature
        # passed them for this kernel, repeating it skips them.
        plan = (shape.block, shape.shared_mem, shape.kinds)
        if plan not in rec.plans:
            self._check_plan(rec, shape)
            rec.plans.add(plan)
        args_in = shape.args
        with self._lock:
            subs: list[cl.Buffer] = []
            values = [self._mem_arg(arg, i, subs) if isinstance(arg, Buffer) else arg for i, arg in enumerate(args_in)]
            if shape.shared_mem:
                values.append(cl.LocalMemory(shape.shared_mem))
            kern = rec.kernel
            try:  # a plain try, not cl_errors(): no generator and no message built on the hot path
                for i, value in enumerate(values):
                    kern.set_arg(i, value)
                event = cl.enqueue_nd_range_kernel(queue, kern, shape.global_size, shape.block)
            except cl.Error as exc:
                raise translate_cl_error(exc, f"launching kernel {rec.name!r}") from exc
            if self._in_flight:
                self._in_flight = [e for e in self._in_flight if not self._done(e[1])]
            if subs:
                self._in_flight.append((queue, event, subs))
            self._track(event)

    def _check_plan(self, rec: KernelRec, shape: LaunchShape) -> None:
        """The checks that need the kernel: work-group limits, local memory, each arg against its parameter."""
        specs = rec.specs
        rec.check_shape(shape.block, shape.shared_mem, self._local_mem)
        if shape.shared_mem:
            specs = specs[:-1]
        if len(shape.args) != len(specs):
            hint = (
                " (its last parameter is __local: pass shared_mem > 0 for it)"
                if rec.specs and rec.specs[-1].kind == "local" and not shape.shared_mem
                else ""
            )
            raise InvalidArgument(f"kernel {rec.name!r} takes {len(specs)} argument(s){hint}, got {len(shape.args)}")
        for spec, arg in zip(specs, shape.args, strict=True):
            check_arg(rec.name, spec, arg)

    def _mem_arg(self, arg: Buffer, index: int, subs: list[cl.Buffer]) -> cl.Buffer:
        """The cl.Buffer for a kernel arg; a view with an offset becomes a sub-buffer."""
        alloc, view = self._resolve(arg)
        if view.offset == 0:
            return alloc.mem
        if not 0 < view.offset < view.size:
            raise InvalidArgument(
                f"kernel arg {index}: view offset {view.offset} leaves no bytes of its {view.size}-byte buffer"
            )
        if view.offset % self._align:
            raise InvalidArgument(
                f"kernel arg {index}: view offset {view.offset} is not a multiple of {self._align} bytes; "
                f"this OpenCL device only passes views aligned to its mem_base_addr_align "
                f"(pass the whole buffer and an index offset instead)"
            )
        with cl_errors(f"kernel arg {index} sub-buffer"):
            sub = alloc.mem.get_sub_region(view.offset, view.nbytes)
        subs.append(sub)
        return sub

    @staticmethod
    def _done(event: cl.Event) -> bool:
        try:
            return int(event.command_execution_status) <= cl.command_execution_status.COMPLETE
        except cl.Error:
            return True  # negative statuses (errors) also mean the command will not touch the buffer again

    # -- streams ---------------------------------------------------------------------------------

    def create_stream(self) -> Stream:
        self._ready()
        with cl_errors("create_stream"):
            queue = cl.CommandQueue(self._context, self._device, properties=_QUEUE_PROPS)
        with self._lock:
            return Stream(self._streams.add(queue))

    def destroy_stream(self, stream: Stream) -> None:
        """Finish the stream's work, then drop its queue."""
        if stream is None:
            raise InvalidArgument("destroy_stream needs a Stream; the default stream cannot be destroyed")
        queue = self._queue_for(stream)
        with cl_errors("destroy_stream"):
            queue.finish()
        with self._lock:
            self._streams.pop(stream.handle)
            self._in_flight = [e for e in self._in_flight if e[0] is not queue]
            self._fold_completed()  # its commands are done: their events need not outlive the queue

    def synchronize(self, stream: Stream | None = None) -> None:
        """Wait for one stream, or for every queue when ``stream`` is None."""
        if stream is None:
            self._ready()
            queues = self._all_queues()
        else:
            queues = [self._queue_for(stream)]
        with cl_errors("synchronize"):
            for queue in queues:
                queue.finish()
        with self._lock:
            self._in_flight = [e for e in self._in_flight if not any(e[0] is q for q in queues)]

    # -- device-time accounting ------------------------------------------------------------------

    def take_device_time(self) -> float:
        """Wait for all queued work, then return the device seconds spent by commands issued since the last
        call (kernels, copies, memsets, d2d), and reset the tally. Measured by OpenCL profiling, not the
        host clock; commands on different queues that overlapped each count in full. Never raises."""
        with self._lock:
            events, self._events = self._events, []
            total, self._folded = self._folded, 0.0
            self._fold_at = _FOLD_EVENTS
            queues = [] if self._closed else self._all_queues()
        if not events:
            return total
        # Every event taken above was enqueued before these finishes, so each is complete afterwards.
        for queue in queues:
            with contextlib.suppress(cl.Error):  # a failed command surfaces at the caller's synchronize
                queue.finish()
        pending: list[cl.Event] = []
        for event in events:
            seconds = _seconds_if_done(event)
            if seconds is None:
                pending.append(event)  # only if a finish failed: charge it at the next take
            else:
                total += seconds
        if pending:
            with self._lock:
                self._events[:0] = pending
        return total

    def _track(self, event: cl.Event) -> None:
        """Keep a command's event for take_device_time; fold completed ones when too many pile up."""
        with self._lock:
            self._events.append(event)
            if len(self._events) > self._fold_at:
                self._fold_completed()
                # Doubling keeps the folding amortized O(1) per command even when the queue runs far behind.
                self._fold_at = max(_FOLD_EVENTS, 2 * len(self._events))

    def _fold_completed(self, drop_pending: bool = False) -> None:
        """Move the device time of completed (or failed) commands into the running total. Hold the lock."""
        keep: list[cl.Event] = []
        for event in self._events:
            seconds = _seconds_if_done(event)
            if seconds is not None:
                self._folded += seconds
            elif not drop_pending:
                keep.append(event)
        self._events = keep


def _seconds_if_done(event: cl.Event) -> float | None:
    """A finished command's device seconds (0.0 if it failed or has no profile), or None while it is queued
    or running."""
    try:
        status = int(event.command_execution_status)
        if status > _COMPLETE:
            return None
        if status < _COMPLETE:
            return 0.0  # the command failed: it has no profile to charge
        return (event.get_profiling_info(_END) - event.get_profiling_info(_START)) * 1e-9
    except cl.Error:
        return 0.0
