"""The gpubroker client SDK: the GpuCompute interface, its types, errors, and RemoteGpu."""

from typing import TYPE_CHECKING

from gpubroker.client._tls import TlsOptions
from gpubroker.wire.compute import GpuCompute
from gpubroker.wire.errors import (
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
from gpubroker.wire.host import HostBuffer
from gpubroker.wire.library import LIBRARY_OPS, library_outputs
from gpubroker.wire.types import ArrayRef, Buffer, DeviceInfo, Event, Kernel, Module, ModuleFormat, Stream

if TYPE_CHECKING:  # imported on first use by __getattr__ below; named here so their types are known
    from gpubroker.client._admin import AdminClient
    from gpubroker.client._connect import connect
    from gpubroker.client._devices import copy_peer, list_devices
    from gpubroker.client._remote import RemoteGpu

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
        from gpubroker.client._remote import RemoteGpu

        return RemoteGpu
    if name == "connect":
        from gpubroker.client._connect import connect

        return connect
    if name in ("copy_peer", "list_devices"):
        from gpubroker.client import _devices

        return getattr(_devices, name)
    if name == "AdminClient":
        from gpubroker.client._admin import AdminClient

        return AdminClient
    raise AttributeError(name)
