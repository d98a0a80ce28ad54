"""The gRPC front: the only part of the broker that imports grpc."""

from gpubroker.broker.front._server import Broker, probe_devices, run_broker
from gpubroker.broker.front._service import GpuBrokerService, device_info_to_pb

__all__ = ["Broker", "GpuBrokerService", "device_info_to_pb", "probe_devices", "run_broker"]
