"""GpuCompute in-process on an NVIDIA GPU through CuPy (cupy-cuda13x).

Kernels are CUDA C compiled by NVRTC, or PTX / cubin / fatbin images. Look kernels up by the name
in the source, so declare them ``extern "C" __global__``: C++ kernels get mangled names (the
mangled name, as listed in ``Module.kernel_names``, works too).
"""

from __future__ import annotations

import ctypes
import logging
import threading
from collections.abc import Sequence

import cupy
import numpy as np
from cupy.cuda import driver, function, runtime
from cupy.cuda.memory import Memory, MemoryPointer

from gpubroker.client import (
    Aborted,
    Buffer,
    CompileError,
    DeviceInfo,
    FailedPrecondition,
    GpuBrokerError,
    InvalidArgument,
    Kernel,
    Module,
    ModuleFormat,
    NotFound,
    ResourceExhausted,
    Stream,
)
from gpubroker.client._host import HostBuffer, check_device_range, readable_bytes, writable_bytes

from ._common import HandleTable, LaunchChecker
from ._cuda_driver import driver_extras
from ._cuda_timing import DeviceTimer
from ._cuda_util import (
    BAD_IMAGE,
    KernelRec,
    ModuleRec,
    as_source,
    check_params,
    compile_module,
    list_cuda_devices,
    make_kernel_rec,
    props_info,
    translate,
)

__all__ = ["CudaBackend", "list_cuda_devices"]

log = logging.getLogger(__name__)

_MAX_DYNAMIC_SHARED = driver.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES


class CudaBackend:
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
        tables = (self._kernels, self._modules, self._streams, self._buffers)
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

    def copy_h2d(self, src: HostBuffer, buf: Buffer, offset: int = 0, stream: Stream | None = None) -> None:
        self._use()
        view = readable_bytes(src)
        (mem, buf), s = self._resolve(buf), self._stream(stream)
        start = check_device_range(buf, offset, view.nbytes, "copy_h2d")
        if view.nbytes == 0:
            return
        host = np.frombuffer(view, dtype=np.uint8)  # no copy; only for its address
        timer = self._timer
        try:
            with timer.lock:
                timer.begin(s.ptr)
                runtime.memcpyAsync(mem.ptr + start, host.ctypes.data, view.nbytes, runtime.memcpyHostToDevice,
                                    s.ptr)
                timer.close(s.ptr)  # we wait next: the host's idle time must not count
            s.synchronize()  # the caller may reuse src as soon as we return
        except Exception as exc:
            raise self._fail("copy_h2d", exc) from exc

    def copy_d2h(self, buf: Buffer, dst: HostBuffer, offset: int = 0, stream: Stream | None = None) -> None:
        self._use()
        view = writable_bytes(dst)
        (mem, buf), s = self._resolve(buf), self._stream(stream)
        start = check_device_range(buf, offset, view.nbytes, "copy_d2h")
        if view.nbytes == 0:
            return
        host = np.frombuffer(view, dtype=np.uint8)
        timer = self._timer
        try:
            with timer.lock:
                timer.begin(s.ptr)
                runtime.memcpyAsync(host.ctypes.data, mem.ptr + start, view.nbytes, runtime.memcpyDeviceToHost,
                                    s.ptr)
                timer.close(s.ptr)
            s.synchronize()  # dst must hold the data when we return
        except Exception as exc:
            raise self._fail("copy_d2h", exc) from exc

    def register_host_memory(self, host: HostBuffer) -> int:
        """Page-lock a host range (a shared-memory segment) so copy_h2d / copy_d2h on views of it DMA directly.

        Returns the address to pass to unregister_host_memory, which must run before the range is unmapped.
        """
        self._use()
        view = readable_bytes(host)
        ptr, size = int(np.frombuffer(view, dtype=np.uint8).ctypes.data), view.nbytes  # its address; no copy
        view.release()  # a live export would keep the caller from unmapping it later
        try:
            runtime.hostRegister(ptr, size, 0)  # cudaHostRegisterDefault
        except Exception as exc:
            raise self._fail("register host memory", exc) from exc
        return ptr

    def unregister_host_memory(self, ptr: int) -> None:
        self._use()
        try:
            runtime.hostUnregister(ptr)
        except Exception as exc:
            raise self._fail("unregister host memory", exc) from exc

    def copy_d2d(self, src: Buffer, dst: Buffer, size: int, src_offset: int = 0, dst_offset: int = 0,
                 stream: Stream | None = None) -> None:
        self._use()
        (smem, src), (dmem, dst), s = self._resolve(src), self._resolve(dst), self._stream(stream)
        a = check_device_range(src, src_offset, size, "copy_d2d source")
        b = check_device_range(dst, dst_offset, size, "copy_d2d destination")
        if size == 0:
            return
        if src.handle == dst.handle and a < b + size and b < a + size:
            raise InvalidArgument("copy_d2d: source and destination ranges overlap")
        timer = self._timer
        try:
            with timer.lock:
                timer.begin(s.ptr)
                runtime.memcpyAsync(dmem.ptr + b, smem.ptr + a, size, runtime.memcpyDeviceToDevice, s.ptr)
        except Exception as exc:
            raise self._fail("copy_d2d", exc) from exc

    def memset(self, buf: Buffer, value: int, size: int | None = None, offset: int = 0,
               stream: Stream | None = None) -> None:
        self._use()
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or not 0 <= value <= 255:
            raise InvalidArgument(f"memset value must be a byte (0..255), got {value!r}")
        (mem, buf), s = self._resolve(buf), self._stream(stream)
        if size is None:
            size = max(0, buf.nbytes - offset) if isinstance(offset, int) else 0
        start = check_device_range(buf, offset, size, "memset")
        if size == 0:
            return
        timer = self._timer
        try:
            with timer.lock:
                timer.begin(s.ptr)
                runtime.memsetAsync(mem.ptr + start, int(value), size, s.ptr)
        except Exception as exc:
            raise self._fail("memset", exc) from exc

    # -- code --------------------------------------------------------------------------------
    def compile_kernel(self, source: str, name: str, options: Sequence[str] = ()) -> Kernel:
        """Compile CUDA C with NVRTC and return kernel ``name`` (declare it ``extern "C"``)."""
        self._use()
        if not isinstance(name, str) or not name:
            raise InvalidArgument(f"kernel name must be a non-empty str, got {name!r}")
        try:
            source = as_source(source)
            rec = make_kernel_rec(compile_module(source, options), name, None, source)
        except Exception as exc:
            raise self._fail(f"compile kernel {name!r}", exc) from exc
        return Kernel(self._kernels.add(rec), name)

    def load_module(self, image: str | bytes, format: ModuleFormat, options: Sequence[str] = ()) -> Module:
        """Load CUDA C (compiled; ``options`` go to NVRTC), PTX, cubin or fatbin."""
        self._use()
        if not isinstance(format, ModuleFormat) or format is ModuleFormat.OPENCL_C:
            raise InvalidArgument(f"the CUDA backend cannot load {format!r}")
        if not isinstance(image, (str, bytes, bytearray, memoryview)):
            raise InvalidArgument(f"module image must be str or bytes, got {type(image).__name__}")
        source = None
        try:
            if format is ModuleFormat.CUDA_C:
                source = as_source(image)
                mod = compile_module(source, options)
            else:
                data = image.encode() if isinstance(image, str) else bytes(image)
                if not data.strip(b"\0"):
                    raise InvalidArgument("empty module image")
                if format is ModuleFormat.PTX and not data.endswith(b"\0"):
                    data += b"\0"  # cuModuleLoadData reads PTX as a C string
                elif format is ModuleFormat.CUBIN and not data.startswith(b"\x7fELF"):
                    raise InvalidArgument("a CUBIN image must be an ELF file")
                mod = function.Module()
                mod.load(data)
        except Exception as exc:
            err = self._fail(f"load {format.name} module", exc)
            if format is ModuleFormat.PTX and err.details.get("cuda_error") in BAD_IMAGE:
                err = CompileError(err.message, log=err.message, cuda_error=err.details["cuda_error"])
            raise err from exc
        names = driver_extras().function_names(mod.ptr)
        return Module(self._modules.add(ModuleRec(mod, source)), names)

    def get_kernel(self, module: Module, name: str) -> Kernel:
        self._use()
        if not isinstance(module, Module):
            raise InvalidArgument(f"expected a Module, got {type(module).__name__}")
        rec = self._modules.get(module.handle)
        if not isinstance(name, str) or not name:
            raise InvalidArgument(f"kernel name must be a non-empty str, got {name!r}")
        if name not in rec.kernels:
            try:
                krec = make_kernel_rec(rec.module, name, module.handle, rec.source)
            except Exception as exc:
                raise self._fail(f"get kernel {name!r}", exc) from exc
            rec.kernels[name] = self._kernels.add(krec)
        return Kernel(rec.kernels[name], name)

    def unload_module(self, module: Module) -> None:
        """Unload a module; its kernels' handles become NOT_FOUND."""
        self._use()
        if not isinstance(module, Module):
            raise InvalidArgument(f"expected a Module, got {type(module).__name__}")
        rec = self._modules.get(module.handle)
        try:
            runtime.deviceSynchronize()  # no launch of its code may still be running
        except Exception as exc:
            raise self._fail("unload_module", exc) from exc
        self._modules.pop(module.handle)
        for handle in rec.kernels.values():
            self._kernels.pop(handle)

    # -- launch ------------------------------------------------------------------------------
    def execute_kernel(self, kernel: Kernel, grid: int | Sequence[int], block: int | Sequence[int],
                       args: Sequence[object], shared_mem: int = 0, stream: Stream | None = None) -> None:
        """Launch asynchronously; errors inside the kernel surface at the next synchronize."""
        self._use()
        if not isinstance(kernel, Kernel):
            raise InvalidArgument(f"expected a Kernel, got {type(kernel).__name__}")
        rec = self._kernels.get(kernel.handle)
        shape = self._checker.check(grid, block, args, shared_mem)
        # The kernel-specific checks read only the block, shared_mem and the arg types: a signature that
        # passed them once for this kernel skips them (bounded memo; failures are never stored).
        plan = (shape.block, shared_mem, shape.kinds)
        if plan not in rec.plans:
            threads = shape.block[0] * shape.block[1] * shape.block[2]
            if threads > rec.max_threads:
                raise InvalidArgument(f"kernel {rec.name!r} can run at most {rec.max_threads} threads per block "
                                      f"(its register use), not {threads}")
            if shared_mem > self._smem_optin:
                raise InvalidArgument(f"{shared_mem} bytes of dynamic shared memory exceeds the device's "
                                      f"{self._smem_optin} per block")
            if rec.params is not None:
                check_params(rec, shape.args)
            rec.plans.add(plan)
        s = self._stream(stream)
        cargs: list[object] = []
        for arg in shape.args:
            if isinstance(arg, Buffer):
                mem, view = self._resolve(arg)
                if view.offset > view.size:
                    raise InvalidArgument(f"view offset {view.offset} is past its {view.size}-byte allocation")
                cargs.append(MemoryPointer(mem, view.offset))
            else:
                cargs.append(arg)
        timer = self._timer
        try:
            if shared_mem > rec.dynamic_shared:  # above 48 KiB needs an explicit opt-in per function
                driver.funcSetAttribute(rec.func.ptr, _MAX_DYNAMIC_SHARED, shared_mem)
                rec.dynamic_shared = shared_mem
            with timer.lock:  # held until issued, so a concurrent take cannot close the segment in between
                timer.begin(s.ptr)  # a dict lookup unless this is the stream's first command of the segment
                rec.func(shape.grid, shape.block, tuple(cargs), shared_mem=shared_mem, stream=s)
        except Exception as exc:
            raise self._fail(f"launch {rec.name!r}", exc) from exc

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

    # -- device-time accounting --------------------------------------------------------------
    def flush_device_time(self) -> None:
        """End the open device-time segments: the worker calls this when a batch is issued, so the time the
        host then spends idle (waiting for the next batch) is not charged. Never raises."""
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
