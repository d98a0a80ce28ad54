"""What the namespace keeps per device session: the GpuCompute, its memory, its kernels, and the device object."""

from __future__ import annotations

import weakref
from typing import Any

import numpy as np

from gpubroker.client import GpuCompute
from gpubroker.client.array._kernels import Kernels
from gpubroker.client.array._memory import Memory, Storage
from gpubroker.client.array._views import View

__all__ = ["Context", "Device"]


class Device:
    """The device a namespace's arrays live on (one GpuCompute session). Equal only to itself."""

    def __init__(self, ctx: Context) -> None:
        self._ctx = weakref.ref(ctx)
        self.name = ctx.info_name

    def __repr__(self) -> str:
        return f"Device({self.name!r})"


class Context:
    """One per namespace: the GpuCompute, the backend's name, the device, the memory (and its pool) and the
    kernels (and their caches)."""

    def __init__(self, gpu: GpuCompute) -> None:
        self.gpu = gpu
        info = gpu.device_info()
        self.backend: str = info.backend  # "cuda" or "opencl": which language kernels are generated in
        self.info_name = f"{info.backend}:{info.id} {info.name}"
        self.device = Device(self)
        self.memory = Memory(gpu, info.memory_quota)
        self.kernels = Kernels(gpu, self.memory)

    def allocate(self, nbytes: int) -> Storage:
        """A Storage of at least ``nbytes`` (one byte for an empty array: every array has a buffer)."""
        return self.memory.allocate(nbytes)

    def release_memory(self) -> None:
        """Free every pooled buffer now (memory of live arrays stays)."""
        self.memory.release()

    def empty(self, shape: tuple[int, ...], dtype: np.dtype[Any]) -> tuple[Storage, View]:
        """Fresh contiguous memory for ``shape`` of ``dtype`` (contents undefined)."""
        return self.memory.empty(shape, dtype)
