"""The cuda backend's side of copies between two devices' worker processes (CopyPeer): CUDA IPC and peer copies.

The source worker exports its allocation (``cudaIpcGetMemHandle``); the destination worker maps it into its own
context (``cudaIpcOpenMemHandle``, which enables peer access) and copies from it there with a plain
``cudaMemcpyAsync`` (unified addressing tells the driver where each side lives), which runs over NVLink or PCIe
peer-to-peer without a context on the source device. Only where ``cudaDeviceCanAccessPeer`` says so: otherwise
the broker stages the copy through host memory instead.

``CudaPeer`` is one part of ``CudaBackend`` (in ``_cuda``); it holds the device state (``CudaDevice``) for its
helpers (``use``, ``resolve``, ``fail``, ``synchronize``), its index, its default stream and its device timer.
"""

from __future__ import annotations

from cupy.cuda import runtime

from gpubroker.broker.backends._cuda_device import CudaDevice
from gpubroker.wire.errors import FailedPrecondition, InvalidArgument
from gpubroker.wire.host import check_device_range
from gpubroker.wire.types import Buffer

__all__ = ["CudaPeer"]


class CudaPeer:
    """export_peer, open_peer, copy_from_peer and close_peer for ``CudaBackend``."""

    def __init__(self, device: CudaDevice) -> None:
        self._dev = device

    def export_peer(self, buf: Buffer) -> tuple[bytes, int]:
        """An IPC handle of ``buf``'s whole allocation and its size, once the device's queued work is done."""
        self._dev.use()
        mem, _ = self._dev.resolve(buf)
        self._dev.synchronize()  # what the tenant queued before the copy has written the source by now
        try:
            return bytes(runtime.ipcGetMemHandle(mem.ptr)), int(mem.size)
        except Exception as exc:
            raise self._dev.fail("export an allocation for a peer copy", exc) from exc

    def open_peer(self, handle: bytes, src_device: int) -> int:
        """Map another process's allocation on CUDA device ``src_device`` into this context; returns its address.

        FailedPrecondition with ``peer_unsupported`` when this device cannot reach that one as a peer.
        """
        self._dev.use()
        index = self._dev.index
        if not isinstance(handle, bytes) or not isinstance(src_device, int) or src_device == index:
            raise InvalidArgument("a peer copy needs an IPC handle from another device")
        try:
            reachable = runtime.deviceCanAccessPeer(index, src_device)
        except Exception as exc:
            raise self._dev.fail("check peer access", exc) from exc
        if not reachable:
            raise FailedPrecondition(f"CUDA device {index} cannot access device {src_device} as a peer",
                                     peer_unsupported=True)
        self._dev.synchronize()  # and what it queued has stopped using the destination
        try:
            return int(runtime.ipcOpenMemHandle(handle, runtime.cudaIpcMemLazyEnablePeerAccess))
        except Exception as exc:
            err = self._dev.fail("open a peer's allocation", exc)
            if err.details.get("fatal"):
                raise err from exc
            raise FailedPrecondition(f"the peer path is unavailable: {err.message}", peer_unsupported=True) from exc

    def copy_from_peer(self, src_ptr: int, dst: Buffer, dst_offset: int, size: int) -> None:
        """Copy ``size`` bytes from an opened peer address into ``dst``; returns once they have landed."""
        self._dev.use()
        mem, dst = self._dev.resolve(dst)
        start = check_device_range(dst, dst_offset, size, "peer copy destination")
        if size == 0:
            return
        s, timer = self._dev.null, self._dev.timer
        try:
            with timer.lock:
                timer.begin(s.ptr)
                runtime.memcpyAsync(mem.ptr + start, src_ptr, size, runtime.memcpyDefault, s.ptr)
                waited = timer.close_for_sync(s.ptr)
            timer.wait(waited, s.synchronize)
        except Exception as exc:
            raise self._dev.fail("peer copy", exc) from exc

    def close_peer(self, src_ptr: int) -> None:
        self._dev.use()
        try:
            runtime.ipcCloseMemHandle(src_ptr)
        except Exception as exc:
            raise self._dev.fail("close a peer's allocation", exc) from exc
