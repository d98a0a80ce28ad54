"""Start-time fair queuing on measured device time: the pure policy, clock-free so tests can drive it."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["FairPolicy", "TenantAccount"]


@dataclass
class TenantAccount:
    weight: float
    # Weighted device time: device seconds charged / weight, lifted when the tenant returns from idleness.
    vtime: float = 0.0
    device_seconds: float = 0.0
    last_busy: float | None = None
    lift_pending: bool = False


class FairPolicy:
    """Picks which waiting tenant gets the device next.

    Each tenant's virtual time grows by (device time it used) / weight; the waiting tenant with the smallest
    virtual time goes next. A tenant that was idle longer than ``idle_reset`` restarts no lower than the
    smallest virtual time among busy tenants, so idleness cannot be banked and spent as a monopoly later.
    """

    def __init__(self, idle_reset: float = 0.05) -> None:
        self.idle_reset = idle_reset
        self.accounts: dict[str, TenantAccount] = {}

    def account(self, tenant: str) -> TenantAccount:
        acct = self.accounts.get(tenant)
        if acct is None:
            acct = self.accounts[tenant] = TenantAccount(weight=1.0)
        return acct

    def set_weight(self, tenant: str, weight: float) -> None:
        self.account(tenant).weight = max(float(weight), 1e-9)

    def _busy(self, acct: TenantAccount, now: float) -> bool:
        return acct.last_busy is not None and now - acct.last_busy <= self.idle_reset

    def touch(self, tenant: str, now: float, defer_lift: bool = False) -> None:
        """The tenant has work at ``now``; a return from idleness forfeits its unused credit.

        With ``defer_lift`` the forfeit waits for ``apply_lifts``: the holder's running slice is not charged yet,
        and lifting against its stale virtual time would hand the newcomer that slice as credit.
        """
        acct = self.account(tenant)
        if not self._busy(acct, now):
            acct.lift_pending = True
        acct.last_busy = now
        if acct.lift_pending and not defer_lift:
            self.apply_lifts(now, only=tenant)

    def apply_lifts(self, now: float, only: str | None = None) -> None:
        pending = [a for t, a in self.accounts.items() if a.lift_pending and only in (None, t)]
        if not pending:
            return
        settled = [a.vtime for a in self.accounts.values() if not a.lift_pending and self._busy(a, now)]
        floor = min(settled) if settled else max((a.vtime for a in self.accounts.values()), default=0.0)
        for acct in pending:
            acct.vtime = max(acct.vtime, floor)
            acct.lift_pending = False

    def charge(self, tenant: str, device_seconds: float) -> None:
        acct = self.account(tenant)
        acct.device_seconds += device_seconds
        acct.vtime += device_seconds / acct.weight

    def pick(self, waiting: list[str]) -> str:
        """The waiting tenant with the least virtual time; ties go to whoever has used the device least."""
        return min(waiting, key=lambda t: (self.account(t).vtime, self.account(t).device_seconds, t))
