"""Host-side buffers and the range checks every implementation applies the same way."""

from __future__ import annotations

import ctypes

import numpy as np

from gpubroker.wire.errors import InvalidArgument, OutOfRange
from gpubroker.wire.types import Buffer

__all__ = ["HostBuffer", "address_of", "check_device_range", "readable_bytes", "writable_bytes"]

# Anything with the buffer protocol (numpy arrays, bytes, bytearray, memoryview, mmap).
HostBuffer = bytes | bytearray | memoryview | np.ndarray
"""Host memory a copy reads or writes: any object with the buffer protocol, C-contiguous.

The type names the common ones (NumPy arrays, `bytes`, `bytearray`, `memoryview`); others with the protocol, such
as an `mmap` or an `array.array`, work too. [`copy_h2d`][gpubroker.client.GpuCompute.copy_h2d] reads all of it;
[`copy_d2h`][gpubroker.client.GpuCompute.copy_d2h] fills all of it, so it must be writable (not `bytes`). The
bytes are taken as they lie in memory, whatever the element type. An object without the protocol, or not
C-contiguous (a strided NumPy view), is refused with `InvalidArgument`: copy it with `numpy.ascontiguousarray`
first.
"""


def readable_bytes(src: object) -> memoryview:
    """A flat byte view of a C-contiguous buffer-protocol object, without copying."""
    try:
        view = memoryview(src)  # type: ignore[arg-type]  # any object: one without the protocol raises TypeError
    except TypeError:
        raise InvalidArgument(f"{type(src).__name__} does not support the buffer protocol") from None
    if not view.c_contiguous:
        raise InvalidArgument("host buffer must be C-contiguous")
    return view.cast("B") if view.ndim != 1 or view.format != "B" else view


def address_of(view: memoryview) -> int:
    """The address of a flat byte view's first byte (what a copy's DMA or a lookup of shared memory needs). A
    writable view's through ctypes (0.5 us), a read-only one's through numpy (ctypes maps only writable memory;
    numpy's ``ctypes.data`` takes ~3 us, more with the host's caches cold after a large copy)."""
    if not view.readonly and view.nbytes:
        return ctypes.addressof(ctypes.c_char.from_buffer(view))
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


def writable_bytes(dst: object) -> memoryview:
    view = readable_bytes(dst)
    if view.readonly:
        raise InvalidArgument("destination host buffer is read-only")
    return view


def check_device_range(buf: Buffer, offset: int, size: int, what: str = "copy") -> int:
    """Validate [offset, offset+size) against the view and return the absolute allocation offset."""
    if offset < 0:
        raise InvalidArgument(f"{what}: negative offset {offset}")
    if size < 0:
        raise InvalidArgument(f"{what}: negative size {size}")
    if buf.offset < 0 or buf.offset > buf.size:
        raise InvalidArgument(f"{what}: buffer view offset {buf.offset} is outside its {buf.size}-byte allocation")
    start = buf.offset + offset
    if start + size > buf.size:
        raise OutOfRange(
            f"{what}: {size} bytes at offset {offset} run past the end of the buffer "
            f"({buf.nbytes} bytes available from the view's start)")
    return start
