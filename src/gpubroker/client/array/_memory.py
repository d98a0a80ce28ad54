"""A session's device memory as the namespace keeps it: allocations shared by views, and a pool of dead ones.

An array's bytes live in a ``Storage`` (one device allocation) shared by every view of it. When the last array
holding a Storage dies, its finalizer only appends the buffer to the pool's list of dead buffers (a finalizer may
run inside any call, on any thread: it must never call the device); the next allocation takes dead buffers of a
fitting size for reuse; the pool keeps the buffers that died last, up to its bound, and queues a free for those it
has kept longest. Frees and allocations are commands like launches: on a RemoteGpu with ``async_commands`` they
queue without a round trip.
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from typing import Any

import numpy as np

from gpubroker.client import Buffer, GpuCompute
from gpubroker.client.array._views import View, contiguous_strides

__all__ = ["POOL_MAX", "Memory", "Storage"]

# A pool keeps dead buffers for reuse up to this many bytes, and at most a quarter of the tenant's memory quota:
# pooled buffers still count toward the quota (as CuPy's pool's do), so a tight quota must not fill up with them.
# ``Memory.release`` frees them. Room for a few results of a large loop at once: at 256 MiB, two 128 MiB results of
# one loop (8192 x 4096 float32) filled it, and the next loop's first small result freed one of them, a cudaFree
# that unmaps it and slows the launches after it (measured on an H200: ~0.4 ms of an otherwise 1.7 ms loop).
# CuPy's and PyTorch's pools keep everything; this stays bounded.
POOL_MAX = 2 * 1024 * 1024 * 1024
_ALIGN = 256  # sizes are rounded up to this, so near sizes share pooled buffers


class Storage:
    """One device allocation; arrays share it by reference. Its death queues the buffer for reuse or a free."""

    __slots__ = ("_dead", "buffer", "nbytes")

    def __init__(self, memory: Memory, buffer: Buffer, nbytes: int) -> None:
        self._dead = memory._dead
        self.buffer = buffer
        self.nbytes = nbytes

    def __del__(self) -> None:
        # (not weakref.finalize: it costs 3 us to register, on every array an operation returns)
        self._dead.append(self.buffer)


class Memory:
    """The allocations of one session (one namespace) and the pool of its dead ones."""

    def __init__(self, gpu: GpuCompute, memory_quota: int | None) -> None:
        self._gpu = gpu
        self._dead: deque[Buffer] = deque()  # appended by finalizers (any thread), drained by allocate
        self._pool: dict[int, list[Buffer]] = {}
        self._ages: OrderedDict[int, Buffer] = OrderedDict()  # the pooled buffers by id, the longest pooled first
        self._pooled = 0
        self._pool_max = POOL_MAX if memory_quota is None else min(POOL_MAX, memory_quota // 4)
        self._lock = threading.Lock()

    def allocate(self, nbytes: int) -> Storage:
        """A Storage of at least ``nbytes`` (one byte for an empty array: every array has a buffer)."""
        size = max(_ALIGN, -(-nbytes // _ALIGN) * _ALIGN)
        with self._lock:
            self._collect()
            free = self._pool.get(size)
            if free:
                buf = free.pop()
                del self._ages[id(buf)]
                self._pooled -= size
                return Storage(self, buf, size)
        return Storage(self, self._gpu.allocate_memory(size), size)

    def _collect(self) -> None:
        """Dead buffers into the pool; past its bound, the buffers pooled longest are freed to make room (the
        caller holds the lock). A pool full of one size (a loop's 128 MiB results) must not refuse the next loop's
        sizes: each of its results would be a new allocation and a free, and a free waits for the device (cudaFree)."""
        while self._dead:
            buf = self._dead.popleft()
            if buf.size > self._pool_max:
                self._gpu.free_memory(buf)
                continue
            self._pool.setdefault(buf.size, []).append(buf)
            self._ages[id(buf)] = buf
            self._pooled += buf.size
            while self._pooled > self._pool_max:
                _, old = self._ages.popitem(last=False)
                self._pool[old.size].remove(old)
                self._pooled -= old.size
                self._gpu.free_memory(old)

    def release(self) -> None:
        """Free every pooled buffer now (memory of live arrays stays)."""
        with self._lock:
            self._collect()
            for bufs in self._pool.values():
                for buf in bufs:
                    self._gpu.free_memory(buf)
            self._pool.clear()
            self._ages.clear()
            self._pooled = 0

    def empty(self, shape: tuple[int, ...], dtype: np.dtype[Any]) -> tuple[Storage, View]:
        """Fresh contiguous memory for ``shape`` of ``dtype`` (contents undefined)."""
        n = 1
        for s in shape:
            n *= s
        storage = self.allocate(n * dtype.itemsize)
        return storage, View(storage.buffer, dtype, shape, contiguous_strides(shape), 0)
