"""The front's side of the per-tenant worker processes: starting them, talking to them, watching what they use."""

from gpubroker.broker.front.workers._client import WorkerClient, device_info_from_dict
from gpubroker.broker.front.workers._cpu import CpuReading, cpu_count, hold_seconds, parent_pid, scan_children
from gpubroker.broker.front.workers._output import escape
from gpubroker.broker.front.workers._pool import WorkerPool
from gpubroker.broker.front.workers._zygote import Zygote

__all__ = ["CpuReading", "WorkerClient", "WorkerPool", "cpu_count", "device_info_from_dict", "escape",
           "hold_seconds", "parent_pid", "scan_children", "Zygote"]
