"""The cuda backend's device state: one CUDA device's context in this process, shared by the backend's parts.

``CudaBackend`` (in ``_cuda``) owns one ``CudaDevice`` and hands it to each of its parts (``CudaCopies`` in
``_cuda_copies``, ``CudaCode`` in ``_cuda_modules``, ``CudaPeer`` in ``_cuda_peer``) in their constructors: the
context's state (open, closed, broken by a fatal error), the device's limits and launch checker, the default
stream and the created ones, the allocations, the device timer, and the helpers every operation starts with
(``use``, ``resolve``, ``stream``, ``fail``) or waits with (``synchronize``).
"""

from __future__ import annotations

import threading

import cupy
import numpy as np
from cupy.cuda import runtime
from cupy.cuda.memory import Memory

from gpubroker.broker.backends._common import HandleTable, LaunchChecker
from gpubroker.broker.backends._cuda_timing import DeviceTimer
from gpubroker.broker.backends._cuda_util import props_info, translate
from gpubroker.wire.errors import Aborted, FailedPrecondition, GpuBrokerError, InvalidArgument, NotFound
from gpubroker.wire.types import Buffer, DeviceInfo, Stream

__all__ = ["CudaDevice"]


class CudaDevice:
    """CUDA device ``index``'s context as this process uses it. Construct cheaply; ``open()`` opens the device."""

    # Set by open(): a method that passed use() may rely on them.
    info: DeviceInfo
    smem_optin: int
    checker: LaunchChecker  # device-limit launch checks, memoized per signature
    null: cupy.cuda.Stream

    def __init__(self, index: int) -> None:
        self.index = index
        self.opened = False
        self.closed = False
        self.fatal: Aborted | None = None
        self.buffers: HandleTable[Memory] = HandleTable("buf")
        self.streams: HandleTable[cupy.cuda.Stream] = HandleTable("stream")
        # Device time of the commands issued since the last take_device_time, measured with CUDA events.
        self.timer = DeviceTimer()
        # A non-fatal error that take_device_time saw while waiting; the tenant's next synchronize raises it.
        self._deferred: GpuBrokerError | None = None
        self._deferred_lock = threading.Lock()

    def open(self) -> None:
        if self.closed:
            raise FailedPrecondition("the cuda backend is closed")
        if self.opened:
            return
        try:
            count = runtime.getDeviceCount()
            if not 0 <= self.index < count:
                raise NotFound(f"no CUDA device {self.index} ({count} present)")
            cupy.cuda.Device(self.index).use()
            self.info, self.smem_optin = props_info(self.index, runtime.memGetInfo()[0])
            self.checker = LaunchChecker(self.info)
            self.null = cupy.cuda.Stream.null
        except Exception as exc:
            raise translate("initialize", exc) from exc
        self.opened = True

    def use(self) -> None:
        """Refuse work when closed or broken; make our device current on this thread."""
        if self.closed:
            raise FailedPrecondition("the cuda backend is closed")
        if not self.opened:
            raise FailedPrecondition("the cuda backend is not initialized; call initialize() first")
        if self.fatal is not None:
            raise Aborted(f"the CUDA context is unusable after an earlier error: {self.fatal.message}",
                          fatal=True)
        if runtime.getDevice() != self.index:
            runtime.setDevice(self.index)

    def fail(self, what: str, exc: BaseException) -> GpuBrokerError:
        err = translate(what, exc)
        if isinstance(err, Aborted) and err.details.get("fatal"):
            self.fatal = err
        return err

    def resolve(self, buf: Buffer) -> tuple[Memory, Buffer]:
        """The allocation behind a view, and the view re-sized to it (a client's buf.size is not trusted)."""
        if not isinstance(buf, Buffer):
            raise InvalidArgument(f"expected a Buffer, got {type(buf).__name__}")
        mem = self.buffers.get(buf.handle)
        if type(buf) is Buffer and type(buf.offset) is int and buf.size == mem.size:
            return mem, buf  # (the worker's own views are sized so already: a frozen dataclass costs 1 us to make)
        if not isinstance(buf.offset, (int, np.integer)):
            raise InvalidArgument(f"buffer view offset must be an int, got {buf.offset!r}")
        return mem, Buffer(buf.handle, mem.size, int(buf.offset))

    def stream(self, stream: Stream | None) -> cupy.cuda.Stream:
        if stream is None:
            return self.null
        if not isinstance(stream, Stream):
            raise InvalidArgument(f"expected a Stream or None, got {type(stream).__name__}")
        return self.streams.get(stream.handle)

    def synchronize(self, stream: Stream | None = None) -> None:
        """Wait for one stream, or for the whole device when ``stream`` is None."""
        self.use()
        s = None if stream is None else self.stream(stream)
        with self._deferred_lock:
            deferred, self._deferred = self._deferred, None
        if deferred is not None:
            raise deferred  # surfaced by a take_device_time wait; it belongs to the tenant's work
        timer = self.timer
        try:
            with timer.lock:
                waited = timer.close_for_sync(None if s is None else s.ptr)  # the host waits now: end the segments
            timer.wait(waited, runtime.deviceSynchronize if s is None else s.synchronize)
        except Exception as exc:
            raise self.fail("synchronize", exc) from exc

    def defer(self, err: GpuBrokerError) -> None:
        """Keep a non-fatal error a device-time wait saw for the tenant's next synchronize (the first one wins)."""
        with self._deferred_lock:
            if self._deferred is None:
                self._deferred = err
