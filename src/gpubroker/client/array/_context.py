"""What the namespace keeps per device session: the GpuCompute, its kernels, its memory, and the device object.

Memory: an array's bytes live in a ``Storage`` (one device allocation) shared by every view of it. When the last
array holding a Storage dies, its finalizer only appends the buffer to the context's list of dead buffers (a
finalizer may run inside any call, on any thread: it must never call the device); the next allocation takes dead
buffers of a fitting size for reuse (the pool), and queues a free for what the pool does not keep. Frees and
allocations are commands like launches: on a RemoteGpu with ``async_commands`` they queue without a round trip.
"""

from __future__ import annotations

import threading
import weakref
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from gpubroker.client import Buffer, GpuCompute

if TYPE_CHECKING:
    from gpubroker.client.array._kernels import Kernels

__all__ = ["Context", "Device", "Storage", "View"]

# A pool keeps dead buffers for reuse up to this many bytes, and at most a quarter of the tenant's memory quota:
# pooled buffers still count toward the quota (as CuPy's pool's do), so a tight quota must not fill up with them.
# ``Context.release_memory`` frees them.
POOL_MAX = 256 * 1024 * 1024
_ALIGN = 256  # sizes are rounded up to this, so near sizes share pooled buffers


@dataclass(frozen=True, slots=True)
class View:
    """A strided window on one allocation, as kernels and library operations take it.

    ``offset`` and ``strides`` count elements of ``dtype`` (a stride is 0 on a broadcast dimension, negative on a
    flipped one); element ``(i0, i1, ...)`` is at ``offset + i0 * strides[0] + i1 * strides[1] + ...``.
    """

    buffer: Buffer  # the whole allocation (offset 0)
    dtype: np.dtype[Any]
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    offset: int = 0

    @property
    def size(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def contiguous(self) -> bool:
        """C-contiguous: the elements are ``size`` consecutive ones from ``offset`` in row-major order."""
        expected = 1
        for extent, stride in zip(reversed(self.shape), reversed(self.strides), strict=True):
            if extent != 1 and stride != expected:
                return False
            expected *= extent
        return True


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides = []
    step = 1
    for extent in reversed(shape):
        strides.append(step)
        step *= max(extent, 1)
    return tuple(reversed(strides))


class Device:
    """The device a namespace's arrays live on (one GpuCompute session). Equal only to itself."""

    def __init__(self, ctx: Context) -> None:
        self._ctx = weakref.ref(ctx)
        self.name = ctx.info_name

    def __repr__(self) -> str:
        return f"Device({self.name!r})"


class Storage:
    """One device allocation; arrays share it by reference. Its death queues the buffer for reuse or a free."""

    __slots__ = ("__weakref__", "buffer", "nbytes")

    def __init__(self, ctx: Context, buffer: Buffer, nbytes: int) -> None:
        self.buffer = buffer
        self.nbytes = nbytes
        weakref.finalize(self, ctx._dead.append, buffer)


class Context:
    """One per namespace: the GpuCompute, the backend's name, the device, the kernel cache and the memory pool."""

    def __init__(self, gpu: GpuCompute) -> None:
        self.gpu = gpu
        info = gpu.device_info()
        self.backend: str = info.backend  # "cuda" or "opencl": which language kernels are generated in
        self.info_name = f"{info.backend}:{info.id} {info.name}"
        self.device = Device(self)
        self._dead: deque[Buffer] = deque()  # appended by finalizers (any thread), drained by allocate
        self._pool: dict[int, list[Buffer]] = {}
        self._pooled = 0
        self._pool_max = POOL_MAX if info.memory_quota is None else min(POOL_MAX, info.memory_quota // 4)
        self._lock = threading.Lock()
        from gpubroker.client.array._kernels import Kernels

        self.kernels: Kernels = Kernels(self)

    # -- memory ------------------------------------------------------------------------------------
    def allocate(self, nbytes: int) -> Storage:
        """A Storage of at least ``nbytes`` (one byte for an empty array: every array has a buffer)."""
        size = max(_ALIGN, -(-nbytes // _ALIGN) * _ALIGN)
        with self._lock:
            self._collect()
            free = self._pool.get(size)
            if free:
                self._pooled -= size
                return Storage(self, free.pop(), size)
        return Storage(self, self.gpu.allocate_memory(size), size)

    def _collect(self) -> None:
        """Dead buffers into the pool, or freed past its bound (the caller holds the lock)."""
        while self._dead:
            buf = self._dead.popleft()
            if self._pooled + buf.size <= self._pool_max:
                self._pool.setdefault(buf.size, []).append(buf)
                self._pooled += buf.size
            else:
                self.gpu.free_memory(buf)

    def release_memory(self) -> None:
        """Free every pooled buffer now (memory of live arrays stays)."""
        with self._lock:
            self._collect()
            for bufs in self._pool.values():
                for buf in bufs:
                    self.gpu.free_memory(buf)
            self._pool.clear()
            self._pooled = 0

    def empty(self, shape: tuple[int, ...], dtype: np.dtype[Any]) -> tuple[Storage, View]:
        """Fresh contiguous memory for ``shape`` of ``dtype`` (contents undefined)."""
        n = 1
        for s in shape:
            n *= s
        storage = self.allocate(n * dtype.itemsize)
        return storage, View(storage.buffer, dtype, shape, contiguous_strides(shape), 0)


def broadcast_shapes(*shapes: tuple[int, ...]) -> tuple[int, ...]:
    """The standard's broadcasting of shapes; ValueError naming them where they do not broadcast."""
    ndim = max((len(s) for s in shapes), default=0)
    out = [1] * ndim
    for shape in shapes:
        for i, extent in enumerate(shape, ndim - len(shape)):
            if extent == out[i] or extent == 1:
                continue
            if out[i] != 1:
                raise ValueError(f"shapes {', '.join(map(str, shapes))} do not broadcast")
            out[i] = extent
    return tuple(out)


def broadcast_view(view: View, shape: tuple[int, ...]) -> View:
    """``view`` broadcast to ``shape`` (stride 0 on the dimensions it repeats); ValueError if it cannot be."""
    lead = len(shape) - len(view.shape)
    if lead < 0:
        raise ValueError(f"cannot broadcast shape {view.shape} to {shape}")
    strides = [0] * lead
    for extent, have, stride in zip(shape[lead:], view.shape, view.strides, strict=True):
        if have == extent:
            strides.append(stride)
        elif have == 1:
            strides.append(0)
        else:
            raise ValueError(f"cannot broadcast shape {view.shape} to {shape}")
    return View(view.buffer, view.dtype, tuple(shape), tuple(strides), view.offset)
