"""Start-time fair queuing on measured device time: the pure policy, clock-free so tests can drive it."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["FairPolicy", "TenantAccount"]


@dataclass
class TenantAccount:
    weight: float
    # Weighted device time: device seconds charged / weight, lifted when the tenant returns from idleness.
    vtime: float = 0.0
    device_seconds: float = 0.0
    lift_pending: bool = False
    last_active: float | None = None  # when it last had work; None: never
    head_start: float = 0.0  # what this pending lift may leave it below the contending tenants
    # The level it was lifted to at its last arrival: a tenant kept below it by its head start still counts at
    # this level when newcomers are levelled, so its credit is not handed on to them.
    floor_seen: float = 0.0

    @property
    def level(self) -> float:
        return max(self.vtime, self.floor_seen)


class FairPolicy:
    """Picks which waiting tenant gets the device next.

    Each tenant's virtual time grows by (device time it used) / weight; the waiting tenant with the smallest
    virtual time goes next. A tenant that arrives with nothing queued or in flight is lifted to the least
    virtual time among the tenants contending for the device (waiting, or holding it): a newcomer, or one idle
    longer than ``idle_reset``, exactly; one between two of its own calls may stay up to ``lag`` below, so
    round trips between a tenant's calls do not cost it its share while a light tenant still cannot bank credit.
    """

    def __init__(self, lag: float = 0.005, idle_reset: float = 0.05) -> None:
        self.lag = lag
        self.idle_reset = idle_reset
        self.accounts: dict[str, TenantAccount] = {}

    def account(self, tenant: str) -> TenantAccount:
        acct = self.accounts.get(tenant)
        if acct is None:
            acct = self.accounts[tenant] = TenantAccount(weight=1.0)
        return acct

    def set_weight(self, tenant: str, weight: float) -> None:
        self.account(tenant).weight = max(float(weight), 1e-9)

    def active(self, tenant: str, now: float) -> None:
        self.account(tenant).last_active = now

    def arrive(self, tenant: str, backlogged: Iterable[str], now: float, defer_lift: bool = False) -> None:
        """The tenant had nothing queued or in flight and has work now.

        With ``defer_lift`` the lift waits for ``apply_lifts``: the holder's running slice is not charged yet,
        and lifting against its stale virtual time would hand the newcomer that slice as credit.
        """
        acct = self.account(tenant)
        returning = acct.last_active is not None and now - acct.last_active <= self.idle_reset
        acct.head_start = self.lag if returning else 0.0
        acct.last_active = now
        acct.lift_pending = True
        if not defer_lift:
            self.apply_lifts(backlogged, only=tenant)

    def apply_lifts(self, backlogged: Iterable[str], only: str | None = None) -> None:
        contending = [t for t in backlogged if t in self.accounts]
        for tenant, acct in list(self.accounts.items()):
            if not acct.lift_pending or only not in (None, tenant):
                continue
            others = [self.account(t).level for t in contending if t != tenant and not self.account(t).lift_pending]
            if others:
                acct.floor_seen = min(others)
                acct.vtime = max(acct.vtime, acct.floor_seen - acct.head_start)
            acct.lift_pending = False

    def charge(self, tenant: str, device_seconds: float) -> None:
        acct = self.account(tenant)
        acct.device_seconds += device_seconds
        acct.vtime += device_seconds / acct.weight

    def pick(self, waiting: list[str]) -> str:
        """The waiting tenant with the least virtual time; ties go to whoever has used the device least."""
        return min(waiting, key=lambda t: (self.account(t).vtime, self.account(t).device_seconds, t))
