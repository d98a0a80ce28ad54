"""The cuda backend's host<->device and device<->device copies, memsets and host-memory pinning.

``CudaCopies`` is one part of ``CudaBackend`` (in ``_cuda``); it holds the device state (``CudaDevice``) for its
helpers (``use``, ``resolve``, ``stream``, ``fail``) and its device timer.
"""

from __future__ import annotations

import numpy as np
from cupy.cuda import runtime

from gpubroker.broker.backends._cuda_device import CudaDevice
from gpubroker.wire.errors import InvalidArgument
from gpubroker.wire.host import HostBuffer, check_device_range, readable_bytes, writable_bytes
from gpubroker.wire.types import Buffer, Stream

__all__ = ["CudaCopies"]


class CudaCopies:
    """copy_h2d, copy_d2h, copy_d2d, memset and (un)register_host_memory for ``CudaBackend``."""

    def __init__(self, device: CudaDevice) -> None:
        self._dev = device
        self._timer = device.timer

    def copy_h2d(self, src: HostBuffer, buf: Buffer, offset: int = 0, stream: Stream | None = None) -> None:
        self._dev.use()
        view = readable_bytes(src)
        (mem, buf), s = self._dev.resolve(buf), self._dev.stream(stream)
        start = check_device_range(buf, offset, view.nbytes, "copy_h2d")
        if view.nbytes == 0:
            return
        host = np.frombuffer(view, dtype=np.uint8)  # no copy; only for its address
        timer = self._timer
        try:
            with timer.lock:
                timer.begin(s.ptr)
                runtime.memcpyAsync(mem.ptr + start, host.ctypes.data, view.nbytes, runtime.memcpyHostToDevice,
                                    s.ptr)
                timer.close(s.ptr)  # we wait next: the host's idle time must not count
            s.synchronize()  # the caller may reuse src as soon as we return
        except Exception as exc:
            raise self._dev.fail("copy_h2d", exc) from exc

    def copy_d2h(self, buf: Buffer, dst: HostBuffer, offset: int = 0, stream: Stream | None = None) -> None:
        self._dev.use()
        view = writable_bytes(dst)
        (mem, buf), s = self._dev.resolve(buf), self._dev.stream(stream)
        start = check_device_range(buf, offset, view.nbytes, "copy_d2h")
        if view.nbytes == 0:
            return
        host = np.frombuffer(view, dtype=np.uint8)
        timer = self._timer
        try:
            with timer.lock:
                timer.begin(s.ptr)
                runtime.memcpyAsync(host.ctypes.data, mem.ptr + start, view.nbytes, runtime.memcpyDeviceToHost,
                                    s.ptr)
                timer.close(s.ptr)
            s.synchronize()  # dst must hold the data when we return
        except Exception as exc:
            raise self._dev.fail("copy_d2h", exc) from exc

    def register_host_memory(self, host: HostBuffer) -> int:
        """Page-lock a host range (a shared-memory segment) so copy_h2d / copy_d2h on views of it DMA directly.

        Returns the address to pass to unregister_host_memory, which must run before the range is unmapped.
        """
        self._dev.use()
        view = readable_bytes(host)
        ptr, size = int(np.frombuffer(view, dtype=np.uint8).ctypes.data), view.nbytes  # its address; no copy
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
