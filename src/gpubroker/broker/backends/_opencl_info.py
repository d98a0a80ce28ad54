"""OpenCL helpers for the opencl backend: device discovery, error translation and kernel-argument checks.

Kept apart from ``_opencl`` so the backend class stays readable; nothing here holds device state.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import pyopencl as cl

from gpubroker.broker.backends._common import PlanMemo
from gpubroker.wire.errors import (
    ArgumentTypeError,
    CompileError,
    GpuBrokerError,
    Internal,
    InvalidArgument,
    ResourceExhausted,
)
from gpubroker.wire.types import Buffer, DeviceInfo, KernelArg

__all__ = [
    "ArgSpec",
    "KernelRec",
    "all_devices",
    "as_int",
    "build_program",
    "check_arg",
    "cl_errors",
    "describe_device",
    "list_opencl_devices",
    "read_arg_specs",
    "translate_cl_error",
]

# OpenCL caps grid extents only by size_t; CUDA-style callers expect a finite per-axis limit.
MAX_GRID_EXTENT = 2**31 - 1

# How much of a build log goes into a CompileError's message; the whole log is in its details.
_LOG_LINES_IN_MESSAGE = 12

# Status codes that mean "the device or host ran out of something", not "you asked for something wrong".
_EXHAUSTED = frozenset({"MEM_OBJECT_ALLOCATION_FAILURE", "OUT_OF_RESOURCES", "OUT_OF_HOST_MEMORY"})

# By-value OpenCL C scalar types: name -> (bytes, is floating point). None means "pointer-sized".
_SCALARS: dict[str, tuple[int | None, bool]] = {
    "char": (1, False),
    "uchar": (1, False),
    "signed char": (1, False),
    "unsigned char": (1, False),
    "short": (2, False),
    "ushort": (2, False),
    "unsigned short": (2, False),
    "int": (4, False),
    "uint": (4, False),
    "unsigned int": (4, False),
    "unsigned": (4, False),
    "long": (8, False),
    "ulong": (8, False),
    "unsigned long": (8, False),
    "half": (2, True),
    "float": (4, True),
    "double": (8, True),
    "size_t": (None, False),
    "ptrdiff_t": (None, False),
    "intptr_t": (None, False),
    "uintptr_t": (None, False),
}


def as_int(value: object, what: str) -> int:
    """An int (or numpy integer) as a Python int; bools and everything else are refused."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise InvalidArgument(f"{what} must be an int, got {value!r}")
    return int(value)


def translate_cl_error(exc: cl.Error, what: str) -> GpuBrokerError:
    """Map a pyopencl error onto the gpubroker hierarchy by its OpenCL status code."""
    code = getattr(exc, "code", None)
    try:
        # pyopencl's stub declares to_string inside an IntEnum, so mypy takes it for a member, not a method.
        name = cl.status_code.to_string(code) if isinstance(code, int) else "UNKNOWN"  # type: ignore[operator]
    except ValueError:
        name = f"status {code}"
    routine = getattr(exc, "routine", "") or "OpenCL"
    message = f"{what}: {routine} failed with {name}"
    if name in _EXHAUSTED:
        return ResourceExhausted(message, cl_status=name)
    if name.startswith("INVALID_"):
        return InvalidArgument(message, cl_status=name)
    return Internal(message, cl_status=name)


@contextlib.contextmanager
def cl_errors(what: str) -> Iterator[None]:
    """Re-raise any pyopencl error as a gpubroker error; raw pyopencl errors must never reach callers."""
    try:
        yield
    except cl.Error as exc:
        raise translate_cl_error(exc, what) from exc


def all_devices() -> list[cl.Device]:
    """Every OpenCL device, in platform order then device order (the backend's device numbering)."""
    try:
        platforms = cl.get_platforms()
    except cl.Error:
        # No ICD installed (CL_PLATFORM_NOT_FOUND_KHR): there are simply no devices.
        return []
    devices: list[cl.Device] = []
    for platform in platforms:
        try:
            devices.extend(platform.get_devices())
        except cl.Error:
            continue  # a platform with no devices reports DEVICE_NOT_FOUND; skip it
    return devices


def _unified_memory(device: cl.Device) -> bool:
    # host_unified_memory is deprecated since OpenCL 2.0; fall back to fine-grained SVM support.
    try:
        return bool(device.host_unified_memory)
    except (cl.Error, AttributeError):
        pass
    try:
        return bool(device.svm_capabilities & cl.device_svm_capabilities.FINE_GRAIN_BUFFER)
    except (cl.Error, AttributeError):
        return False


def describe_device(device: cl.Device, index: int, allocated: int = 0) -> DeviceInfo:
    """Real device properties; reading them needs no context."""
    with cl_errors("device_info"):
        sizes = list(device.max_work_item_sizes)[:3]
        sizes += [1] * (3 - len(sizes))
        total = int(device.global_mem_size)
        return DeviceInfo(
            id=index,
            name=device.name.strip(),
            vendor=device.vendor.strip(),
            backend="opencl",
            total_memory=total,
            # OpenCL has no free-memory query, so this counts only what this backend instance allocated.
            free_memory=max(total - allocated, 0),
            multiprocessor_count=int(device.max_compute_units),
            clock_mhz=int(device.max_clock_frequency),
            l2_cache_bytes=int(device.global_mem_cache_size),
            unified_memory=_unified_memory(device),
            max_threads_per_block=int(device.max_work_group_size),
            max_block_dims=(int(sizes[0]), int(sizes[1]), int(sizes[2])),
            max_grid_dims=(MAX_GRID_EXTENT,) * 3,
            compute_capability=None,
            opencl_version=device.version.strip(),
            driver_version=device.driver_version.strip(),
        )


def list_opencl_devices() -> list[DeviceInfo]:
    """All OpenCL devices numbered as ``OpenCLBackend(device=...)`` numbers them; creates no contexts."""
    return [describe_device(dev, i) for i, dev in enumerate(all_devices())]


@dataclass(frozen=True)
class ArgSpec:
    """One kernel parameter as the OpenCL arg-info query describes it."""

    index: int
    name: str
    type_name: str
    kind: Literal["buffer", "local", "scalar", "unsupported"]
    size: int = 0
    is_float: bool = False


def _normalize_type(type_name: str) -> str:
    words = [w for w in type_name.replace("\x00", "").split() if w not in ("const", "volatile", "restrict")]
    return " ".join(words)


def read_arg_specs(kernel: cl.Kernel, device: cl.Device) -> tuple[ArgSpec, ...]:
    """Classify every parameter; needs a program built with -cl-kernel-arg-info."""
    aq = cl.kernel_arg_address_qualifier
    info = cl.kernel_arg_info
    pointer_bytes = int(device.address_bits) // 8
    specs: list[ArgSpec] = []
    with cl_errors("reading kernel argument info"):
        for i in range(kernel.num_args):
            qualifier = kernel.get_arg_info(i, info.ADDRESS_QUALIFIER)
            type_name = _normalize_type(str(kernel.get_arg_info(i, info.TYPE_NAME)))
            name = str(kernel.get_arg_info(i, info.NAME))
            is_pointer = type_name.endswith("*")
            if qualifier in (aq.GLOBAL, aq.CONSTANT) and is_pointer:
                specs.append(ArgSpec(i, name, type_name, "buffer"))
            elif qualifier == aq.LOCAL and is_pointer:
                specs.append(ArgSpec(i, name, type_name, "local"))
            elif qualifier == aq.PRIVATE and type_name in _SCALARS:
                size, is_float = _SCALARS[type_name]
                specs.append(ArgSpec(i, name, type_name, "scalar", size or pointer_bytes, is_float))
            else:
                # Images, samplers, vectors, structs and typedef'd names: the runtime may not check their
                # size (PoCL does not), so a wrong value could corrupt memory. Refuse rather than guess.
                specs.append(ArgSpec(i, name, type_name, "unsupported"))
    return tuple(specs)


def check_arg(kernel_name: str, spec: ArgSpec, arg: KernelArg) -> None:
    """Refuse an argument that does not fit its parameter, before it reaches clSetKernelArg."""
    where = f"kernel {kernel_name!r} arg {spec.index} ({spec.type_name} {spec.name})"
    got = f"Buffer {arg.handle!r}" if isinstance(arg, Buffer) else f"np.{type(arg).__name__}"
    if spec.kind == "buffer":
        if not isinstance(arg, Buffer):
            raise ArgumentTypeError(f"{where}: expected a Buffer, got {got}", index=spec.index)
    elif spec.kind == "scalar":
        if isinstance(arg, Buffer):
            raise ArgumentTypeError(f"{where}: expected a {spec.type_name} numpy scalar, got {got}", index=spec.index)
        dtype = np.asarray(arg).dtype
        if dtype.itemsize != spec.size or (dtype.kind == "f") != spec.is_float:
            family = "floating-point" if spec.is_float else "integer"
            raise ArgumentTypeError(
                f"{where}: expected a {spec.size}-byte {family} numpy scalar, got {got} "
                f"({dtype.itemsize}-byte {'floating-point' if dtype.kind == 'f' else 'integer'})",
                index=spec.index,
            )
    elif spec.kind == "local":
        raise InvalidArgument(
            f"{where}: a __local pointer can only be the kernel's last parameter, filled by passing shared_mem > 0"
        )
    else:
        raise ArgumentTypeError(
            f"{where}: parameter type {spec.type_name!r} is not supported; by-value parameters must use "
            "built-in scalar types (no typedefs, vectors, structs, images or samplers)",
            index=spec.index,
        )


def build_program(
    context: cl.Context, device: cl.Device, source: str, options: Sequence[str]
) -> tuple[cl._cl._Program, tuple[str, ...]]:
    """Build OpenCL C for one device; a failed build raises CompileError carrying the full log."""
    if not source.strip():
        raise InvalidArgument("OpenCL C source is empty")
    if isinstance(options, str) or not all(isinstance(o, str) for o in options):
        raise InvalidArgument(f"options must be a sequence of strings, got {options!r}")
    # Arg info lets execute_kernel check every argument before it reaches clSetKernelArg.
    opts = " ".join([*options, "-cl-kernel-arg-info"]).encode()
    with cl_errors("building OpenCL program"):
        # The low-level program skips pyopencl's binary cache (a program loaded from a binary loses its
        # arg info), its temp-file dumps of failing sources and its compiler-output warnings.
        program = cl._cl._Program(context, source)
    try:
        program._build(options=opts, devices=[device])
    except cl.Error as exc:
        try:
            log = str(program.get_build_info(device, cl.program_build_info.LOG)).strip()
        except cl.Error:
            log = ""
        head = "\n".join(log.splitlines()[:_LOG_LINES_IN_MESSAGE])
        status = translate_cl_error(exc, "build").details.get("cl_status", "failed")
        raise CompileError(f"OpenCL build failed ({status}):\n{head or '(empty build log)'}", log=log) from None
    with cl_errors("reading program kernel names"):
        names = str(program.get_info(cl.program_info.KERNEL_NAMES))
    return program, tuple(n for n in names.split(";") if n)


@dataclass(frozen=True)
class KernelRec:
    """A kernel handle's state. Each handle gets its own cl.Kernel: a cl.Kernel holds its argument state."""

    kernel: cl.Kernel
    name: str
    module: str
    specs: tuple[ArgSpec, ...]
    max_group: int
    required_group: tuple[int, int, int] | None
    static_local: int
    # Launch signatures (block, shared_mem, arg types) that passed check_shape and the arg checks.
    plans: PlanMemo = field(default_factory=PlanMemo, compare=False, repr=False)

    @classmethod
    def create(cls, program: cl._cl._Program, name: str, module: str, device: cl.Device) -> KernelRec:
        kwg = cl.kernel_work_group_info
        with cl_errors(f"creating kernel {name!r}"):
            kernel = cl.Kernel(program, name)
            req = [int(v) for v in kernel.get_work_group_info(kwg.COMPILE_WORK_GROUP_SIZE, device)]
            return cls(
                kernel,
                name,
                module,
                read_arg_specs(kernel, device),
                max_group=int(kernel.get_work_group_info(kwg.WORK_GROUP_SIZE, device)),
                # reqd_work_group_size reads (0, 0, 0) when the kernel does not declare one.
                required_group=(req[0], req[1], req[2]) if any(req) else None,
                static_local=int(kernel.get_work_group_info(kwg.LOCAL_MEM_SIZE, device)),
            )

    def check_shape(self, block: tuple[int, int, int], shared_mem: int, local_mem_size: int) -> None:
        """Kernel-specific limits that check_launch (device-wide) cannot know."""
        threads = block[0] * block[1] * block[2]
        if threads > self.max_group:
            raise InvalidArgument(
                f"block of {threads} work-items exceeds kernel {self.name!r}'s limit of {self.max_group}"
            )
        if self.required_group is not None and block != self.required_group:
            raise InvalidArgument(
                f"kernel {self.name!r} declares reqd_work_group_size{self.required_group}; block is {block}"
            )
        if shared_mem:
            if not self.specs or self.specs[-1].kind != "local":
                raise InvalidArgument(
                    f"shared_mem={shared_mem} needs kernel {self.name!r}'s last parameter to be a __local pointer"
                )
            limit = local_mem_size - self.static_local
            if shared_mem > limit:
                raise InvalidArgument(
                    f"shared_mem={shared_mem} exceeds the {limit} bytes of local memory left for kernel {self.name!r}"
                )
