"""The gRPC front: the only part of the broker that imports grpc.

Its names load on first use: the front's acceptor process (``_acceptor.py``) runs a module of this package and
must not pay for grpc, the workers' code or numpy to start."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gpubroker.broker.front._credentials import check_listeners
    from gpubroker.broker.front._native_log import capture_native_stderr
    from gpubroker.broker.front._server import Broker, probe_devices, run_broker
    from gpubroker.broker.front._service import GpuBrokerService, device_info_to_pb

__all__ = ["Broker", "GpuBrokerService", "capture_native_stderr", "check_listeners", "device_info_to_pb",
           "probe_devices", "run_broker"]


def __getattr__(name: str) -> Any:
    if name in ("Broker", "probe_devices", "run_broker"):
        from gpubroker.broker.front import _server

        return getattr(_server, name)
    if name == "check_listeners":
        from gpubroker.broker.front import _credentials

        return _credentials.check_listeners
    if name == "capture_native_stderr":
        from gpubroker.broker.front import _native_log

        return _native_log.capture_native_stderr
    if name in ("GpuBrokerService", "device_info_to_pb"):
        from gpubroker.broker.front import _service

        return getattr(_service, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
