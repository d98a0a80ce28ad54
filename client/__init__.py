"""The gpubroker client SDK: the GpuCompute interface, its types, errors, and RemoteGpu."""

from typing import TYPE_CHECKING

from ._compute import GpuCompute
from ._errors import (
    Aborted,
    AlreadyExists,
    ArgumentTypeError,
    Cancelled,
    CompileError,
    DeadlineExceeded,
    FailedPrecondition,
    GpuBrokerError,
    Internal,
    InvalidArgument,
    NotFound,
    OutOfRange,
    PermissionDenied,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
    Unimplemented,
    WorkerCrashed,
)
from ._host import HostBuffer
from ._library import LIBRARY_OPS, library_outputs
from ._tls import TlsOptions
from ._types import ArrayRef, Buffer, DeviceInfo, Event, Kernel, Module, ModuleFormat, Stream

if TYPE_CHECKING:  # imported on first use by __getattr__ below; named here so their types are known
    from ._admin import AdminClient
    from ._connect import connect
    from ._devices import copy_peer, list_devices
    from ._remote import RemoteGpu

__all__ = [
    "Aborted",
    "AdminClient",
    "AlreadyExists",
    "ArgumentTypeError",
    "ArrayRef",
    "Buffer",
    "Cancelled",
    "CompileError",
    "DeadlineExceeded",
    "DeviceInfo",
    "Event",
    "FailedPrecondition",
    "GpuBrokerError",
    "GpuCompute",
    "HostBuffer",
    "Internal",
    "InvalidArgument",
    "Kernel",
    "LIBRARY_OPS",
    "Module",
    "ModuleFormat",
    "NotFound",
    "OutOfRange",
    "PermissionDenied",
    "RemoteGpu",
    "ResourceExhausted",
    "Stream",
    "TlsOptions",
    "Unauthenticated",
    "Unavailable",
    "Unimplemented",
    "WorkerCrashed",
    "connect",
    "copy_peer",
    "library_outputs",
    "list_devices",
]


def __getattr__(name: str) -> object:
    # RemoteGpu pulls in grpc; in-process backends import this package without paying for it.
    if name == "RemoteGpu":
        from ._remote import RemoteGpu

        return RemoteGpu
    if name == "connect":
        from ._connect import connect

        return connect
    if name in ("copy_peer", "list_devices"):
        from . import _devices

        return getattr(_devices, name)
    if name == "AdminClient":
        from ._admin import AdminClient

        return AdminClient
    raise AttributeError(name)
