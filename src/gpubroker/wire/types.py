"""Value types shared by every GpuCompute implementation."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gpubroker.wire.errors import ArgumentTypeError, InvalidArgument

__all__ = [
    "ArrayRef",
    "Buffer",
    "DeviceInfo",
    "Dim3",
    "Event",
    "Kernel",
    "KernelArg",
    "Module",
    "ModuleFormat",
    "Stream",
    "check_kernel_args",
    "device_info_from_report",
    "normalize_dims",
]

Dim3 = tuple[int, int, int]


class ModuleFormat(enum.Enum):
    """What ``load_module`` is given: source to compile or a binary image.

    A CUDA device loads `CUDA_C`, `PTX`, `CUBIN` and `FATBIN`; an OpenCL device loads `OPENCL_C` only
    (`device_info().backend` says which the device is).
    """

    CUDA_C = "cuda_c"
    """CUDA C++ source, compiled by NVRTC (kernels declared `extern "C"` keep their names)."""
    OPENCL_C = "opencl_c"
    """OpenCL C source, compiled by the device's OpenCL compiler."""
    PTX = "ptx"
    """PTX assembly (text), compiled for the device by the CUDA driver."""
    CUBIN = "cubin"
    """A CUDA binary (an ELF image) built for the device's architecture."""
    FATBIN = "fatbin"
    """A CUDA fat binary: cubins and PTX for several architectures."""


@dataclass(frozen=True)
class DeviceInfo:
    """What a device is and what it can do, read from the runtime.

    [`GpuCompute.device_info`][gpubroker.client.GpuCompute.device_info] and
    [`list_devices`][gpubroker.client.list_devices] return it. The last five fields are the broker's view for the
    calling tenant; in-process they are `None` (and `health_reason` empty).
    """

    id: int
    """The device's index: on a broker, the number clients pass as `device=`; in-process, the backend's."""
    name: str
    """The device's name as its runtime reports it."""
    vendor: str
    """The device's vendor."""
    backend: str  # "cuda" or "opencl"
    """`"cuda"` or `"opencl"`: which runtime drives it, and so which kernel language it compiles."""
    total_memory: int
    """Device memory in bytes."""
    free_memory: int
    """Device memory not allocated, in bytes: the CUDA runtime's figure; on OpenCL, the total less what the
    backend allocated."""
    multiprocessor_count: int
    """Streaming multiprocessors (CUDA) or compute units (OpenCL)."""
    clock_mhz: int
    """The core clock in MHz (OpenCL: the maximum clock)."""
    l2_cache_bytes: int
    """The L2 cache in bytes (OpenCL: the global memory cache)."""
    unified_memory: bool
    """Whether device and host can share memory: CUDA managed memory; on OpenCL, memory unified with the host
    (a CPU device, an integrated GPU) or fine-grained shared virtual memory."""
    max_threads_per_block: int
    """The most threads (work-items) one block may have: the product of `block`'s extents."""
    max_block_dims: Dim3
    """The largest `block` extent on each axis (x, y, z)."""
    max_grid_dims: Dim3
    """The largest `grid` extent on each axis (x, y, z)."""
    compute_capability: tuple[int, int] | None = None
    """(major, minor) on CUDA; None on OpenCL."""
    opencl_version: str | None = None
    """The device's OpenCL version string on OpenCL; None on CUDA."""
    driver_version: str = ""
    """The driver's version, as its runtime reports it."""
    # Filled in by the broker for a tenant's view; None in-process.
    memory_quota: int | None = None
    """The calling tenant's memory quota on this device, in bytes (broker only)."""
    memory_used: int | None = None
    """The device memory the calling tenant holds on this device, all its sessions together, in bytes."""
    memory_available: int | None = None
    """What the calling tenant may still allocate here: the quota's room, at most the device's free memory
    (`None` in a [`list_devices`][gpubroker.client.list_devices] answer, which does not ask the device)."""
    health: str | None = None  # "SERVING" or "NOT_SERVING" (new sessions)
    """`"SERVING"`, or `"NOT_SERVING"` while the device (or the whole broker, draining) refuses new sessions;
    sessions already open go on."""
    health_reason: str = ""
    """Why the device is not serving; empty while it serves."""
    sandbox: str | None = None
    """How the broker sandboxes the worker that runs the tenant's sessions here (`"namespaces+seccomp+cgroup"`,
    ...; broker only)."""


def _count(value: Any, what: str, high: int = 1 << 63) -> int:
    if type(value) is not int or not 0 <= value <= high:
        raise ValueError(f"{what} is not an integer in [0, {high}]")
    return value


def _text(value: Any, what: str, limit: int = 1024, empty: bool = True) -> str:
    if type(value) is not str or len(value) > limit or (not value and not empty):
        raise ValueError(f"{what} is not a string of at most {limit} characters")
    return value


def device_info_from_report(d: Any) -> DeviceInfo:
    """A DeviceInfo from its report as plain values (a DeviceInfoQuery's result, a worker's first words, the device
    probe's JSON), every field of the right type and range; ValueError naming the first that is not."""
    if type(d) is not dict:
        raise ValueError("device info that is not a map")
    fields: dict[str, Any] = {}
    for key in ("id", "total_memory", "free_memory", "multiprocessor_count", "clock_mhz", "l2_cache_bytes",
                "max_threads_per_block"):
        fields[key] = _count(d.get(key), f"device info {key}")
    for key in ("name", "vendor", "backend", "driver_version", "health_reason"):
        if key in d or key in ("name", "vendor", "backend"):
            fields[key] = _text(d.get(key), f"device info {key}")
    if type(d.get("unified_memory")) is not bool:
        raise ValueError("device info unified_memory is not a boolean")
    fields["unified_memory"] = d["unified_memory"]
    for key in ("max_block_dims", "max_grid_dims"):
        dims = d.get(key)
        # type() refuses subclasses; isinstance tells the type checker what passed
        if type(dims) not in (list, tuple) or not isinstance(dims, (list, tuple)) or len(dims) != 3:
            raise ValueError(f"device info {key} is not three integers")
        fields[key] = tuple(_count(v, f"device info {key}") for v in dims)
    cc = d.get("compute_capability")
    if cc is not None:
        if type(cc) not in (list, tuple) or not isinstance(cc, (list, tuple)) or len(cc) != 2:
            raise ValueError("device info compute_capability is not two integers")
        fields["compute_capability"] = tuple(_count(v, "device info compute_capability", 1000) for v in cc)
    version = d.get("opencl_version")
    if version is not None:
        fields["opencl_version"] = _text(version, "device info opencl_version")
    for key in ("memory_quota", "memory_used", "memory_available"):
        if d.get(key) is not None:
            fields[key] = _count(d[key], f"device info {key}")
    if d.get("health") is not None:
        fields["health"] = _text(d["health"], "device info health", limit=64, empty=False)
    return DeviceInfo(**fields)


@dataclass(frozen=True)
class Buffer:
    """Device memory. ``offset`` makes a view that starts inside the allocation.

    [`allocate_memory`][gpubroker.client.GpuCompute.allocate_memory] returns one (offset 0);
    [`at`][gpubroker.client.Buffer.at] makes views. A view is a plain value: it does not own the memory, and it
    is invalid once the allocation is freed or its session ends. Pass a view wherever a Buffer is taken: copies
    and memsets count their `offset` from the view's start, and a kernel argument gets a pointer to it.
    """

    handle: str
    """The allocation's name in its session (chosen by the client; meaningless in another session)."""
    size: int
    """The whole allocation's size in bytes (the same for every view of it)."""
    offset: int = 0
    """Where this view starts, in bytes from the allocation's start."""

    @property
    def nbytes(self) -> int:
        """Bytes from this view's start to the allocation's end."""
        return self.size - self.offset

    def at(self, offset: int) -> Buffer:
        """A view of this buffer starting ``offset`` bytes further in.

        On OpenCL, a view passed to a kernel must start at a multiple of the device's base-address alignment
        (128 bytes on PoCL); copies and memsets take any offset.

        Args:
            offset: Bytes past this view's start, from 0 to `nbytes`.

        Returns:
            A view of the same allocation.

        Raises:
            InvalidArgument: the new view would start before the allocation or past its end.
        """
        if offset < 0 or self.offset + offset > self.size:
            raise InvalidArgument(
                f"offset {offset} is outside the buffer ({self.nbytes} bytes from offset {self.offset})")
        return Buffer(self.handle, self.size, self.offset + offset)  # (dataclasses.replace costs 2 us more)


@dataclass(frozen=True)
class ArrayRef:
    """A C-contiguous array in device memory for a library operation (``GpuCompute.run_library``): ``shape``
    elements of ``dtype`` (a NumPy dtype name: "float32", "int64", "complex128", "bool", ...) laid out row-major
    from ``buffer``'s view offset. The worker checks it fits the buffer."""

    buffer: Buffer
    """The memory: the array starts at this view's offset."""
    dtype: str
    """The element type, a NumPy dtype name."""
    shape: tuple[int, ...]
    """The extent of each dimension; `()` for a single element."""


@dataclass(frozen=True)
class Module:
    """Loaded device code ([`load_module`][gpubroker.client.GpuCompute.load_module]); its kernels are taken with
    [`get_kernel`][gpubroker.client.GpuCompute.get_kernel]. It lives as long as its session."""

    handle: str
    """The module's name in its session."""
    kernel_names: tuple[str, ...] = field(default=())
    """The kernels the module defines, where the backend can list them."""


@dataclass(frozen=True)
class Kernel:
    """A kernel ready to launch with [`execute_kernel`][gpubroker.client.GpuCompute.execute_kernel]
    ([`compile_kernel`][gpubroker.client.GpuCompute.compile_kernel] and
    [`get_kernel`][gpubroker.client.GpuCompute.get_kernel] make them). It lives as long as its session."""

    handle: str
    """The kernel's name in its session."""
    name: str
    """The kernel's function name in the source."""


@dataclass(frozen=True)
class Stream:
    """A queue of device work that runs in order ([`create_stream`][gpubroker.client.GpuCompute.create_stream]).

    Work on different streams may overlap; order them with events
    ([`record_event`][gpubroker.client.GpuCompute.record_event] and
    [`wait_event`][gpubroker.client.GpuCompute.wait_event]). Pass `stream=None` for the default stream.
    """

    handle: str
    """The stream's name in its session."""


@dataclass(frozen=True)
class Event:
    """A point in a stream's work (``record_event``) that another stream or the host can wait for."""

    handle: str
    """The event's name in its session."""


KernelArg = Buffer | np.generic


def normalize_dims(value: int | Sequence[int], what: str) -> Dim3:
    """Turn an int or a 1-3 sequence into (x, y, z); every extent must be >= 1."""
    if type(value) is int and value >= 1:  # the common case, on every launch
        return (value, 1, 1)
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        dims = [int(value)]
    elif isinstance(value, Sequence) and not isinstance(value, (str, bytes)) and 1 <= len(value) <= 3:
        dims = []
        for v in value:
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool):
                raise InvalidArgument(f"{what} extents must be integers, got {v!r}")
            dims.append(int(v))
    else:
        raise InvalidArgument(f"{what} must be an int or a sequence of 1 to 3 ints, got {value!r}")
    if any(d < 1 for d in dims):
        raise InvalidArgument(f"{what} extents must be >= 1, got {tuple(dims)}")
    dims += [1] * (3 - len(dims))
    return (dims[0], dims[1], dims[2])


def check_kernel_args(args: Sequence[object]) -> list[KernelArg]:
    """Accept Buffers and numpy scalars; refuse bare Python numbers, whose width is ambiguous."""
    if isinstance(args, (str, bytes)) or not isinstance(args, Sequence):
        raise ArgumentTypeError(f"kernel args must be a sequence, got {type(args).__name__}")
    checked: list[KernelArg] = []
    for i, arg in enumerate(args):
        if isinstance(arg, Buffer) or (isinstance(arg, np.generic) and arg.dtype.kind in "iuf"):
            checked.append(arg)
        elif isinstance(arg, (bool, int, float)):
            raise ArgumentTypeError(
                f"kernel arg {i} is a bare Python {type(arg).__name__} ({arg!r}); "
                "pass a numpy scalar such as np.int32(...) or np.float32(...) so its width is explicit")
        else:
            raise ArgumentTypeError(
                f"kernel arg {i} has type {type(arg).__name__}; expected a Buffer or a numpy scalar")
    return checked
