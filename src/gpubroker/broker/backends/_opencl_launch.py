"""The opencl backend's programs, kernels and launches: building OpenCL C, kernel lookup, argument binding.

A mixin of ``OpenCLBackend`` (in ``_opencl``), which owns the state these methods use: the handle tables,
the lock, the context and device, the launch checker and the in-flight sub-buffers.
``_opencl_host`` declares them for the type checker.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import pyopencl as cl

from gpubroker.broker.backends._common import LaunchShape
from gpubroker.broker.backends._opencl_info import KernelRec, build_program, check_arg, cl_errors, translate_cl_error
from gpubroker.wire.errors import InvalidArgument, NotFound
from gpubroker.wire.types import Buffer, Kernel, Module, ModuleFormat, Stream

__all__ = ["ModuleRec", "OpenCLCodeMixin"]

if TYPE_CHECKING:
    from gpubroker.broker.backends._opencl_host import OpenCLHost
else:
    OpenCLHost = object  # the type checker's view of OpenCLBackend's members; a plain mixin at run time


@dataclass
class ModuleRec:
    program: cl._cl._Program
    kernel_names: tuple[str, ...]
    kernels: set[str] = field(default_factory=set)


class OpenCLCodeMixin(OpenCLHost):
    """load_module, compile_kernel, get_kernel, unload_module and execute_kernel for ``OpenCLBackend``."""

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
        assert self._context is not None and self._device is not None  # set together with _info: _ready() passed
        program, kernel_names = build_program(self._context, self._device, source, options)
        with self._lock:
            return self._modules.add(ModuleRec(program, kernel_names))

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
        assert self._device is not None  # set together with _info, which _ready() checked
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
            values: list[cl.Buffer | np.generic | cl.LocalMemory] = [
                self._mem_arg(arg, i, subs) if isinstance(arg, Buffer) else arg for i, arg in enumerate(args_in)
            ]
            if shape.shared_mem:
                values.append(cl.LocalMemory(shape.shared_mem))
            kern = rec.kernel
            try:  # a plain try, not cl_errors(): no generator and no message built on the hot path
                for i, value in enumerate(values):
                    # pyopencl's stub leaves LocalMemory (how a __local parameter gets its size) out of KernelArg.
                    kern.set_arg(i, value)  # type: ignore[arg-type]
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
