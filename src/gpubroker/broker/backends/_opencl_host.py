"""What ``OpenCLBackend`` (in ``_opencl``) provides to its mixins, for the type checker only.

The mixins (``_opencl_launch``, ``_opencl_timing``) use state and helpers that ``OpenCLBackend`` owns or
that the other mixin defines. They inherit ``OpenCLHost`` only while type checking (at run time their base
is ``object``), so mypy checks their uses against these declarations and ``OpenCLBackend``'s definitions
against the same ones, while the runtime classes and their MRO stay plain.
"""

from __future__ import annotations

import threading
from abc import abstractmethod

import pyopencl as cl

from gpubroker.broker.backends._common import HandleTable, LaunchChecker
from gpubroker.broker.backends._opencl import _Alloc
from gpubroker.broker.backends._opencl_info import KernelRec
from gpubroker.broker.backends._opencl_launch import ModuleRec
from gpubroker.wire.types import Buffer, DeviceInfo, Stream

__all__ = ["OpenCLHost"]


class OpenCLHost:
    # Set by initialize(), None before it and after close(): a method that passed _ready() may rely on them.
    _device: cl.Device | None
    _context: cl.Context | None
    _checker: LaunchChecker | None
    _align: int
    _local_mem: int
    _closed: bool
    _lock: threading.RLock
    _modules: HandleTable[ModuleRec]
    _kernels: HandleTable[KernelRec]
    _in_flight: list[tuple[cl.CommandQueue, cl.Event, list[cl.Buffer]]]
    _events: list[cl.Event]
    _folded: float
    _fold_at: int

    @abstractmethod
    def _ready(self) -> DeviceInfo: ...

    @abstractmethod
    def _all_queues(self) -> list[cl.CommandQueue]: ...

    @abstractmethod
    def _queue_for(self, stream: Stream | None) -> cl.CommandQueue: ...

    @abstractmethod
    def _resolve(self, buf: Buffer) -> tuple[_Alloc, Buffer]: ...

    @abstractmethod
    def _track(self, event: cl.Event) -> None: ...
