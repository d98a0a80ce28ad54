"""Per-tenant worker processes: each owns one device context and talks to the front over a socketpair."""

from ._client import WorkerClient, device_info_from_dict
from ._cpu import CpuReading, cpu_count, hold_seconds, scan_children
from ._links import MAX_LINKS_PER_SESSION
from ._pool import WorkerPool

__all__ = ["MAX_LINKS_PER_SESSION", "CpuReading", "WorkerClient", "WorkerPool", "cpu_count", "device_info_from_dict",
           "hold_seconds", "scan_children"]
