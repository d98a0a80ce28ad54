"""GpuCompute in-process on an NVIDIA GPU through CuPy (cupy-cuda13x).

Kernels are CUDA C compiled by NVRTC, or PTX / cubin / fatbin images. Look kernels up by the name
in the source, so declare them ``extern "C" __global__``: C++ kernels get mangled names (the
mangled name, as listed in ``Module.kernel_names``, works too).

The backend is composed of parts, one per concept, each holding the device state it works on: ``CudaDevice``
(``_cuda_device``: the context's state, streams, allocations, the device timer) is shared by ``CudaCopies``
(``_cuda_copies``: copies, memsets, host-memory pinning), ``CudaCode`` (``_cuda_modules``: module loading,
compilation and launches) and ``CudaPeer`` (``_cuda_peer``: copies from another device's worker). Memory, streams,
library operations, events and device time are here; device-time bookkeeping in ``_cuda_timing``, CuPy helpers in
``_cuda_util``.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import cupy
import numpy as np
from cupy.cuda import runtime
from cupy.cuda.memory import Memory

from gpubroker.broker.backends import _library
from gpubroker.broker.backends._common import HandleTable
from gpubroker.broker.backends._cuda_copies import CudaCopies
from gpubroker.broker.backends._cuda_device import CudaDevice
from gpubroker.broker.backends._cuda_modules import CudaCode
from gpubroker.broker.backends._cuda_peer import CudaPeer
from gpubroker.broker.backends._cuda_util import (
    list_cuda_devices,
    props_info,
    translate,
    use_kernel_cache_of_environment,
)
from gpubroker.broker.backends._torch import CudaPlacement, TorchAccounts, TorchCache, TorchPart, TorchSession
from gpubroker.wire.errors import Aborted, GpuBrokerError, InvalidArgument, ResourceExhausted
from gpubroker.wire.types import ArrayRef, Buffer, DeviceInfo, Event, Stream

__all__ = ["CudaBackend", "list_cuda_devices"]

log = logging.getLogger(__name__)

# Library calls take their temporaries (cuSOLVER / cuFFT workspaces, CuPy intermediates) from CuPy's pool, which
# the quota does not count (see _library). The pool keeps freed blocks for reuse; past this many idle bytes they
# go back to the device. Not after every call: cudaFree waits for the whole device, which would make each
# library call synchronous.
_POOL_IDLE_MAX = 256 << 20
# The matmuls that go straight to cuBLAS (CudaBackend._gemm), by dtype: their gemm, and (alpha, beta) = (1, 0) in
# host memory, which gemm reads during the call.
_GEMM: dict[str, tuple[str, np.ndarray[Any, Any]]] = {"float32": ("sgemm", np.array([1, 0], np.float32)),
                                                      "float64": ("dgemm", np.array([1, 0], np.float64))}
# Completion marks kept for reuse (a pacing worker has at most worker/_pacing.py's MAX_DEPTH pending).
_IDLE_MARKS = 16


class CudaBackend:
    """One CUDA device in this process. Launches and d2d copies / memsets are asynchronous.

    Kernels must be ``extern "C"`` (or looked up by mangled name). ``stream=None`` is the legacy
    default stream; streams from ``create_stream`` are non-blocking, so order work across them
    with ``synchronize``.
    """

    def __init__(self, device: int = 0) -> None:
        if not isinstance(device, (int, np.integer)) or isinstance(device, bool):
            raise InvalidArgument(f"device must be an int, got {device!r}")
        use_kernel_cache_of_environment()
        dev = self._dev = CudaDevice(int(device))
        copies = self._copies = CudaCopies(dev)
        code = self._code = CudaCode(dev)
        peer = self._peer = CudaPeer(dev)
        self._cuda_events: HandleTable[cupy.cuda.Event] = HandleTable("event")
        self._idle_marks: list[cupy.cuda.Event] = []  # completion marks waited for, for reuse
        self.allocated_bytes = 0
        self._torch_cache: TorchCache | None = None  # PyTorch's allocator, once a torch session used it
        self._cublas: Any = None  # cupy.cuda.cublas, imported at the first gemm
        # The parts' methods, bound once: a launch or a copy calls the part's method with no forwarding frame.
        self.synchronize = dev.synchronize
        self.copy_h2d = copies.copy_h2d
        self.copy_d2h = copies.copy_d2h
        self.copy_d2d = copies.copy_d2d
        self.memset = copies.memset
        self.register_host_memory = copies.register_host_memory
        self.unregister_host_memory = copies.unregister_host_memory
        self.pinned_buffer = copies.pinned_buffer
        self.copy_registered = copies.copy_registered
        self.compile_kernel = code.compile_kernel
        self.load_module = code.load_module
        self.get_kernel = code.get_kernel
        self.unload_module = code.unload_module
        self.execute_kernel = code.execute_kernel
        self.prepare_launch = code.prepare_launch
        self.launch_prepared = code.launch_prepared
        self.export_peer = peer.export_peer
        self.open_peer = peer.open_peer
        self.copy_from_peer = peer.copy_from_peer
        self.close_peer = peer.close_peer
        self._timer = dev.timer  # the device's, which the device-time methods below (and the tests) read
        torch = self._torch = TorchPart(self.torch_session)
        self.torch_op = torch.torch_op
        self.torch_op_sync = torch.torch_op_sync
        self.torch_from_buffer = torch.torch_from_buffer
        self.torch_to_buffer = torch.torch_to_buffer
        self.torch_read = torch.torch_read
        self.torch_free = torch.torch_free
        self.torch_seed = torch.torch_seed

    # -- lifecycle ---------------------------------------------------------------------------
    def initialize(self) -> None:
        self._dev.open()

    def __enter__(self) -> CudaBackend:
        self.initialize()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Wait for the device, then free everything. Never raises; idempotent."""
        dev = self._dev
        if dev.closed:
            return
        dev.closed = True
        if not dev.opened:
            return
        if dev.fatal is None:
            self._torch.close()
        if dev.fatal is None:
            try:
                runtime.setDevice(dev.index)
                self._timer.flush()  # end marks before the wait, so the wait is not charged
                runtime.deviceSynchronize()
            except Exception as exc:
                err = translate("close", exc)
                log.warning("error surfaced while closing the CUDA backend: %s", err.message)
                if isinstance(err, Aborted):
                    dev.fatal = err
        if dev.fatal is None:
            self._timer.settle()  # the work is done: a take after close still charges it
        else:
            self._timer.abandon()
        tables = (self._cuda_events, self._code.kernels, self._code.modules, dev.streams, dev.buffers)
        for table in tables:
            for handle in table.handles():
                obj = table.pop(handle)
                if dev.fatal is not None:
                    # Leak on purpose: in a poisoned context each destructor (cudaFree, cuModuleUnload)
                    # would only print a CUDA error, and the worker exits right after this anyway.
                    ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))
        self.allocated_bytes = 0

    def device_info(self) -> DeviceInfo:
        self._dev.use()
        try:
            info, _ = props_info(self._dev.index, runtime.memGetInfo()[0])
        except Exception as exc:
            raise self._dev.fail("device_info", exc) from exc
        return info

    # -- memory ------------------------------------------------------------------------------
    def allocate_memory(self, size: int) -> Buffer:
        self._dev.use()
        if not isinstance(size, (int, np.integer)) or isinstance(size, bool) or size <= 0:
            raise InvalidArgument(f"allocation size must be a positive int, got {size!r}")
        size = int(size)
        total = self._dev.info.total_memory
        if size > total:
            raise ResourceExhausted(f"{size} bytes is more than the device's {total}")
        torch_cache = self._torch_cache
        if torch_cache is not None:
            torch_cache.make_room()  # (what tensors freed, PyTorch's allocator keeps: within the bound together)
        try:
            mem = Memory(size)  # plain cudaMalloc, not CuPy's pool: exact accounting, real frees
        except Exception as exc:
            raise self._dev.fail(f"allocate {size} bytes", exc) from exc
        self.allocated_bytes += size
        if torch_cache is not None:
            torch_cache.others(self.allocated_bytes)
        return Buffer(self._dev.buffers.add(mem), size)

    def free_memory(self, buf: Buffer) -> None:
        self._dev.use()
        self._dev.resolve(buf)
        # Dropping the last reference calls cudaFree, which also waits for work that may use it.
        self.allocated_bytes -= self._dev.buffers.pop(buf.handle).size
        if self._torch_cache is not None:
            self._torch_cache.others(self.allocated_bytes)

    # -- streams -----------------------------------------------------------------------------
    def create_stream(self) -> Stream:
        self._dev.use()
        try:
            s = cupy.cuda.Stream(non_blocking=True)
        except Exception as exc:
            raise self._dev.fail("create_stream", exc) from exc
        return Stream(self._dev.streams.add(s))

    def destroy_stream(self, stream: Stream) -> None:
        self._dev.use()
        s = self._dev.stream(stream)
        if s is self._dev.null:
            raise InvalidArgument("cannot destroy the default stream")
        timer = self._timer
        try:
            with timer.lock:
                waited = timer.close_for_sync(s.ptr)  # its pointer may be reused by a later stream
            timer.wait(waited, s.synchronize)  # (its work done: the stream counts as unfinished no more)
        except Exception as exc:
            raise self._dev.fail("destroy_stream", exc) from exc
        self._dev.streams.pop(stream.handle)

    # -- the torch device --------------------------------------------------------------------
    def torch_session(self, accounts: TorchAccounts | None = None) -> TorchSession:
        """A new torch session on this device (the worker makes one per session; ``torch_*`` use their own):
        CUDA tensors on this device, each operator on the session's stream, timed as device time."""
        self._dev.use()
        if self._torch_cache is None:
            self._torch_cache = TorchCache(self._dev.index, self._dev.info.total_memory, self.allocated_bytes)
        return TorchSession(CudaPlacement(self._dev, self._torch_cache), accounts)

    # -- library operations ------------------------------------------------------------------
    def run_library(self, op: str, inputs: Sequence[ArrayRef], outputs: Sequence[ArrayRef],
                    params: Mapping[str, object] | None = None, stream: Stream | None = None) -> None:
        """cuBLAS, cuSOLVER, cuFFT and CuPy's sorts on the stream's queue, through CuPy arrays over the buffers.
        Asynchronous, except the ops whose result size depends on the data (unique, nonzero, compress), which
        wait to check it."""
        self._dev.use()
        ins, outs, checked = _library.check_library_call(op, inputs, outputs, params,
                                                         lambda buf: self._dev.resolve(buf)[1])
        s = self._dev.stream(stream)
        timer = self._timer
        try:
            gemm = _GEMM.get(outs[0].dtype) if op == "matmul" else None
            if (gemm is not None and len(ins[0].shape) == 2 and len(ins[1].shape) == 2 and ins[0].dtype
                    == ins[1].dtype == outs[0].dtype and all(ins[0].shape) and all(ins[1].shape)):
                with timer.lock:
                    timer.begin(s.ptr)
                    self._gemm(gemm, ins[0], ins[1], outs[0], s.ptr)
                return
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
            raise self._dev.fail(f"run_library of {op!r}", exc) from exc

    def _gemm(self, gemm: tuple[str, np.ndarray[Any, Any]], a: ArrayRef, b: ArrayRef, c: ArrayRef,
              stream_ptr: int) -> None:
        """``c = a @ b`` of 2-D row-major arrays straight through cuBLAS's gemm: a matmul's host cost without
        CuPy's arrays and dispatch (the library call's whole cost on the worker, for a 1024^2 one on an H200 about
        twice the GPU's). Row-major C = A B is column-major C^T = B^T A^T: gemm(n, m, k) of B then A, leading
        dimensions n, k, n. Full precision, as CuPy's matmul (no TF32)."""
        if self._cublas is None:  # (here: a worker that never multiplies never loads cuBLAS for it)
            from cupy.cuda import cublas as module
            self._cublas = module
        cublas = self._cublas
        (m, k), n = a.shape, b.shape[1]
        ptrs = []
        for ref in (a, b, c):
            mem, view = self._dev.resolve(ref.buffer)
            ptrs.append(mem.ptr + view.offset)
        name, scalars = gemm
        handle = cupy.cuda.device.get_cublas_handle()
        cublas.setPointerMode(handle, cublas.CUBLAS_POINTER_MODE_HOST)
        cublas.setStream(handle, stream_ptr)
        one = scalars.ctypes.data
        getattr(cublas, name)(handle, cublas.CUBLAS_OP_N, cublas.CUBLAS_OP_N, n, m, k, one, ptrs[1], n, ptrs[0], k,
                              one + scalars.itemsize, ptrs[2], n)

    def _cupy_array(self, ref: ArrayRef) -> Any:
        """A CuPy array over the buffer (no copy); it holds the allocation while CuPy uses it."""
        mem, view = self._dev.resolve(ref.buffer)
        return cupy.ndarray(ref.shape, dtype=ref.dtype, memptr=cupy.cuda.MemoryPointer(mem, view.offset))

    # -- events ------------------------------------------------------------------------------
    def _event(self, event: Event) -> cupy.cuda.Event:
        if not isinstance(event, Event):
            raise InvalidArgument(f"expected an Event, got {type(event).__name__}")
        return self._cuda_events.get(event.handle)

    def create_event(self) -> Event:
        self._dev.use()
        try:
            ev = cupy.cuda.Event(disable_timing=True)  # ordering only: a timing event costs more to record
        except Exception as exc:
            raise self._dev.fail("create_event", exc) from exc
        return Event(self._cuda_events.add(ev))

    def record_event(self, event: Event, stream: Stream | None = None) -> None:
        self._dev.use()
        ev, s = self._event(event), self._dev.stream(stream)
        try:
            ev.record(s)
        except Exception as exc:
            raise self._dev.fail("record_event", exc) from exc

    def wait_event(self, event: Event, stream: Stream | None = None) -> None:
        """The stream waits on the GPU (cudaStreamWaitEvent); an event never recorded is complete."""
        self._dev.use()
        ev, s = self._event(event), self._dev.stream(stream)
        try:
            s.wait_event(ev)
        except Exception as exc:
            raise self._dev.fail("wait_event", exc) from exc

    def synchronize_event(self, event: Event) -> None:
        self._dev.use()
        ev = self._event(event)
        try:
            with self._timer.lock:
                self._timer.close(None)  # the host waits now: end the segments first, as synchronize does
            ev.synchronize()
        except Exception as exc:
            raise self._dev.fail("synchronize_event", exc) from exc

    def destroy_event(self, event: Event) -> None:
        self._dev.use()
        self._event(event)
        self._cuda_events.pop(event.handle)  # cudaEventDestroy defers until a pending record completes

    # -- completion marks (the worker's pacing: worker/_pacing.py) -------------------------------
    def mark(self, stream: Stream | None) -> cupy.cuda.Event:
        """An event recorded on the stream after the work issued on it so far: no timing (a timing event between
        two kernels drains the GPU's queue, see _cuda_timing), no blocking sync (a wait spins: a host wake-up
        would be a gap between two paced kernels)."""
        self._dev.use()
        s = self._dev.stream(stream)
        try:
            event = self._idle_marks.pop() if self._idle_marks else cupy.cuda.Event(disable_timing=True)
            event.record(s)
        except Exception as exc:
            raise self._dev.fail("record a completion mark", exc) from exc
        return event

    def wait_mark(self, mark: object) -> bool:
        """Wait until a mark's work is done (the mark is then reused); whether it was unfinished."""
        if not isinstance(mark, cupy.cuda.Event):
            raise InvalidArgument(f"expected a mark of this backend's, got {type(mark).__name__}")
        try:
            waited = not mark.done
            if waited:
                mark.synchronize()
        except Exception as exc:
            raise self._dev.fail("wait for a completion mark", exc) from exc
        if len(self._idle_marks) < _IDLE_MARKS:
            self._idle_marks.append(mark)
        return waited

    # -- device-time accounting --------------------------------------------------------------
    def device_time_open(self) -> bool:
        """Whether a device-time segment is open (commands issued since the last end mark)."""
        return self._timer.busy

    def context_lost(self) -> bool:
        """Whether an earlier error left the CUDA context unusable (a device-side assert, an illegal address): every
        later call fails, so the worker exits and the tenant's next session gets a fresh context. Found by any call,
        also by the scheduler's device-time wait, whose error no command reports."""
        return self._dev.fatal is not None

    def anchor_device_time(self) -> None:
        """The host has a moment (the worker answered a batch; its client is reading the answer): if none of the
        device's work is unfinished, record the next segment's start mark now, so the next command does not pay
        for it (_cuda_timing). Never raises: a failure here shows at the next command."""
        dev = self._dev
        if dev.fatal is None and dev.opened and not dev.closed:
            try:
                if runtime.getDevice() != dev.index:
                    runtime.setDevice(dev.index)
                self._timer.anchor()
            except Exception:
                pass

    def flush_device_time(self) -> None:
        """End the open device-time segments: the worker calls this when it is about to wait for input, so the
        time the host then spends idle (waiting for the next batch) is not charged. Never raises."""
        dev = self._dev
        if dev.fatal is None and dev.opened and not dev.closed:
            self._timer.flush()

    def take_device_time(self) -> float:
        """Wait for all queued work, then return the device seconds spent by commands issued since the last
        call (kernels, copies, memsets, d2d), and reset the tally.

        Each stream's run of commands (up to a batch end, synchronize or take) is bracketed by a pair of CUDA
        events, so this is GPU time, not host time; streams that overlapped each count in full. Idle gaps
        inside a run count too, and a run that a synchronize ends, begun with none of the device's work
        unfinished, counts its host wall time up to the synchronize's return, without events (see
        _cuda_timing). Never raises: it is 0.0 before initialize and after a fatal error (the context can no
        longer tell).
        """
        dev = self._dev
        if dev.fatal is not None:
            self._timer.abandon()
            return 0.0
        if dev.opened and not dev.closed:
            try:  # take records the end marks: our device must be current (the caller's thread may differ)
                if runtime.getDevice() != dev.index:
                    runtime.setDevice(dev.index)
            except Exception:
                pass  # the wait below reports it
        pairs, total, streams = self._timer.take()
        if not pairs:
            return total  # nothing unread (close() waited and folded everything into the total)
        try:
            if runtime.getDevice() != dev.index:
                runtime.setDevice(dev.index)
            runtime.deviceSynchronize()
            self._timer.finished(streams)  # (the device is quiet again: a fence's wait counts as a synchronize)
        except Exception as exc:
            err = self._dev.fail("take_device_time", exc)
            if dev.fatal is not None:
                self._timer.abandon(pairs)
                return 0.0
            # Not the scheduler's error: the tenant's next synchronize reports it.
            dev.defer(err)
            return total + self._timer.settle_pairs(pairs, completed_only=True)
        return total + self._timer.settle_pairs(pairs)
