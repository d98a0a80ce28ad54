"""The opencl backend's device state: one OpenCL device opened in this process, shared by the backend's parts.

``OpenCLBackend`` (in ``_opencl``) owns one ``OpenCLDevice`` and hands it to each of its parts (``OpenCLCode`` in
``_opencl_launch``, ``OpenCLTiming`` in ``_opencl_timing``) in their constructors: the context, the default queue
and the streams' queues, the allocations, the launch checker, and the lock that guards their bookkeeping.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import pyopencl as cl

from gpubroker.broker.backends._common import HandleTable, LaunchChecker
from gpubroker.broker.backends._opencl_info import all_devices, as_int, cl_errors, describe_device
from gpubroker.wire.errors import FailedPrecondition, InvalidArgument, NotFound
from gpubroker.wire.types import Buffer, DeviceInfo, Stream

__all__ = ["QUEUE_PROPS", "Alloc", "OpenCLDevice"]

# Every queue profiles its commands, so take_device_time (``_opencl_timing``) can charge what the device really spent.
QUEUE_PROPS = cl.command_queue_properties.PROFILING_ENABLE


@dataclass
class Alloc:
    mem: cl.Buffer
    size: int


class OpenCLDevice:
    """Device ``index``'s context, queues and allocations. Construct cheaply; ``open()`` opens the device."""

    def __init__(self, index: int) -> None:
        self.index = index
        # Set by open(), None before it and after release(): a method that passed ready() may rely on them.
        self.device: cl.Device | None = None
        self.context: cl.Context | None = None
        self.queue: cl.CommandQueue | None = None
        self.info: DeviceInfo | None = None
        self.checker: LaunchChecker | None = None  # device-limit launch checks, memoized per signature
        self.align = 1
        self.max_alloc = 0
        self.local_mem = 0
        self.closed = False
        # Guards bookkeeping and the set-args-then-enqueue pair (a cl.Kernel's args are shared state).
        self.lock = threading.RLock()
        self.buffers: HandleTable[Alloc] = HandleTable("buf")
        self.streams: HandleTable[cl.CommandQueue] = HandleTable("stream")

    def open(self) -> None:
        """Create the context and the default in-order queue; a second call does nothing."""
        with self.lock:
            if self.closed:
                raise FailedPrecondition("the opencl backend is closed")
            if self.context is not None:
                return
            devices = all_devices()
            if not 0 <= self.index < len(devices):
                raise NotFound(f"opencl device {self.index} not found ({len(devices)} device(s) available)")
            device = devices[self.index]
            with cl_errors("initialize"):
                context = cl.Context([device])
                self.queue = cl.CommandQueue(context, device, properties=QUEUE_PROPS)
                # mem_base_addr_align is in bits; sub-buffer origins must be multiples of it.
                self.align = max(int(device.mem_base_addr_align) // 8, 1)
                self.max_alloc = int(device.max_mem_alloc_size)
                self.local_mem = int(device.local_mem_size)
            self.info = describe_device(device, self.index)
            self.checker = LaunchChecker(self.info)
            self.device, self.context = device, context

    def release(self) -> None:
        """Drop the streams and the context (after the backend has finished the queues). Hold the lock."""
        self.streams = HandleTable("stream")
        self.queue = self.context = self.device = None

    def ready(self) -> DeviceInfo:
        if self.closed:
            raise FailedPrecondition("the opencl backend is closed")
        if self.info is None:
            raise FailedPrecondition("the opencl backend is not initialized; call initialize() first")
        return self.info

    def all_queues(self) -> list[cl.CommandQueue]:
        queues = [] if self.queue is None else [self.queue]
        return queues + [self.streams.get(h) for h in self.streams.handles()]

    def queue_for(self, stream: Stream | None) -> cl.CommandQueue:
        self.ready()
        if stream is None:
            assert self.queue is not None
            return self.queue
        if not isinstance(stream, Stream):
            raise InvalidArgument(f"stream must be a Stream or None, got {type(stream).__name__}")
        return self.streams.get(stream.handle)

    @staticmethod
    def handle_of(buf: object) -> str:
        if not isinstance(buf, Buffer):
            raise InvalidArgument(f"expected a Buffer, got {type(buf).__name__}")
        handle: str = buf.handle  # declared: mypy may see the handle as untyped (Any)
        return handle

    def resolve(self, buf: Buffer) -> tuple[Alloc, Buffer]:
        """The allocation behind a view, and the view re-sized to the real allocation (never trust buf.size)."""
        alloc = self.buffers.get(self.handle_of(buf))
        return alloc, Buffer(buf.handle, alloc.size, as_int(buf.offset, "buffer offset"))
