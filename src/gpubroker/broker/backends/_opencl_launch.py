"""The opencl backend's programs, kernels and launches: building OpenCL C, kernel lookup, argument binding.

``OpenCLCode`` is one part of ``OpenCLBackend`` (in ``_opencl``): it owns the module and kernel tables and the
sub-buffers of launches in flight, and holds the device state (``OpenCLDevice``: context, queues, allocations, lock,
launch checker) and the device-time accounting (``OpenCLTiming``) that every launch reports its event to.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import pyopencl as cl

from gpubroker.broker.backends._common import HandleTable, LaunchShape, source_text
from gpubroker.broker.backends._opencl_device import OpenCLDevice
from gpubroker.broker.backends._opencl_info import KernelRec, build_program, check_arg, cl_errors, translate_cl_error
from gpubroker.broker.backends._opencl_timing import OpenCLTiming
from gpubroker.wire.errors import InvalidArgument, NotFound
from gpubroker.wire.types import Buffer, Kernel, Module, ModuleFormat, Stream

__all__ = ["ModuleRec", "OpenCLCode"]


@dataclass
class ModuleRec:
    program: cl._cl._Program
    kernel_names: tuple[str, ...]
    kernels: set[str] = field(default_factory=set)


class OpenCLCode:
    """load_module, compile_kernel, get_kernel, unload_module and execute_kernel for ``OpenCLBackend``."""

    def __init__(self, device: OpenCLDevice, timing: OpenCLTiming) -> None:
        self._dev = device
        self._timing = timing
        self._lock = device.lock
        self._modules: HandleTable[ModuleRec] = HandleTable("mod")
        self._kernels: HandleTable[KernelRec] = HandleTable("kern")
        # Sub-buffers made for launches stay referenced until their launch completes.
        self._in_flight: list[tuple[cl.CommandQueue, cl.Event, list[cl.Buffer]]] = []

    def clear(self) -> None:
        """Drop every module, kernel and in-flight sub-buffer (the backend closes; its queues are finished)."""
        self._in_flight.clear()
        self._kernels = HandleTable("kern")
        self._modules = HandleTable("mod")

    def forget_queues(self, queues: list[cl.CommandQueue]) -> None:
        """Release the sub-buffers of launches on ``queues``, which have just finished. Hold the lock."""
        self._in_flight = [e for e in self._in_flight if not any(e[0] is q for q in queues)]

    def load_module(self, image: str | bytes, format: ModuleFormat, options: Sequence[str] = ()) -> Module:
        """Build OpenCL C source into a module; binary formats are CUDA-only."""
        self._dev.ready()
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
        handle = self._build(source_text(image, "OpenCL C"), options)
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
        context, device = self._dev.context, self._dev.device
        assert context is not None and device is not None  # set together with info: ready() passed
        program, kernel_names = build_program(context, device, source, options)
        with self._lock:
            return self._modules.add(ModuleRec(program, kernel_names))

    def get_kernel(self, module: Module, name: str) -> Kernel:
        """A fresh kernel object for ``name``; it belongs to ``module``."""
        self._dev.ready()
        if not isinstance(module, Module):
            raise InvalidArgument(f"expected a Module, got {type(module).__name__}")
        rec = self._modules.get(module.handle)
        if name not in rec.kernel_names:
            raise NotFound(
                f"kernel {name!r} is not in module {module.handle!r}; "
                f"it has: {', '.join(rec.kernel_names) or '(no kernels)'}"
            )
        device = self._dev.device
        assert device is not None  # set together with info, which ready() checked
        kernel_rec = KernelRec.create(rec.program, name, module.handle, device)
        with self._lock:
            handle = self._kernels.add(kernel_rec)
            rec.kernels.add(handle)
        return Kernel(handle, name)

    def unload_module(self, module: Module) -> None:
        """Drop a module and every kernel taken from it; launches already queued still run."""
        self._dev.ready()
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
        self._dev.ready()
        checker = self._dev.checker
        assert checker is not None
        shape = checker.check(grid, block, args, shared_mem)
        queue = self._dev.queue_for(stream)
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
            self._timing.track(event)

    def _check_plan(self, rec: KernelRec, shape: LaunchShape) -> None:
        """The checks that need the kernel: work-group limits, local memory, each arg against its parameter."""
        specs = rec.specs
        rec.check_shape(shape.block, shape.shared_mem, self._dev.local_mem)
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
        alloc, view = self._dev.resolve(arg)
        if view.offset == 0:
            return alloc.mem
        if not 0 < view.offset < view.size:
            raise InvalidArgument(
                f"kernel arg {index}: view offset {view.offset} leaves no bytes of its {view.size}-byte buffer"
            )
        align = self._dev.align
        if view.offset % align:
            raise InvalidArgument(
                f"kernel arg {index}: view offset {view.offset} is not a multiple of {align} bytes; "
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
