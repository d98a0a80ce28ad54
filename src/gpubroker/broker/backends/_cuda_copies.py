"""The cuda backend's host<->device and device<->device copies, memsets, host-memory pinning and page-locked
buffers.

``CudaCopies`` is one part of ``CudaBackend`` (in ``_cuda``); it holds the device state (``CudaDevice``) for its
helpers (``use``, ``resolve``, ``stream``, ``fail``) and its device timer.
"""

from __future__ import annotations

import contextlib
import mmap
import weakref
from collections.abc import Callable

import numpy as np
from cupy.cuda import runtime

from gpubroker.broker.backends._cuda_device import CudaDevice
from gpubroker.wire.errors import GpuBrokerError, InvalidArgument
from gpubroker.wire.host import HostBuffer, address_of, check_device_range, readable_bytes, writable_bytes
from gpubroker.wire.types import Buffer, Stream

__all__ = ["PINNED_MIN", "CudaCopies"]

# Buffers smaller than this are plain memory: a copy of a few KiB is dominated by its call, not its DMA.
PINNED_MIN = 64 * 1024
# Page-locked blocks come in sizes of this many bytes (a 1 MiB chunk's frame, its few bytes of batch around it
# included, fits one size), and the pool keeps at most _PINNED_FREE_MAX bytes of free ones for reuse.
_PINNED_STEP = 64 * 1024
_PINNED_FREE_MAX = 16 << 20


class CudaCopies:
    """copy_h2d, copy_d2h, copy_registered, copy_d2d, memset, (un)register_host_memory and pinned_buffer for
    ``CudaBackend``."""

    def __init__(self, device: CudaDevice) -> None:
        self._dev = device
        self._timer = device.timer
        self._pinned = _PinnedPool(self.register_host_memory, self.unregister_host_memory)

    def copy_h2d(self, src: HostBuffer, buf: Buffer, offset: int = 0, stream: Stream | None = None) -> None:
        self._dev.use()
        view = readable_bytes(src)
        self._copy(address_of(view), view.nbytes, buf, offset, True, stream)  # (no copy of src: its address)

    def copy_d2h(self, buf: Buffer, dst: HostBuffer, offset: int = 0, stream: Stream | None = None) -> None:
        self._dev.use()
        view = writable_bytes(dst)
        self._copy(address_of(view), view.nbytes, buf, offset, False, stream)

    def copy_registered(self, host: int, size: int, buf: Buffer, offset: int, to_device: bool,
                        stream: Stream | None = None) -> None:
        """copy_h2d or copy_d2h of ``size`` bytes at ``host``, an address inside memory ``register_host_memory``
        page-locked (the worker's shared-memory segments: the caller checked the range against the mapping), with
        no view of it made: a 64 MiB copy of a segment on an H200 took 20-50 us longer made from a view of its
        mapping (the view, numpy's address of it) than from its address, and ~150 us with the host's caches cold
        from the copy before. One DMA, waited for, as copy_h2d and copy_d2h."""
        self._dev.use()
        self._copy(host, size, buf, offset, to_device, stream)

    def _copy(self, host: int, size: int, buf: Buffer, offset: int, to_device: bool, stream: Stream | None) -> None:
        """The DMA of copy_h2d, copy_d2h and copy_registered: ``size`` bytes between host address ``host`` and the
        view at ``offset``, waited for (the host memory is the caller's again when it returns: a source to reuse,
        a destination that holds the data)."""
        what = "copy_h2d" if to_device else "copy_d2h"
        (mem, buf), s = self._dev.resolve(buf), self._dev.stream(stream)
        start = check_device_range(buf, offset, size, what)
        if size == 0:
            return
        device = mem.ptr + start
        dst, src, kind = (device, host, runtime.memcpyHostToDevice) if to_device else \
            (host, device, runtime.memcpyDeviceToHost)
        timer = self._timer
        try:
            with timer.lock:
                timer.begin(s.ptr)
                runtime.memcpyAsync(dst, src, size, kind, s.ptr)
                waited = timer.close_for_sync(s.ptr)  # we wait next: the host's idle time must not count
            timer.wait(waited, s.synchronize)
        except Exception as exc:
            raise self._dev.fail(what, exc) from exc

    def register_host_memory(self, host: HostBuffer) -> int:
        """Page-lock a host range (a shared-memory segment) so copy_h2d / copy_d2h on views of it DMA directly.

        Returns the address to pass to unregister_host_memory, which must run before the range is unmapped.
        """
        self._dev.use()
        view = readable_bytes(host)
        ptr, size = address_of(view), view.nbytes  # (its address; no copy)
        view.release()  # a live export would keep the caller from unmapping it later
        try:
            runtime.hostRegister(ptr, size, 0)  # cudaHostRegisterDefault
        except Exception as exc:
            raise self._dev.fail("register host memory", exc) from exc
        return ptr

    def unregister_host_memory(self, ptr: int) -> None:
        self._dev.use()
        try:
            runtime.hostUnregister(ptr)
        except Exception as exc:
            raise self._dev.fail("unregister host memory", exc) from exc

    def pinned_buffer(self, size: int) -> bytearray | memoryview:
        """A host buffer of ``size`` bytes for a copy's data on its way (a link's frame, a Read's result): page-
        locked where it is at least PINNED_MIN, so the copy is one DMA rather than CUDA's own staging through a
        page-locked bounce buffer and a memcpy (a 1 MiB chunk to the host: ~120 us pageable, ~30 us page-locked
        on an H200). Plain memory where it is smaller, or where the host gives no page-locked memory now (the copy
        is only slower). Not zeroed: every byte is written before it is read."""
        if size < PINNED_MIN:
            return bytearray(size)
        return self._pinned.take(size)

    def copy_d2d(self, src: Buffer, dst: Buffer, size: int, src_offset: int = 0, dst_offset: int = 0,
                 stream: Stream | None = None) -> None:
        self._dev.use()
        (smem, src), (dmem, dst), s = self._dev.resolve(src), self._dev.resolve(dst), self._dev.stream(stream)
        a = check_device_range(src, src_offset, size, "copy_d2d source")
        b = check_device_range(dst, dst_offset, size, "copy_d2d destination")
        if size == 0:
            return
        if src.handle == dst.handle and a < b + size and b < a + size:
            raise InvalidArgument("copy_d2d: source and destination ranges overlap")
        timer = self._timer
        try:
            with timer.lock:
                timer.begin(s.ptr)
                runtime.memcpyAsync(dmem.ptr + b, smem.ptr + a, size, runtime.memcpyDeviceToDevice, s.ptr)
        except Exception as exc:
            raise self._dev.fail("copy_d2d", exc) from exc

    def memset(self, buf: Buffer, value: int, size: int | None = None, offset: int = 0,
               stream: Stream | None = None) -> None:
        self._dev.use()
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or not 0 <= value <= 255:
            raise InvalidArgument(f"memset value must be a byte (0..255), got {value!r}")
        (mem, buf), s = self._dev.resolve(buf), self._dev.stream(stream)
        if size is None:
            size = max(0, buf.nbytes - offset) if isinstance(offset, int) else 0
        start = check_device_range(buf, offset, size, "memset")
        if size == 0:
            return
        timer = self._timer
        try:
            with timer.lock:
                timer.begin(s.ptr)
                runtime.memsetAsync(mem.ptr + start, int(value), size, s.ptr)
        except Exception as exc:
            raise self._dev.fail("memset", exc) from exc


class _PinnedPool:
    """Page-locked host blocks for ``pinned_buffer``: anonymous memory of this process, registered with CUDA
    (cudaHostRegister, as the shared-memory segments are), so its pages are the worker's own, counted in its
    memory limit like any other; not cudaHostAlloc, whose pages the driver allocates. A block is handed out as a
    view of a numpy array over it, and comes back to the pool when that array goes, that is with the last view
    of it (a frame still queued in a link's outbox keeps it); free blocks past _PINNED_FREE_MAX bytes are
    unregistered and unmapped."""

    def __init__(self, register: Callable[[HostBuffer], int], unregister: Callable[[int], None]) -> None:
        self._register = register
        self._unregister = unregister
        self._free: dict[int, list[tuple[mmap.mmap, int]]] = {}  # by block size: (mapping, registered address)
        self._free_bytes = 0

    def take(self, size: int) -> bytearray | memoryview:
        block = -(-size // _PINNED_STEP) * _PINNED_STEP
        free = self._free.get(block)
        if free:
            mm, address = free.pop()
            self._free_bytes -= block
        else:
            mm = mmap.mmap(-1, block, flags=mmap.MAP_PRIVATE)
            try:
                # (faults in and locks every page: anonymous memory of the worker's, in its limit)
                address = self._register(np.frombuffer(mm, dtype=np.uint8))
            except GpuBrokerError as exc:
                mm.close()
                if exc.details.get("fatal"):
                    raise
                return bytearray(size)  # (no page-locked memory now: this copy is only slower)
        array = np.frombuffer(mm, dtype=np.uint8)
        weakref.finalize(array, self._give_back, block, mm, address)
        return array.data[:size]  # (a view whose object is the array: it keeps it, and so the block)

    def _give_back(self, block: int, mm: mmap.mmap, address: int) -> None:
        if self._free_bytes + block <= _PINNED_FREE_MAX:
            self._free.setdefault(block, []).append((mm, address))
            self._free_bytes += block
            return
        with contextlib.suppress(GpuBrokerError):
            self._unregister(address)
        with contextlib.suppress(BufferError):
            mm.close()
