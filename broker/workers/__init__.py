"""Per-tenant worker processes: each owns one device context and talks to the front over a socketpair."""

from ._client import WorkerClient, device_info_from_dict
from ._pool import WorkerPool

__all__ = ["WorkerClient", "WorkerPool", "device_info_from_dict"]
