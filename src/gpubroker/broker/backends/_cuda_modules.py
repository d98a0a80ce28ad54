"""The cuda backend's modules, kernels and launches: NVRTC compilation, PTX / cubin / fatbin loading,
kernel lookup and the launch itself.

``CudaCode`` is one part of ``CudaBackend`` (in ``_cuda``): it owns the module and kernel tables, and holds the
device state (``CudaDevice``) for its helpers (``use``, ``fail``, ``resolve``, ``stream``), its launch checker, its
shared-memory limit and its device timer.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

from cupy.cuda import driver, function, runtime
from cupy.cuda.memory import Memory

from gpubroker.broker.backends._common import HandleTable
from gpubroker.broker.backends._cuda_device import CudaDevice
from gpubroker.broker.backends._cuda_driver import driver_extras
from gpubroker.broker.backends._cuda_util import (
    BAD_IMAGE,
    KernelRec,
    ModuleRec,
    as_source,
    check_params,
    compile_module,
    make_kernel_rec,
)
from gpubroker.wire.errors import CompileError, InvalidArgument, NotFound
from gpubroker.wire.types import Buffer, Dim3, Kernel, KernelArg, Module, ModuleFormat, Stream

__all__ = ["CudaCode", "PreparedLaunch"]

_MAX_DYNAMIC_SHARED = driver.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
_DIMS_MAX = 16  # (grid, block, shared_mem) shapes remembered per prepared launch
_launch = driver.launchKernel  # cuLaunchKernel itself: CuPy's Function.__call__ re-converts every argument


class PreparedLaunch:
    """A kernel with its arguments, packed once for cuLaunchKernel, and the launch shapes that passed."""

    __slots__ = ("args", "dims", "func", "keep", "packed", "params", "rec")

    def __init__(self, rec: KernelRec, args: Sequence[object]) -> None:
        self.rec = rec
        self.func: int = rec.func.ptr
        self.args = args
        self.dims: dict[object, tuple[Dim3, Dim3]] = {}
        self.packed = False
        self.params = 0  # the address of the void* array; 0 for no arguments
        self.keep: object = None  # what the array points into (values, allocations): alive while this is


class CudaCode:
    """compile_kernel, load_module, get_kernel, unload_module and execute_kernel (and the worker's
    prepare_launch / launch_prepared) for ``CudaBackend``."""

    def __init__(self, device: CudaDevice) -> None:
        self._dev = device
        self._timer = device.timer
        self.modules: HandleTable[ModuleRec] = HandleTable("module")
        self.kernels: HandleTable[KernelRec] = HandleTable("kernel")

    # -- code --------------------------------------------------------------------------------
    def compile_kernel(self, source: str, name: str, options: Sequence[str] = ()) -> Kernel:
        """Compile CUDA C with NVRTC and return kernel ``name`` (declare it ``extern "C"``)."""
        self._dev.use()
        if not isinstance(name, str) or not name:
            raise InvalidArgument(f"kernel name must be a non-empty str, got {name!r}")
        try:
            source = as_source(source)
            rec = make_kernel_rec(compile_module(source, options), name, None, source)
        except Exception as exc:
            raise self._dev.fail(f"compile kernel {name!r}", exc) from exc
        return Kernel(self.kernels.add(rec), name)

    def load_module(self, image: str | bytes, format: ModuleFormat, options: Sequence[str] = ()) -> Module:
        """Load CUDA C (compiled; ``options`` go to NVRTC), PTX, cubin or fatbin."""
        self._dev.use()
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
            err = self._dev.fail(f"load {format.name} module", exc)
            if format is ModuleFormat.PTX and err.details.get("cuda_error") in BAD_IMAGE:
                err = CompileError(err.message, log=err.message, cuda_error=err.details["cuda_error"])
            raise err from exc
        names = driver_extras().function_names(mod.ptr)
        return Module(self.modules.add(ModuleRec(mod, source)), names)

    def get_kernel(self, module: Module, name: str) -> Kernel:
        self._dev.use()
        if not isinstance(module, Module):
            raise InvalidArgument(f"expected a Module, got {type(module).__name__}")
        rec = self.modules.get(module.handle)
        if not isinstance(name, str) or not name:
            raise InvalidArgument(f"kernel name must be a non-empty str, got {name!r}")
        if "\x00" in name:  # (the driver reads a C string: "vadd\0" would find vadd)
            raise NotFound(f"no kernel {name!r} in module {module.handle!r}: a kernel's name has no NUL character")
        if name not in rec.kernels:
            try:
                krec = make_kernel_rec(rec.module, name, module.handle, rec.source)
            except Exception as exc:
                raise self._dev.fail(f"get kernel {name!r}", exc) from exc
            rec.kernels[name] = self.kernels.add(krec)
        return Kernel(rec.kernels[name], name)

    def unload_module(self, module: Module) -> None:
        """Unload a module; its kernels' handles become NOT_FOUND."""
        self._dev.use()
        if not isinstance(module, Module):
            raise InvalidArgument(f"expected a Module, got {type(module).__name__}")
        rec = self.modules.get(module.handle)
        try:
            runtime.deviceSynchronize()  # no launch of its code may still be running
        except Exception as exc:
            raise self._dev.fail("unload_module", exc) from exc
        self.modules.pop(module.handle)
        for handle in rec.kernels.values():
            self.kernels.pop(handle)

    # -- launch ------------------------------------------------------------------------------
    def execute_kernel(self, kernel: Kernel, grid: int | Sequence[int], block: int | Sequence[int],
                       args: Sequence[object], shared_mem: int = 0, stream: Stream | None = None) -> None:
        """Launch asynchronously; errors inside the kernel surface at the next synchronize."""
        self.launch_prepared(self.prepare_launch(kernel, args), grid, block, shared_mem, stream)

    def prepare_launch(self, kernel: Kernel, args: Sequence[object]) -> PreparedLaunch:
        """A kernel and its arguments for ``launch_prepared``; checked and packed at its first launch.

        The worker keeps one per (kernel, arguments as sent) and drops it with any buffer or kernel it names.
        It holds the allocations it points into, so a stale one can never launch on freed memory.
        """
        self._dev.use()
        if not isinstance(kernel, Kernel):
            raise InvalidArgument(f"expected a Kernel, got {type(kernel).__name__}")
        return PreparedLaunch(self.kernels.get(kernel.handle), args)

    def launch_prepared(self, prep: PreparedLaunch, grid: int | Sequence[int], block: int | Sequence[int],
                        shared_mem: int = 0, stream: Stream | None = None) -> None:
        """Launch ``prep``: a (grid, block, shared_mem) it launched with before skips every check (they read
        nothing else), and its packed argument array goes straight to cuLaunchKernel."""
        self._dev.use()
        # Only exact tuples and ints (the protocol's types) are memo keys, so equal keys always check equally.
        key = (grid, block, shared_mem) if type(grid) is tuple and type(block) is tuple \
            and type(shared_mem) is int else None
        dims = prep.dims.get(key) if key is not None else None
        if dims is None:
            dims = self._admit(prep, grid, block, shared_mem)
            if key is not None:
                if len(prep.dims) >= _DIMS_MAX:
                    prep.dims.clear()
                prep.dims[key] = dims
        s = self._dev.stream(stream)
        g, b = dims
        timer = self._timer
        try:
            with timer.lock:  # held until issued, so a concurrent take cannot close the segment in between
                timer.begin(s.ptr)  # a dict lookup unless this is the stream's first command of the segment
                _launch(prep.func, g[0], g[1], g[2], b[0], b[1], b[2], shared_mem, s.ptr, prep.params, 0)
        except Exception as exc:
            raise self._dev.fail(f"launch {prep.rec.name!r}", exc) from exc

    def _admit(self, prep: PreparedLaunch, grid: int | Sequence[int], block: int | Sequence[int],
               shared_mem: int) -> tuple[Dim3, Dim3]:
        """Every check of a launch (the device's limits, then the kernel's), in the usual order; packs the
        arguments the first time."""
        rec = prep.rec
        shape = self._dev.checker.check(grid, block, prep.args, shared_mem)
        # The kernel-specific checks read only the block, shared_mem and the arg types: a signature that
        # passed them once for this kernel skips them (bounded memo; failures are never stored).
        plan = (shape.block, shared_mem, shape.kinds)
        if plan not in rec.plans:
            threads = shape.block[0] * shape.block[1] * shape.block[2]
            if threads > rec.max_threads:
                raise InvalidArgument(f"kernel {rec.name!r} can run at most {rec.max_threads} threads per block "
                                      f"(its register use), not {threads}")
            smem_optin = self._dev.smem_optin
            if shared_mem > smem_optin:
                raise InvalidArgument(f"{shared_mem} bytes of dynamic shared memory exceeds the device's "
                                      f"{smem_optin} per block")
            if rec.params is not None:
                check_params(rec, shape.args)
            rec.plans.add(plan)
        if not prep.packed:
            self._pack(prep, shape.args)
        if shared_mem > rec.dynamic_shared:  # above 48 KiB needs an explicit opt-in per function
            try:
                driver.funcSetAttribute(rec.func.ptr, _MAX_DYNAMIC_SHARED, shared_mem)
            except Exception as exc:
                raise self._dev.fail(f"launch {rec.name!r}", exc) from exc
            rec.dynamic_shared = shared_mem
        return shape.grid, shape.block

    def _pack(self, prep: PreparedLaunch, args: Sequence[KernelArg]) -> None:
        """cuLaunchKernel's ``void **kernelParams``: one pointer per argument into a block of value slots
        (device addresses of the buffer views, the numpy scalars' bytes)."""
        stride = max([8] + [-(-int(a.itemsize) // 8) * 8 for a in args if not isinstance(a, Buffer)])
        values = ctypes.create_string_buffer(stride * max(1, len(args)))
        base = ctypes.addressof(values)
        pointers = (ctypes.c_void_p * max(1, len(args)))()
        mems: list[Memory] = []
        for i, arg in enumerate(args):
            if isinstance(arg, Buffer):
                mem, view = self._dev.resolve(arg)
                if view.offset > view.size:
                    raise InvalidArgument(f"view offset {view.offset} is past its {view.size}-byte allocation")
                raw = (mem.ptr + view.offset).to_bytes(8, "little")
                mems.append(mem)
            else:
                raw = arg.tobytes()
            ctypes.memmove(base + i * stride, raw, len(raw))
            pointers[i] = base + i * stride
        prep.keep = (values, pointers, mems)
        prep.params = ctypes.addressof(pointers) if args else 0
        prep.packed = True
