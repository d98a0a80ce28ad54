"""Where a session goes when its client lets the broker choose: the least loaded serving device with room.

Load is counted, not sampled, so a placement is predictable and the same for every tenant: first the device's
open sessions (all tenants', those still starting included), then the caller's own sessions on it, then the
fraction of its memory that all tenants have reserved, then the lower index. A device takes part only while it
serves new sessions (health) and while the tenant has quota room left on it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from gpubroker.wire.errors import ResourceExhausted

__all__ = ["DeviceLoad", "NoServingDevice", "choose_device"]


@dataclass(frozen=True)
class DeviceLoad:
    device: int
    problem: str | None  # why the device takes no new sessions (None: it does)
    sessions: int  # open or opening sessions on it, every tenant's
    tenant_sessions: int  # the caller's own among them
    room: int  # bytes of the caller's quota left on it
    memory_fraction: float  # of its memory, reserved by all tenants

    @property
    def key(self) -> tuple[int, int, float, int]:
        return self.sessions, self.tenant_sessions, self.memory_fraction, self.device


class NoServingDevice(Exception):
    """No device serves new sessions; the caller turns this into the health's own refusal."""


def choose_device(tenant: str, loads: Sequence[DeviceLoad]) -> int:
    """The device for a new session of ``tenant``, or NoServingDevice / ResourceExhausted saying why none."""
    serving = [load for load in loads if load.problem is None]
    if not serving:
        raise NoServingDevice
    roomy = [load for load in serving if load.room > 0]
    if not roomy:
        raise ResourceExhausted(
            f"tenant {tenant!r} has used its whole memory quota on every serving device "
            f"({', '.join(str(load.device) for load in serving)}); free memory or name a device",
            devices=[load.device for load in serving])
    return min(roomy, key=lambda load: load.key).device
