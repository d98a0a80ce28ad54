"""Weighted fair time-slicing of each device among tenants, charged with measured device time."""

from ._device import DeviceScheduler, TenantUsage
from ._lease import TurnLease
from ._policy import FairPolicy, TenantAccount

__all__ = ["DeviceScheduler", "FairPolicy", "TenantAccount", "TenantUsage", "TurnLease"]
