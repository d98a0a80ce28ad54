"""The cuda backend's modules, kernels and launches: NVRTC compilation, PTX / cubin / fatbin loading,
kernel lookup and the launch itself.

A mixin of ``CudaBackend`` (in ``_cuda``), which owns the state these methods use: ``_use``, ``_fail``,
``_resolve``, ``_stream``, the handle tables, the launch checker, ``_smem_optin`` and the timer ``_timer``.
``_cuda_host`` declares them for the type checker.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from cupy.cuda import driver, function, runtime
from cupy.cuda.memory import MemoryPointer

from gpubroker.client import Buffer, CompileError, InvalidArgument, Kernel, Module, ModuleFormat, Stream

from ._cuda_driver import driver_extras
from ._cuda_util import BAD_IMAGE, ModuleRec, as_source, check_params, compile_module, make_kernel_rec

__all__ = ["CudaCodeMixin"]

if TYPE_CHECKING:
    from ._cuda_host import CudaHost
else:
    CudaHost = object  # the type checker's view of CudaBackend's members; a plain mixin at run time

_MAX_DYNAMIC_SHARED = driver.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES


class CudaCodeMixin(CudaHost):
    """compile_kernel, load_module, get_kernel, unload_module and execute_kernel for ``CudaBackend``."""

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
