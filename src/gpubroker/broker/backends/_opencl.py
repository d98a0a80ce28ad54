"""GpuCompute in-process on an OpenCL device through pyopencl (PoCL's CPU device when there is no GPU).

The backend is composed of parts, one per concept, each holding the device state it works on: ``OpenCLDevice``
(``_opencl_device``: context, queues, allocations, lock) is shared by ``OpenCLCode`` (``_opencl_launch``:
programs, kernels and launches) and ``OpenCLTiming`` (``_opencl_timing``: device-time accounting). Memory, copies,
library operations, events and streams are here; device discovery and OpenCL helpers in ``_opencl_info``.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from types import TracebackType

import numpy as np
import pyopencl as cl

from gpubroker.broker.backends import _library
from gpubroker.broker.backends._common import HandleTable
from gpubroker.broker.backends._opencl_device import QUEUE_PROPS, Alloc, OpenCLDevice
from gpubroker.broker.backends._opencl_info import as_int, cl_errors
from gpubroker.broker.backends._opencl_info import list_opencl_devices as list_opencl_devices
from gpubroker.broker.backends._opencl_launch import OpenCLCode
from gpubroker.broker.backends._opencl_timing import OpenCLTiming
from gpubroker.broker.backends._torch import CpuPlacement, TorchAccounts, TorchPart, TorchSession
from gpubroker.wire.errors import InvalidArgument, ResourceExhausted
from gpubroker.wire.host import HostBuffer, check_device_range, readable_bytes, writable_bytes
from gpubroker.wire.types import ArrayRef, Buffer, DeviceInfo, Event, Stream

__all__ = ["OpenCLBackend", "list_opencl_devices"]


@dataclass(slots=True)
class _Marker:
    event: cl.Event | None = None


class OpenCLBackend:
    """One OpenCL device, driven in-process. Construct cheaply; ``initialize()`` opens the device."""

    def __init__(self, device: int = 0) -> None:
        dev = self._dev = OpenCLDevice(as_int(device, "device"))
        timing = self._timing = OpenCLTiming(dev)
        code = self._code = OpenCLCode(dev, timing)
        # The parts' GpuCompute methods, bound once: a launch calls OpenCLCode's method with no forwarding frame.
        self.load_module = code.load_module
        self.compile_kernel = code.compile_kernel
        self.get_kernel = code.get_kernel
        self.unload_module = code.unload_module
        self.execute_kernel = code.execute_kernel
        self.take_device_time = timing.take_device_time
        torch = self._torch = TorchPart(self.torch_session)
        self.torch_op = torch.torch_op
        self.torch_op_sync = torch.torch_op_sync
        self.torch_from_buffer = torch.torch_from_buffer
        self.torch_to_buffer = torch.torch_to_buffer
        self.torch_read = torch.torch_read
        self.torch_free = torch.torch_free
        self.torch_seed = torch.torch_seed
        self._lock = dev.lock
        self._allocated = 0
        # An event's last recorded marker; None: never recorded (complete, as in CUDA).
        self._markers: HandleTable[_Marker] = HandleTable("event")

    # -- lifecycle -------------------------------------------------------------------------------

    def initialize(self) -> None:
        """Create the context and the default in-order queue; a second call does nothing."""
        self._dev.open()

    def close(self) -> None:
        """Finish all queued work and release everything; safe to call twice."""
        dev = self._dev
        with self._lock:
            if dev.closed:
                return
            dev.closed = True
            self._torch.close()
            for queue in dev.all_queues():
                # Closing must release everything even if a queued command failed.
                with contextlib.suppress(cl.Error):
                    queue.finish()
            # Keep the finished work's device time: a take after close still charges it.
            self._timing.fold_completed(drop_pending=True)
            for handle in dev.buffers.handles():
                with contextlib.suppress(cl.Error):
                    dev.buffers.pop(handle).mem.release()
            self._code.clear()
            self._markers = HandleTable("event")
            self._allocated = 0
            dev.release()

    def __enter__(self) -> OpenCLBackend:
        self.initialize()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # -- device and memory -----------------------------------------------------------------------

    def device_info(self) -> DeviceInfo:
        """Real device properties; free_memory is total minus what this instance has allocated."""
        info = self._dev.ready()
        return replace(info, free_memory=max(info.total_memory - self._allocated, 0))

    def allocate_memory(self, size: int) -> Buffer:
        info = self._dev.ready()
        size = as_int(size, "allocation size")
        if size <= 0:
            raise InvalidArgument(f"allocation size must be > 0, got {size}")
        if size > self._dev.max_alloc:
            raise ResourceExhausted(
                f"cannot allocate {size} bytes: the device's largest single allocation is {self._dev.max_alloc} bytes"
            )
        with self._lock:
            free = info.total_memory - self._allocated
            if size > free:
                raise ResourceExhausted(
                    f"cannot allocate {size} bytes: {free} of {info.total_memory} bytes of device memory are free"
                )
            context = self._dev.context
            assert context is not None  # set together with info, which ready() checked
            with cl_errors("allocate_memory"):
                mem = cl.Buffer(context, cl.mem_flags.READ_WRITE, size)
            self._allocated += size
            return Buffer(self._dev.buffers.add(Alloc(mem, size)), size)

    def free_memory(self, buf: Buffer) -> None:
        self._dev.ready()
        with self._lock:
            alloc = self._dev.buffers.pop(self._dev.handle_of(buf))
            self._allocated -= alloc.size
            # clReleaseMemObject defers the real free until queued commands using the buffer finish.
            with cl_errors("free_memory"):
                alloc.mem.release()

    def copy_h2d(self, src: HostBuffer, buf: Buffer, offset: int = 0, stream: Stream | None = None) -> None:
        """Blocking: returns once ``src`` has been read."""
        queue = self._dev.queue_for(stream)
        alloc, view = self._dev.resolve(buf)
        data = readable_bytes(src)
        start = check_device_range(view, as_int(offset, "offset"), data.nbytes, "copy_h2d")
        if data.nbytes:
            with cl_errors("copy_h2d"):
                event = cl.enqueue_copy(queue, alloc.mem, data, dst_offset=start, is_blocking=True)
                # A blocking copy's NannyEvent pins the host buffer until waited on; it is complete already.
                event.wait()
            self._timing.track(event)

    def copy_d2h(self, buf: Buffer, dst: HostBuffer, offset: int = 0, stream: Stream | None = None) -> None:
        """Blocking: returns once ``dst`` holds the data."""
        queue = self._dev.queue_for(stream)
        alloc, view = self._dev.resolve(buf)
        data = writable_bytes(dst)
        start = check_device_range(view, as_int(offset, "offset"), data.nbytes, "copy_d2h")
        if data.nbytes:
            with cl_errors("copy_d2h"):
                event = cl.enqueue_copy(queue, data, alloc.mem, src_offset=start, is_blocking=True)
                event.wait()  # releases the NannyEvent's hold on dst
            self._timing.track(event)

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
        queue = self._dev.queue_for(stream)
        size = as_int(size, "size")
        src_alloc, src_view = self._dev.resolve(src)
        dst_alloc, dst_view = self._dev.resolve(dst)
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
        self._timing.track(event)

    def memset(
        self, buf: Buffer, value: int, size: int | None = None, offset: int = 0, stream: Stream | None = None
    ) -> None:
        """Fill ``size`` bytes (default: to the end of the view) with the byte ``value``; asynchronous."""
        queue = self._dev.queue_for(stream)
        value = as_int(value, "memset value")
        if not 0 <= value <= 255:
            raise InvalidArgument(f"memset value must be a byte (0..255), got {value}")
        alloc, view = self._dev.resolve(buf)
        offset = as_int(offset, "offset")
        size = max(view.nbytes - offset, 0) if size is None else as_int(size, "size")
        start = check_device_range(view, offset, size, "memset")
        if size:
            with cl_errors("memset"):
                event = cl.enqueue_fill_buffer(queue, alloc.mem, np.array([value], dtype=np.uint8), start, size)
            self._timing.track(event)

    # -- the torch device ------------------------------------------------------------------------

    def torch_session(self, accounts: TorchAccounts | None = None) -> TorchSession:
        """A new torch session on this device (the worker makes one per session; ``torch_*`` use their own).

        PyTorch's CPU kernels on CPU tensors: PoCL's device is the host CPU, so they are the device's library, as
        NumPy is for ``run_library``; the operators' host time is charged as device time.
        """
        self._dev.ready()
        return TorchSession(CpuPlacement(self.copy_d2h, self.copy_h2d, self._timing.charge, self._dev.queue_for),
                            accounts)

    # -- library operations ----------------------------------------------------------------------

    def run_library(self, op: str, inputs: Sequence[ArrayRef], outputs: Sequence[ArrayRef],
                    params: Mapping[str, object] | None = None, stream: Stream | None = None) -> None:
        """Blocking: computes with NumPy (LAPACK, pocketfft) on host copies of the inputs, then writes the outputs.

        PoCL's device is the host CPU, so NumPy on a copy is the device's own library; a discrete OpenCL GPU would
        pay a PCIe round trip each way, which is the price of having no BLAS / LAPACK / FFT in OpenCL C here.
        """
        queue = self._dev.queue_for(stream)
        ins, outs, checked = _library.check_library_call(op, inputs, outputs, params,
                                                         lambda buf: self._dev.resolve(buf)[1])
        host_inputs = [np.empty(ref.shape, ref.dtype) for ref in ins]
        for ref, host in zip(ins, host_inputs, strict=True):
            if host.nbytes:
                # The stream's in-order queue: the copy waits for the work queued before it.
                with cl_errors(f"run_library of {op!r}"):
                    event = cl.enqueue_copy(queue, host, self._dev.resolve(ref.buffer)[0].mem,
                                            src_offset=ref.buffer.offset, is_blocking=True)
                    event.wait()
                self._timing.track(event)
        host_outputs = [np.empty(ref.shape, ref.dtype) for ref in outs]
        started = time.perf_counter()
        try:
            with _library.library_errors(op):
                _library.run(np, op, host_inputs, host_outputs, checked)
        finally:
            # The device is this CPU: the library's time is device time, charged like a kernel's.
            self._timing.charge(time.perf_counter() - started)
        for ref, host in zip(outs, host_outputs, strict=True):
            if host.nbytes:
                with cl_errors(f"run_library of {op!r}"):
                    event = cl.enqueue_copy(queue, self._dev.resolve(ref.buffer)[0].mem, host,
                                            dst_offset=ref.buffer.offset, is_blocking=True)
                    event.wait()
                self._timing.track(event)

    # -- events ----------------------------------------------------------------------------------

    def _marker(self, event: Event) -> _Marker:
        self._dev.ready()
        if not isinstance(event, Event):
            raise InvalidArgument(f"expected an Event, got {type(event).__name__}")
        return self._markers.get(event.handle)

    def create_event(self) -> Event:
        self._dev.ready()
        with self._lock:
            return Event(self._markers.add(_Marker()))

    def record_event(self, event: Event, stream: Stream | None = None) -> None:
        """A marker on the stream's queue: complete when everything enqueued before it is."""
        marker, queue = self._marker(event), self._dev.queue_for(stream)
        with cl_errors("record_event"):
            marker.event = cl.enqueue_marker(queue)
            # Submitted now: another queue's barrier (or the host) may wait on it before this queue is flushed.
            queue.flush()

    def wait_event(self, event: Event, stream: Stream | None = None) -> None:
        """A barrier on the stream's queue that waits for the marker: the device orders them, the host goes on."""
        marker, queue = self._marker(event), self._dev.queue_for(stream)
        if marker.event is None:
            return
        with cl_errors("wait_event"):
            cl.enqueue_barrier(queue, wait_for=[marker.event])

    def synchronize_event(self, event: Event) -> None:
        marker = self._marker(event)
        if marker.event is not None:
            with cl_errors("synchronize_event"):
                marker.event.wait()

    def destroy_event(self, event: Event) -> None:
        self._marker(event)
        with self._lock:
            self._markers.pop(event.handle)  # the OpenCL event lives on while a barrier still waits for it

    # -- completion marks (the worker's pacing: worker/_pacing.py) -------------------------------
    def mark(self, stream: Stream | None) -> cl.Event:
        """A marker on the stream's queue after the work enqueued so far, submitted now (the host waits for it)."""
        queue = self._dev.queue_for(stream)
        with cl_errors("record a completion mark"):
            event = cl.enqueue_marker(queue)
            queue.flush()
        return event

    def wait_mark(self, mark: object) -> bool:
        """Wait until a mark's work is done; whether it was unfinished."""
        if not isinstance(mark, cl.Event):
            raise InvalidArgument(f"expected a mark of this backend's, got {type(mark).__name__}")
        with cl_errors("wait for a completion mark"):
            waited = mark.command_execution_status != cl.command_execution_status.COMPLETE
            if waited:
                mark.wait()
        return waited

    # -- streams ---------------------------------------------------------------------------------

    def create_stream(self) -> Stream:
        self._dev.ready()
        context, device = self._dev.context, self._dev.device
        assert context is not None and device is not None  # set together with info: ready() passed
        with cl_errors("create_stream"):
            queue = cl.CommandQueue(context, device, properties=QUEUE_PROPS)
        with self._lock:
            return Stream(self._dev.streams.add(queue))

    def destroy_stream(self, stream: Stream) -> None:
        """Finish the stream's work, then drop its queue."""
        if stream is None:
            raise InvalidArgument("destroy_stream needs a Stream; the default stream cannot be destroyed")
        queue = self._dev.queue_for(stream)
        with cl_errors("destroy_stream"):
            queue.finish()
        with self._lock:
            self._dev.streams.pop(stream.handle)
            self._code.forget_queues([queue])
            self._timing.fold_completed()  # its commands are done: their events need not outlive the queue

    def synchronize(self, stream: Stream | None = None) -> None:
        """Wait for one stream, or for every queue when ``stream`` is None."""
        if stream is None:
            self._dev.ready()
            queues = self._dev.all_queues()
        else:
            queues = [self._dev.queue_for(stream)]
        with cl_errors("synchronize"):
            for queue in queues:
                queue.finish()
        with self._lock:
            self._code.forget_queues(queues)
