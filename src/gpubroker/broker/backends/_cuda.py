"""GpuCompute in-process on an NVIDIA GPU through CuPy (cupy-cuda13x).

Kernels are CUDA C compiled by NVRTC, or PTX / cubin / fatbin images. Look kernels up by the name
in the source, so declare them ``extern "C" __global__``: C++ kernels get mangled names (the
mangled name, as listed in ``Module.kernel_names``, works too).

The class is split by concept: copies and memsets live in ``_cuda_copies``, module loading, compilation and
launches in ``_cuda_modules``, copies from another device's worker in ``_cuda_peer``, device-time bookkeeping
in ``_cuda_timing``, CuPy helpers in ``_cuda_util``.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import cupy
import numpy as np
from cupy.cuda import runtime
from cupy.cuda.memory import Memory

from gpubroker.broker.backends import _library
from gpubroker.broker.backends._common import HandleTable, LaunchChecker
from gpubroker.broker.backends._cuda_copies import CudaCopyMixin
from gpubroker.broker.backends._cuda_modules import CudaCodeMixin
from gpubroker.broker.backends._cuda_peer import CudaPeerMixin
from gpubroker.broker.backends._cuda_timing import DeviceTimer
from gpubroker.broker.backends._cuda_util import KernelRec, ModuleRec, list_cuda_devices, props_info, translate
from gpubroker.wire.errors import (
    Aborted,
    FailedPrecondition,
    GpuBrokerError,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
)
from gpubroker.wire.types import ArrayRef, Buffer, DeviceInfo, Event, Stream

__all__ = ["CudaBackend", "list_cuda_devices"]

log = logging.getLogger(__name__)

# Library calls take their temporaries (cuSOLVER / cuFFT workspaces, CuPy intermediates) from CuPy's pool, which
# the quota does not count (see _library). The pool keeps freed blocks for reuse; past this many idle bytes they
# go back to the device. Not after every call: cudaFree waits for the whole device, which would make each
# library call synchronous.
_POOL_IDLE_MAX = 256 << 20


class CudaBackend(CudaCopyMixin, CudaCodeMixin, CudaPeerMixin):
    """One CUDA device in this process. Launches and d2d copies / memsets are asynchronous.

    Kernels must be ``extern "C"`` (or looked up by mangled name). ``stream=None`` is the legacy
    default stream; streams from ``create_stream`` are non-blocking, so order work across them
    with ``synchronize``.
    """

    def __init__(self, device: int = 0) -> None:
        if not isinstance(device, (int, np.integer)) or isinstance(device, bool):
            raise InvalidArgument(f"device must be an int, got {device!r}")
        self._device = int(device)
        self._ready = False
        self._closed = False
        self._fatal: Aborted | None = None
        self._buffers: HandleTable[Memory] = HandleTable("buf")
        self._streams: HandleTable[cupy.cuda.Stream] = HandleTable("stream")
        self._cuda_events: HandleTable[cupy.cuda.Event] = HandleTable("event")
        self._modules: HandleTable[ModuleRec] = HandleTable("module")
        self._kernels: HandleTable[KernelRec] = HandleTable("kernel")
        self.allocated_bytes = 0
        # Device time of the commands issued since the last take_device_time, measured with CUDA events.
        self._timer = DeviceTimer()
        # A non-fatal error that take_device_time saw while waiting; the tenant's next synchronize raises it.
        self._deferred: GpuBrokerError | None = None
        self._deferred_lock = threading.Lock()

    # -- lifecycle ---------------------------------------------------------------------------
    def initialize(self) -> None:
        if self._closed:
            raise FailedPrecondition("the cuda backend is closed")
        if self._ready:
            return
        try:
            count = runtime.getDeviceCount()
            if not 0 <= self._device < count:
                raise NotFound(f"no CUDA device {self._device} ({count} present)")
            cupy.cuda.Device(self._device).use()
            self._info, self._smem_optin = props_info(self._device, runtime.memGetInfo()[0])
            self._checker = LaunchChecker(self._info)  # device-limit launch checks, memoized per signature
            self._null = cupy.cuda.Stream.null
        except Exception as exc:
            raise translate("initialize", exc) from exc
        self._ready = True

    def __enter__(self) -> CudaBackend:
        self.initialize()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Wait for the device, then free everything. Never raises; idempotent."""
        if self._closed:
            return
        self._closed = True
        if not self._ready:
            return
        if self._fatal is None:
            try:
                runtime.setDevice(self._device)
                self._timer.flush()  # end marks before the wait, so the wait is not charged
                runtime.deviceSynchronize()
            except Exception as exc:
                err = translate("close", exc)
                log.warning("error surfaced while closing the CUDA backend: %s", err.message)
                if isinstance(err, Aborted):
                    self._fatal = err
        if self._fatal is None:
            self._timer.settle()  # the work is done: a take after close still charges it
        else:
            self._timer.abandon()
        tables = (self._cuda_events, self._kernels, self._modules, self._streams, self._buffers)
        for table in tables:
            for handle in table.handles():
                obj = table.pop(handle)
                if self._fatal is not None:
                    # Leak on purpose: in a poisoned context each destructor (cudaFree, cuModuleUnload)
                    # would only print a CUDA error, and the worker exits right after this anyway.
                    ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))
        self.allocated_bytes = 0

    def _use(self) -> None:
        """Refuse work when closed or broken; make our device current on this thread."""
        if self._closed:
            raise FailedPrecondition("the cuda backend is closed")
        if not self._ready:
            raise FailedPrecondition("the cuda backend is not initialized; call initialize() first")
        if self._fatal is not None:
            raise Aborted(f"the CUDA context is unusable after an earlier error: {self._fatal.message}",
                          fatal=True)
        if runtime.getDevice() != self._device:
            runtime.setDevice(self._device)

    def _fail(self, what: str, exc: BaseException) -> GpuBrokerError:
        err = translate(what, exc)
        if isinstance(err, Aborted) and err.details.get("fatal"):
            self._fatal = err
        return err

    def device_info(self) -> DeviceInfo:
        self._use()
        try:
            info, _ = props_info(self._device, runtime.memGetInfo()[0])
        except Exception as exc:
            raise self._fail("device_info", exc) from exc
        return info

    # -- memory ------------------------------------------------------------------------------
    def allocate_memory(self, size: int) -> Buffer:
        self._use()
        if not isinstance(size, (int, np.integer)) or isinstance(size, bool) or size <= 0:
            raise InvalidArgument(f"allocation size must be a positive int, got {size!r}")
        size = int(size)
        if size > self._info.total_memory:
            raise ResourceExhausted(f"{size} bytes is more than the device's {self._info.total_memory}")
        try:
            mem = Memory(size)  # plain cudaMalloc, not CuPy's pool: exact accounting, real frees
        except Exception as exc:
            raise self._fail(f"allocate {size} bytes", exc) from exc
        self.allocated_bytes += size
        return Buffer(self._buffers.add(mem), size)

    def free_memory(self, buf: Buffer) -> None:
        self._use()
        self._resolve(buf)
        # Dropping the last reference calls cudaFree, which also waits for work that may use it.
        self.allocated_bytes -= self._buffers.pop(buf.handle).size

    def _resolve(self, buf: Buffer) -> tuple[Memory, Buffer]:
        """The allocation behind a view, and the view re-sized to it (a client's buf.size is not trusted)."""
        if not isinstance(buf, Buffer):
            raise InvalidArgument(f"expected a Buffer, got {type(buf).__name__}")
        mem = self._buffers.get(buf.handle)
        if not isinstance(buf.offset, (int, np.integer)):
            raise InvalidArgument(f"buffer view offset must be an int, got {buf.offset!r}")
        return mem, Buffer(buf.handle, mem.size, int(buf.offset))

    def _stream(self, stream: Stream | None) -> cupy.cuda.Stream:
        if stream is None:
            return self._null
        if not isinstance(stream, Stream):
            raise InvalidArgument(f"expected a Stream or None, got {type(stream).__name__}")
        return self._streams.get(stream.handle)

    # -- streams -----------------------------------------------------------------------------
    def create_stream(self) -> Stream:
        self._use()
        try:
            s = cupy.cuda.Stream(non_blocking=True)
        except Exception as exc:
            raise self._fail("create_stream", exc) from exc
        return Stream(self._streams.add(s))

    def destroy_stream(self, stream: Stream) -> None:
        self._use()
        s = self._stream(stream)
        if s is self._null:
            raise InvalidArgument("cannot destroy the default stream")
        try:
            with self._timer.lock:
                self._timer.close(s.ptr)  # its pointer may be reused by a later stream
            s.synchronize()
        except Exception as exc:
            raise self._fail("destroy_stream", exc) from exc
        self._streams.pop(stream.handle)

    def synchronize(self, stream: Stream | None = None) -> None:
        """Wait for one stream, or for the whole device when ``stream`` is None."""
        self._use()
        s = None if stream is None else self._stream(stream)
        with self._deferred_lock:
            deferred, self._deferred = self._deferred, None
        if deferred is not None:
            raise deferred  # surfaced by a take_device_time wait; it belongs to the tenant's work
        try:
            with self._timer.lock:
                self._timer.close(None if s is None else s.ptr)  # the host waits now: end the segments first
            if s is None:
                runtime.deviceSynchronize()
            else:
                s.synchronize()
        except Exception as exc:
            raise self._fail("synchronize", exc) from exc

    # -- library operations ------------------------------------------------------------------
    def run_library(self, op: str, inputs: Sequence[ArrayRef], outputs: Sequence[ArrayRef],
                    params: Mapping[str, object] | None = None, stream: Stream | None = None) -> None:
        """cuBLAS, cuSOLVER, cuFFT and CuPy's sorts on the stream's queue, through CuPy arrays over the buffers.
        Asynchronous, except the ops whose result size depends on the data (unique, nonzero, compress), which
        wait to check it."""
        self._use()
        ins, outs, checked = _library.check_library_call(op, inputs, outputs, params,
                                                         lambda buf: self._resolve(buf)[1])
        s = self._stream(stream)
        timer = self._timer
        try:
            with _library.library_errors(op), s, timer.lock:
                timer.begin(s.ptr)
                _library.run(cupy, op, [self._cupy_array(r) for r in ins], [self._cupy_array(r) for r in outs],
                             checked)
            pool = cupy.get_default_memory_pool()
            if pool.free_bytes() > _POOL_IDLE_MAX:
                pool.free_all_blocks()
        except GpuBrokerError:
            raise
        except Exception as exc:
            raise self._fail(f"run_library of {op!r}", exc) from exc

    def _cupy_array(self, ref: ArrayRef) -> Any:
        """A CuPy array over the buffer (no copy); it holds the allocation while CuPy uses it."""
        mem, view = self._resolve(ref.buffer)
        return cupy.ndarray(ref.shape, dtype=ref.dtype, memptr=cupy.cuda.MemoryPointer(mem, view.offset))

    # -- events ------------------------------------------------------------------------------
    def _event(self, event: Event) -> cupy.cuda.Event:
        if not isinstance(event, Event):
            raise InvalidArgument(f"expected an Event, got {type(event).__name__}")
        return self._cuda_events.get(event.handle)

    def create_event(self) -> Event:
        self._use()
        try:
            ev = cupy.cuda.Event(disable_timing=True)  # ordering only: a timing event costs more to record
        except Exception as exc:
            raise self._fail("create_event", exc) from exc
        return Event(self._cuda_events.add(ev))

    def record_event(self, event: Event, stream: Stream | None = None) -> None:
        self._use()
        ev, s = self._event(event), self._stream(stream)
        try:
            ev.record(s)
        except Exception as exc:
            raise self._fail("record_event", exc) from exc

    def wait_event(self, event: Event, stream: Stream | None = None) -> None:
        """The stream waits on the GPU (cudaStreamWaitEvent); an event never recorded is complete."""
        self._use()
        ev, s = self._event(event), self._stream(stream)
        try:
            s.wait_event(ev)
        except Exception as exc:
            raise self._fail("wait_event", exc) from exc

    def synchronize_event(self, event: Event) -> None:
        self._use()
        ev = self._event(event)
        try:
            with self._timer.lock:
                self._timer.close(None)  # the host waits now: end the segments first, as synchronize does
            ev.synchronize()
        except Exception as exc:
            raise self._fail("synchronize_event", exc) from exc

    def destroy_event(self, event: Event) -> None:
        self._use()
        self._event(event)
        self._cuda_events.pop(event.handle)  # cudaEventDestroy defers until a pending record completes

    # -- device-time accounting --------------------------------------------------------------
    def device_time_open(self) -> bool:
        """Whether a device-time segment is open (commands issued since the last end mark)."""
        return self._timer.busy

    def flush_device_time(self) -> None:
        """End the open device-time segments: the worker calls this when it is about to wait for input, so the
        time the host then spends idle (waiting for the next batch) is not charged. Never raises."""
        if self._fatal is None and self._ready and not self._closed:
            self._timer.flush()

    def take_device_time(self) -> float:
        """Wait for all queued work, then return the device seconds spent by commands issued since the last
        call (kernels, copies, memsets, d2d), and reset the tally.

        Each stream's run of commands (up to a batch end, synchronize or take) is bracketed by a pair of CUDA
        events, so this is GPU time, not host time; streams that overlapped each count in full. Idle gaps
        inside a run count too (see _cuda_timing). Never raises: it is 0.0 before initialize and after a
        fatal error (the context can no longer tell).
        """
        if self._fatal is not None:
            self._timer.abandon()
            return 0.0
        if self._ready and not self._closed:
            try:  # take records the end marks: our device must be current (the caller's thread may differ)
                if runtime.getDevice() != self._device:
                    runtime.setDevice(self._device)
            except Exception:
                pass  # the wait below reports it
        pairs, total = self._timer.take()
        if not pairs:
            return total  # nothing unread (close() waited and folded everything into the total)
        try:
            if runtime.getDevice() != self._device:
                runtime.setDevice(self._device)
            runtime.deviceSynchronize()
        except Exception as exc:
            err = self._fail("take_device_time", exc)
            if self._fatal is not None:
                self._timer.abandon(pairs)
                return 0.0
            # Not the scheduler's error: the tenant's next synchronize reports it.
            with self._deferred_lock:
                if self._deferred is None:
                    self._deferred = err
            return total + self._timer.settle_pairs(pairs, completed_only=True)
        return total + self._timer.settle_pairs(pairs)
