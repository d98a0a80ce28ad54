"""Start-time fair queuing on measured device time: the pure policy, clock-free so tests can drive it."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["FairPolicy", "TenantAccount"]


@dataclass
class TenantAccount:
    weight: float
    # Virtual finish time: device seconds charged / weight, offset so newcomers start level with the rest.
    vtime: float = 0.0
    device_seconds: float = 0.0
    active: bool = False


class FairPolicy:
    """Picks which waiting tenant gets the device next.

    Each tenant's virtual time grows by (device time it used) / weight; the waiting tenant with the smallest
    virtual time goes next. A tenant that becomes active again starts no lower than the smallest virtual time
    among active tenants, so an idle tenant cannot bank credit and then monopolise the device.
    """

    def __init__(self) -> None:
        self.accounts: dict[str, TenantAccount] = {}

    def account(self, tenant: str, weight: float = 1.0) -> TenantAccount:
        acct = self.accounts.get(tenant)
        if acct is None:
            acct = self.accounts[tenant] = TenantAccount(weight=max(weight, 1e-9))
        return acct

    def set_weight(self, tenant: str, weight: float) -> None:
        self.account(tenant).weight = max(weight, 1e-9)

    def _floor(self, excluding: str) -> float | None:
        active = [a.vtime for t, a in self.accounts.items() if a.active and t != excluding]
        return min(active) if active else None

    def activate(self, tenant: str) -> None:
        """The tenant has work again: bound its credit to the present."""
        acct = self.account(tenant)
        if acct.active:
            return
        floor = self._floor(tenant)
        if floor is None:
            # Nobody else active: level everyone, so history does not skew the next contention.
            floor = max((a.vtime for a in self.accounts.values()), default=0.0)
        acct.vtime = max(acct.vtime, floor)
        acct.active = True

    def deactivate(self, tenant: str) -> None:
        self.account(tenant).active = False

    def charge(self, tenant: str, device_seconds: float) -> None:
        acct = self.account(tenant)
        acct.device_seconds += device_seconds
        acct.vtime += device_seconds / acct.weight

    def pick(self, waiting: list[str]) -> str:
        """The waiting tenant with the least virtual time; ties go to whoever has used the device least."""
        return min(waiting, key=lambda t: (self.account(t).vtime, self.account(t).device_seconds, t))
