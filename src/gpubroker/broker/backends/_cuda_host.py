"""What ``CudaBackend`` (in ``_cuda``) provides to its mixins, for the type checker only.

The mixins (``_cuda_copies``, ``_cuda_modules``, ``_cuda_peer``) use state and helpers that ``CudaBackend``
owns. They inherit ``CudaHost`` only while type checking (at run time their base is ``object``), so mypy
checks their uses against these declarations and ``CudaBackend``'s definitions against the same ones,
while the runtime classes and their MRO stay plain.
"""

from __future__ import annotations

from abc import abstractmethod

import cupy
from cupy.cuda.memory import Memory

from gpubroker.broker.backends._common import HandleTable, LaunchChecker
from gpubroker.broker.backends._cuda_timing import DeviceTimer
from gpubroker.broker.backends._cuda_util import KernelRec, ModuleRec
from gpubroker.wire.errors import GpuBrokerError
from gpubroker.wire.types import Buffer, Stream

__all__ = ["CudaHost"]


class CudaHost:
    _device: int
    _null: cupy.cuda.Stream
    _timer: DeviceTimer
    _checker: LaunchChecker
    _smem_optin: int
    _modules: HandleTable[ModuleRec]
    _kernels: HandleTable[KernelRec]

    @abstractmethod
    def _use(self) -> None: ...

    @abstractmethod
    def _fail(self, what: str, exc: BaseException) -> GpuBrokerError: ...

    @abstractmethod
    def _resolve(self, buf: Buffer) -> tuple[Memory, Buffer]: ...

    @abstractmethod
    def _stream(self, stream: Stream | None) -> cupy.cuda.Stream: ...

    @abstractmethod
    def synchronize(self, stream: Stream | None = None) -> None: ...
