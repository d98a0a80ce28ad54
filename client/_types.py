"""Value types shared by every GpuCompute implementation."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from ._errors import ArgumentTypeError, InvalidArgument

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
    "normalize_dims",
]

Dim3 = tuple[int, int, int]


class ModuleFormat(enum.Enum):
    """What ``load_module`` is given: source to compile or a binary image."""

    CUDA_C = "cuda_c"
    OPENCL_C = "opencl_c"
    PTX = "ptx"
    CUBIN = "cubin"
    FATBIN = "fatbin"


@dataclass(frozen=True)
class DeviceInfo:
    """What a device is and what it can do, read from the runtime."""

    id: int
    name: str
    vendor: str
    backend: str  # "cuda" or "opencl"
    total_memory: int
    free_memory: int
    multiprocessor_count: int
    clock_mhz: int
    l2_cache_bytes: int
    unified_memory: bool
    max_threads_per_block: int
    max_block_dims: Dim3
    max_grid_dims: Dim3
    compute_capability: tuple[int, int] | None = None
    opencl_version: str | None = None
    driver_version: str = ""
    # Filled in by the broker for a tenant's view; None in-process.
    memory_quota: int | None = None
    memory_used: int | None = None
    memory_available: int | None = None
    health: str | None = None  # "SERVING" or "NOT_SERVING" (new sessions)
    health_reason: str = ""


@dataclass(frozen=True)
class Buffer:
    """Device memory. ``offset`` makes a view that starts inside the allocation."""

    handle: str
    size: int
    offset: int = 0

    @property
    def nbytes(self) -> int:
        """Bytes from this view's start to the allocation's end."""
        return self.size - self.offset

    def at(self, offset: int) -> Buffer:
        """A view of this buffer starting ``offset`` bytes further in."""
        if offset < 0 or self.offset + offset > self.size:
            raise InvalidArgument(
                f"offset {offset} is outside the buffer ({self.nbytes} bytes from offset {self.offset})")
        return replace(self, offset=self.offset + offset)


@dataclass(frozen=True)
class ArrayRef:
    """A C-contiguous array in device memory for a library operation (``GpuCompute.run_library``): ``shape``
    elements of ``dtype`` (a NumPy dtype name: "float32", "int64", "complex128", "bool", ...) laid out row-major
    from ``buffer``'s view offset. The worker checks it fits the buffer."""

    buffer: Buffer
    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class Module:
    handle: str
    kernel_names: tuple[str, ...] = field(default=())


@dataclass(frozen=True)
class Kernel:
    handle: str
    name: str


@dataclass(frozen=True)
class Stream:
    handle: str


@dataclass(frozen=True)
class Event:
    """A point in a stream's work (``record_event``) that another stream or the host can wait for."""

    handle: str


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
