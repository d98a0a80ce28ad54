"""Weighted fair time-slicing of each device among tenants, charged with measured device time."""

from gpubroker.broker.front.scheduler._device import WAIT_BUCKETS, DeviceScheduler, HoldMeter, Metered, TenantUsage
from gpubroker.broker.front.scheduler._lease import TurnLease
from gpubroker.broker.front.scheduler._policy import FairPolicy, TenantAccount

__all__ = ["WAIT_BUCKETS", "DeviceScheduler", "FairPolicy", "HoldMeter", "Metered", "TenantAccount", "TenantUsage",
           "TurnLease"]
