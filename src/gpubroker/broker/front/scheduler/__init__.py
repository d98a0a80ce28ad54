"""Weighted fair time-slicing of each device among tenants, charged with measured device time."""

from gpubroker.broker.front.scheduler._device import DeviceScheduler, HoldMeter, Metered, TenantUsage
from gpubroker.broker.front.scheduler._lease import TurnLease
from gpubroker.broker.front.scheduler._policy import FairPolicy, TenantAccount

__all__ = ["DeviceScheduler", "FairPolicy", "HoldMeter", "Metered", "TenantAccount", "TenantUsage", "TurnLease"]
