"""In-process implementations of GpuCompute: CUDA through CuPy, OpenCL through pyopencl.

Each is usable without the broker::

    from gpubroker.broker.backends import open_backend
    with open_backend("opencl", 0) as gpu: ...
"""

from __future__ import annotations

import os
import tempfile
from typing import TYPE_CHECKING

from gpubroker.broker.backends._torch import TorchAccounts, TorchSession
from gpubroker.wire.errors import FailedPrecondition, InvalidArgument
from gpubroker.wire.types import DeviceInfo

if TYPE_CHECKING:
    from gpubroker.wire.compute import GpuCompute

__all__ = ["BACKENDS", "TorchAccounts", "TorchSession", "detect_backend", "list_devices", "open_backend", "preload"]

BACKENDS = ("cuda", "opencl")


def cuda_available() -> bool:
    try:
        from gpubroker.broker.backends._cuda import list_cuda_devices
    except ImportError:
        return False
    try:
        return len(list_cuda_devices()) > 0
    except Exception:
        return False


def detect_backend() -> str:
    """CUDA when CuPy sees a GPU, else OpenCL (PoCL's CPU device when nothing else is there)."""
    return "cuda" if cuda_available() else "opencl"


def list_devices(kind: str) -> list[DeviceInfo]:
    if kind == "cuda":
        from gpubroker.broker.backends._cuda import list_cuda_devices

        return list_cuda_devices()
    if kind == "opencl":
        from gpubroker.broker.backends._opencl import list_opencl_devices

        return list_opencl_devices()
    raise InvalidArgument(f"unknown backend {kind!r}; expected one of {', '.join(BACKENDS)}")


def preload(kind: str) -> None:
    """Import the backend's modules (CuPy, or pyopencl and PoCL's library) without touching a device: no CUDA call,
    no OpenCL platform query, so that a process forked afterwards may still open one (CUDA forbids a fork after
    its initialization). ``auto`` loads whichever is installed."""
    for name in (("cuda", "opencl") if kind == "auto" else (kind,)):
        try:
            if name == "cuda":
                # CuPy makes its kernel cache's folder as it is imported (CUPY_CACHE_DIR, else ~/.cupy/kernel_cache:
                # the operator's home, here); one that exists makes nothing. A worker takes its tenant's folder
                # when it opens its device (_cuda_util.use_kernel_cache_of_environment).
                imported_without = "CUPY_CACHE_DIR" not in os.environ
                os.environ.setdefault("CUPY_CACHE_DIR", tempfile.gettempdir())
                try:
                    import gpubroker.broker.backends._cuda
                finally:
                    if imported_without:
                        del os.environ["CUPY_CACHE_DIR"]
            elif name == "opencl":
                import gpubroker.broker.backends._opencl  # noqa: F401
        except ImportError:  # (open_backend says what is missing, when a worker needs it)
            pass


def open_backend(kind: str, device: int = 0) -> GpuCompute:
    """An initialized backend on one device."""
    if kind == "auto":
        kind = detect_backend()
    if kind == "cuda":
        try:
            from gpubroker.broker.backends._cuda import CudaBackend
        except ImportError as exc:
            raise FailedPrecondition(f"the cuda backend needs CuPy: {exc}") from exc
        backend: GpuCompute = CudaBackend(device)
    elif kind == "opencl":
        try:
            from gpubroker.broker.backends._opencl import OpenCLBackend
        except ImportError as exc:
            raise FailedPrecondition(f"the opencl backend needs pyopencl: {exc}") from exc
        backend = OpenCLBackend(device)
    else:
        raise InvalidArgument(f"unknown backend {kind!r}; expected one of {', '.join(BACKENDS)}")
    backend.initialize()
    return backend
