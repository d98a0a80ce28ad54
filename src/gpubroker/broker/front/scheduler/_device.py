"""Weighted fair time-slicing of one device among tenants, in the front.

One tenant holds the device at a time. Its device work (launches, copies, memsets) goes straight to its
worker; other tenants' work waits in per-tenant queues. The holder keeps the device while it has work and
nobody waits, or until its quantum runs out while others wait; then its worker is fenced (all its work
finished) and charged the device time the runtime measured, and the waiting tenant with the least weighted
device time goes next. Kernels cannot be preempted, so a light tenant waits at most quantum + the longest
kernel in flight + one fence.

The kernel time limit bounds that longest kernel: once another tenant waits, the holder must hand the device
over (its calls in flight and its leases done, its fence back) within ``max_hold`` seconds of the wait's start,
or ``on_overrun`` is called for it (the front kills its worker, whose calls then fail and whose fence ends, so
the waiting tenants go on). A holder nobody waits for is limited by ``lone_hold`` (0: never) past its periodic
accounting fence. The limits are read off the scheduler's clock, so tests can drive them on a virtual one.

The limits count what the holder consumed, not how long others made it take. With a ``hold_meter`` (a CPU device,
where the device is the host's CPUs: workers/_cpu.py states the rule), a hold longer than ``meter_after`` is
measured from then on, and the holder is over its limit only once its consumption (the unmetered start counted
as wall time) reaches it; its charge for the slice is that consumption where it is less than the fence's. Without
a meter (CUDA: the device is the holder's alone), a hold's wall time is its device time. A holder whose worker
dies is still charged its hold.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import NamedTuple

from gpubroker.broker.front.scheduler._policy import FairPolicy

__all__ = ["WAIT_BUCKETS", "DeviceScheduler", "HoldMeter", "Metered", "TenantUsage"]

log = logging.getLogger("gpubroker.scheduler")

Fence = Callable[[str], Awaitable[float]]
# Called with the tenant whose device work overran the time limit and a message naming the limit.
Overrun = Callable[[str, str], None]


class Metered(NamedTuple):
    """What a hold meter read of a tenant's worker since it started, in device seconds."""

    consumed: float  # the device it held: its use, and the compute units it left idle (workers/_cpu.py)
    used: float  # of which its own CPU over the device's compute units: work it certainly did on the device


# Starts measuring what a tenant's worker consumes of the device: the callable it returns reads what it consumed
# since (None: no meter for this tenant's worker, its hold's wall time is its device time).
HoldMeter = Callable[[str], Callable[[], Metered] | None]


# The upper bounds (seconds) of gpubroker_scheduler_wait_seconds' buckets: a turn granted at once is 0, a wait
# behind another tenant's quantum a few ms, behind a long kernel up to the kernel time limit.
WAIT_BUCKETS = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
                60.0)


@dataclass
class TenantUsage:
    """What the scheduler saw of one tenant on one device."""

    device_seconds: float = 0.0
    waits: deque[float] = field(default_factory=lambda: deque(maxlen=4096))  # the last ones (admin usage's p50/p99)
    # Every wait since the start, by bucket of WAIT_BUCKETS (the last: over them all), and their sum: a histogram
    # Prometheus can add up across tenants and brokers, which quantiles of the last 4096 were not.
    wait_counts: list[int] = field(default_factory=lambda: [0] * (len(WAIT_BUCKETS) + 1))
    wait_sum: float = 0.0
    charges: deque[tuple[float, float]] = field(default_factory=lambda: deque(maxlen=65536))
    queued: int = 0
    inflight: int = 0
    last_release: float | None = None
    # Device seconds charged for CPU its worker used outside its turns (threads a kernel left running, compiles).
    outside_seconds: float = 0.0
    held: float = 0.0  # wall seconds it held the device, in slices already ended

    def record_wait(self, seconds: float) -> None:
        self.waits.append(seconds)
        self.wait_counts[bisect.bisect_left(WAIT_BUCKETS, seconds)] += 1
        self.wait_sum += seconds

    def wait_percentile(self, q: float) -> float:
        if not self.waits:
            return 0.0
        ordered = sorted(self.waits)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class DeviceScheduler:
    def __init__(self, fence: Fence, quantum: float = 0.005, enabled: bool = True,
                 clock: Callable[[], float] = time.monotonic, accounting_period: float = 1.0,
                 idle_grace: float | None = None, min_slice: float = 0.001, max_hold: float = 0.0,
                 lone_hold: float = 0.0, on_overrun: Overrun | None = None, hold_meter: HoldMeter | None = None,
                 meter_after: float = 0.05, fence_idle: bool = False) -> None:
        self.quantum = quantum
        # The kernel time limits (0: none): while others wait, and for a lone holder.
        self.max_hold = max_hold
        self.lone_hold = lone_hold
        self._on_overrun = on_overrun
        self._slice_gen = 0  # bumped at every new slice, so a limit is enforced once per slice
        self._overran: int | None = None  # the slice whose holder was reported for overrunning
        self._watchdog: asyncio.TimerHandle | None = None
        self._watchdog_at = 0.0
        # The slice's consumption meter: started ``meter_after`` into a slice (slices are mostly far shorter, and a
        # reading costs /proc reads), with the clock when it started; and the meter's value when the current limit
        # began (its contention), if the meter was running by then.
        self._hold_meter = hold_meter
        self.meter_after = meter_after
        self._meter: Callable[[], Metered] | None = None
        self._meter_at = 0.0
        self._meter_timer: asyncio.TimerHandle | None = None
        self._meter_base: tuple[float, float] | None = None
        # With ``fence_idle``, a lone holder that goes idle is fenced an accounting period into its slice and
        # gives the device up (unless it comes back within its grace): its hold ends when its work does.
        self.fence_idle = fence_idle
        self._idle_timer: asyncio.TimerHandle | None = None
        self._idle_timer_gen = 0
        # (slice, limit start, when to look again): a limit already measured and found not yet reached.
        self._measured: tuple[int, float, float] | None = None
        # Slices shorter than this are never cut short: each switch costs a fence.
        self.min_slice = min_slice
        # How long a holder with nothing in flight keeps its slice for its next command: a client's next call
        # arrives a round trip later, and switching at every gap would starve tenants of short kernels.
        # Never beyond the slice itself (the light-tenant bound stays quantum + longest kernel).
        self.idle_grace = quantum if idle_grace is None else idle_grace
        self._grace_timer: asyncio.TimerHandle | None = None
        self._grace_deadline = 0.0
        # A lone holder is fenced this often anyway, so its usage figures stay current.
        self.accounting_period = accounting_period
        self.enabled = enabled
        # Between its own calls a tenant keeps up to 100 ms of credit: the debt it runs up by missing picks
        # during its round trips, which it must be able to recover, while a light tenant banks no more.
        self.policy = FairPolicy(lag=0.1)
        self.usage: dict[str, TenantUsage] = {}
        self.holder: str | None = None
        self.slice_start = 0.0
        # When another tenant began waiting during the current slice (None: nobody has). From then on the
        # holder's slice costs others the device, idle or not, so the charge is at least that wall time.
        self.contended_since: float | None = None
        self._fence = fence
        self._clock = clock
        self._waiters: dict[str, deque[asyncio.Future[None]]] = {}
        self._switching: asyncio.Task[None] | None = None
        # Leases: turns held for a worker's client links, which give them back when asked (preempted).
        self._leases: dict[str, list[Callable[[bool], None]]] = {}
        self._lease_timer: asyncio.TimerHandle | None = None
        self._lease_deadline = 0.0

    # -- public ------------------------------------------------------------------------------------
    def set_weight(self, tenant: str, weight: float) -> None:
        self.policy.set_weight(tenant, weight)

    @contextlib.asynccontextmanager
    async def turn(self, tenant: str, preempt: Callable[[bool], None] | None = None) -> AsyncIterator[None]:
        """Hold a place on the device for one piece of the tenant's device work.

        With ``preempt``, the turn is a lease of open length, and the scheduler calls it (perhaps more than
        once): ``preempt(False)`` while others wait (end the turn once idle), ``preempt(True)`` when the slice is
        over or the tenant's usage is due to be accounted (end it as soon as the work in hand is submitted).
        """
        if not self.enabled:
            yield
            return
        await self._acquire(tenant)
        if preempt is not None:
            self._leases.setdefault(tenant, []).append(preempt)
            self._check_leases(tenant)
        try:
            yield
        finally:
            if preempt is not None:
                self._leases[tenant].remove(preempt)
            self._release(tenant)

    def share(self, tenant: str, window: float = 10.0) -> float:
        """This tenant's fraction of the device time charged in the last ``window`` seconds."""
        since = self._clock() - window
        totals = {t: sum(s for ts, s in u.charges if ts >= since) for t, u in self.usage.items()}
        whole = sum(totals.values())
        return totals.get(tenant, 0.0) / whole if whole > 0 else 0.0

    # -- internals ---------------------------------------------------------------------------------
    def _use(self, tenant: str) -> TenantUsage:
        use = self.usage.get(tenant)
        if use is None:
            use = self.usage[tenant] = TenantUsage()
        return use

    def _contending(self) -> list[str]:
        """Tenants waiting for the device, and its holder."""
        return [t for t, q in self._waiters.items() if q] + ([self.holder] if self.holder is not None else [])

    def _others_waiting(self, tenant: str) -> bool:
        return any(q for t, q in self._waiters.items() if t != tenant)

    async def _acquire(self, tenant: str) -> None:
        use = self._use(tenant)
        now = self._clock()
        # While another tenant holds the device its slice is uncharged: lift this one at the switch.
        if use.inflight == 0 and use.queued == 0:
            self.policy.arrive(tenant, self._contending(), now,
                               defer_lift=self.holder not in (None, tenant) or self._switching is not None)
        if self._switching is None:
            if self.holder is None:
                self.holder, self.slice_start, self.contended_since = tenant, now, None
                self._slice_gen += 1
                self._new_slice()
                self.check_overrun()
            if (self.holder == tenant and not (self._others_waiting(tenant) and self._slice_over())
                    and not self._accounting_due()):
                self._cancel_grace()  # the holder came back in time
                use.inflight += 1
                use.record_wait(0.0)
                return
        if self.holder not in (None, tenant) and self.contended_since is None:
            self.contended_since = now
            if self._meter is not None:  # the limit starts now: what the holder consumed so far is not in it
                self._meter_base = (now, self._meter().consumed)
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.setdefault(tenant, deque()).append(fut)
        use.queued += 1
        self.check_overrun()  # (a wait begins: the holder's limit starts now)
        self._maybe_switch()
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self._release(tenant)  # granted just as the caller gave up: hand the place back
            else:
                with contextlib.suppress(ValueError):
                    self._waiters[tenant].remove(fut)
                use.queued -= 1
            raise
        use.record_wait(self._clock() - now)

    def _release(self, tenant: str) -> None:
        use = self._use(tenant)
        use.inflight -= 1
        use.last_release = self._clock()
        self.policy.active(tenant, use.last_release)
        self._maybe_switch()

    def _maybe_switch(self, expire: bool = False) -> None:
        if self._switching is not None:
            return
        holder = self.holder
        if holder is None:
            if any(self._waiters.values()):
                self._switching = asyncio.get_running_loop().create_task(self._switch(None))
            return
        held = self._use(holder)
        if held.inflight:
            self._check_leases(holder)
            return  # the switch waits for the holder's in-flight work to drain
        if (self._waiters.get(holder) and not (self._others_waiting(holder) and self._slice_over())
                and not self._accounting_due()):
            self._cancel_grace()
            self._grant(holder)  # the holder's next command came within its slice: carry on
            return
        elapsed = self._clock() - self.slice_start
        if self._others_waiting(holder):
            remaining = self.quantum - elapsed
            if expire or self._slice_over() or self.idle_grace <= 0:
                # After the grace ran out with nothing submitted, the holder forfeits the rest of its slice.
                self._start_switch(holder, forfeit=expire)
            else:
                # Wait for the holder's next command, but no longer than its slice, and no longer than the
                # minimum slice when a more deserving tenant is already waiting.
                wait = min(self.idle_grace, remaining)
                if self._more_deserving_waiter():
                    wait = min(wait, max(0.0, self.min_slice - elapsed))
                deadline = self._clock() + wait
                if self._grace_timer is None or deadline < self._grace_deadline:
                    if self._grace_timer is not None:
                        self._grace_timer.cancel()
                    self._grace_deadline = deadline
                    self._grace_timer = asyncio.get_running_loop().call_later(wait, self._grace_over)
        elif elapsed >= self.accounting_period:
            self._start_switch(holder)
        elif self.fence_idle and (self._idle_timer is None or self._idle_timer_gen != self._slice_gen):
            # An idle lone holder's slice ends too (fenced: its queued work done) an accounting period in, so
            # the time it is taken to hold the device, when its worker's CPU is its device work, ends with it.
            if self._idle_timer is not None:
                self._idle_timer.cancel()
            self._idle_timer_gen = self._slice_gen
            self._idle_timer = asyncio.get_running_loop().call_later(self.accounting_period - elapsed,
                                                                     self._idle_timer_over)

    def _idle_timer_over(self) -> None:
        self._idle_timer = None
        self._maybe_switch()

    def _check_leases(self, holder: str) -> None:
        """When the holder's only work in flight is leases: preempt them if its turn is up, else look again then."""
        leases = self._leases.get(holder)
        if not leases or self._use(holder).inflight > len(leases) or self.holder != holder:
            return
        elapsed = self._clock() - self.slice_start
        if self._others_waiting(holder):
            over = self._slice_over()
            for preempt in list(leases):
                preempt(over)
            if over:
                return
            wait = self.quantum - elapsed
            if self._more_deserving_waiter():
                wait = min(wait, max(0.0, self.min_slice - elapsed))
        elif elapsed >= self.accounting_period:
            for preempt in list(leases):
                preempt(True)
            return
        else:
            wait = self.accounting_period - elapsed
        deadline = self._clock() + wait
        if self._lease_timer is None or deadline < self._lease_deadline:
            if self._lease_timer is not None:
                self._lease_timer.cancel()
            self._lease_deadline = deadline
            self._lease_timer = asyncio.get_running_loop().call_later(max(wait, 0.0), self._lease_timer_over)

    def _lease_timer_over(self) -> None:
        self._lease_timer = None
        self._maybe_switch()

    def _slice_over(self) -> bool:
        """The quantum ran out, or a waiting tenant now deserves the device more than the holder.

        The holder's charge for the running slice is estimated from its length (the device is its alone) so a
        more deserving tenant that arrives mid-slice is not kept waiting for the whole quantum.
        """
        elapsed = self._clock() - self.slice_start
        if elapsed >= self.quantum:
            return True
        if elapsed < self.min_slice or self.holder is None:
            return False
        return self._more_deserving_waiter()

    def _more_deserving_waiter(self) -> bool:
        if self.holder is None:
            return False
        held = self.policy.account(self.holder)
        estimate = held.vtime + (self._clock() - self.slice_start) / held.weight
        return any(q and self.policy.account(t).vtime < estimate
                   for t, q in self._waiters.items() if t != self.holder)

    def _grace_over(self) -> None:
        self._grace_timer = None
        self._maybe_switch(expire=True)

    def _cancel_grace(self) -> None:
        if self._grace_timer is not None:
            self._grace_timer.cancel()
            self._grace_timer = None

    def _start_switch(self, holder: str, forfeit: bool = False) -> None:
        self._cancel_grace()
        self._switching = asyncio.get_running_loop().create_task(self._switch(holder, forfeit))

    async def _switch(self, old: str | None, forfeit: bool = False) -> None:
        try:
            if old is not None:
                contended = self._contended_hold(old)
                held_since = self._contended_start()
                gen = self._slice_gen
                fenced_at = self._clock()
                try:
                    seconds = await self._fence(old)
                except Exception as exc:  # a dead worker: its hold was still its own, charged as consumed
                    log.info("fence for tenant %s failed: %s", old, exc)
                    # (until its last call ended, which its death ended: not the grace the scheduler gave it; and
                    # however long the fence waited for its queued work before the death, which held the device
                    # all that time: a kernel launched asynchronously ran past its call, until it was killed)
                    last = self._use(old).last_release
                    until = last if last is not None and last >= self.slice_start else fenced_at
                    seconds = min(self._consumed(self.slice_start),
                                  until - self.slice_start + self._clock() - fenced_at)
                    if self._overran == gen:  # killed for holding the device: that hold was at others' cost
                        contended = self._clock() - held_since
                else:
                    if self._meter is not None:  # the fence's figure is wall time, slowdowns included
                        # ... and the worker's own: never less than the CPU the front saw its worker use of the
                        # device (a first launch's JIT on PoCL is outside the kernel's profiled time; a hostile
                        # worker can report 0), never more than the hold consumed.
                        seconds = min(max(seconds, self._meter().used), self._consumed(self.slice_start))
                if self._meter is not None:
                    contended = min(contended, self._consumed(held_since))
                self._charge(old, seconds, max(seconds, contended))
                self._use(old).held += self._clock() - self.slice_start
            waiting = [t for t, q in self._waiters.items() if q]
            # After the old holder's charge, so newcomers start level with it and with those waiting.
            self.policy.apply_lifts([*waiting, *([old] if old is not None else [])])
            # The old holder's next command is usually a round trip away: if it is still the most deserving,
            # it keeps the device (for idle_grace at least), or the heaviest weights could never use their share.
            recent = (old is not None and not forfeit and old not in waiting
                      and (last_release := self._use(old).last_release) is not None
                      and self._clock() - last_release <= self.idle_grace)
            candidates = [*waiting, old] if recent and old is not None else waiting
            self.holder = self.policy.pick(candidates) if candidates else None
            self.slice_start = self._clock()
            self.contended_since = self.slice_start if any(t != self.holder for t in waiting) else None
            self._slice_gen += 1
            self._new_slice()
        finally:
            self._switching = None
        self.check_overrun()
        if self.holder is not None:
            if self._waiters.get(self.holder):
                self._grant(self.holder)
            else:
                self._maybe_switch()  # starts the grace timer: others wait while the holder's next call comes

    # -- the kernel time limit ----------------------------------------------------------------------
    def _accounting_due(self) -> bool:
        """With a lone-holder limit, the holder is fenced every accounting period even while its calls overlap,
        so its limit measures its work since the last fence rather than its whole stay."""
        return (self.lone_hold > 0 and self.holder is not None and not self._others_waiting(self.holder)
                and self._clock() - self.slice_start >= self.accounting_period)

    def _contended_start(self) -> float:
        """When the current slice began to cost others the device (its start, if nobody has waited yet)."""
        return self.slice_start if self.contended_since is None else max(self.contended_since, self.slice_start)

    def _hold_deadline(self) -> tuple[float, float, str] | None:
        """When the holder's limit began, how long it is, and the message saying which; None: no limit."""
        holder = self.holder
        if holder is None:
            return None
        if self.contended_since is not None and self._others_waiting(holder):
            if self.max_hold <= 0:
                return None
            return (self._contended_start(), self.max_hold,
                    f"device work held the device past max_kernel_seconds = {self.max_hold:g} s while other "
                    "tenants waited; the worker was restarted")
        if self.lone_hold <= 0:
            return None
        return (self.slice_start, self.accounting_period + self.lone_hold,
                f"device work ran past lone_kernel_seconds = {self.lone_hold:g} s; the worker was restarted")

    # -- what a hold consumed ---------------------------------------------------------------------------
    def _new_slice(self) -> None:
        """A slice began (holder, slice_start and _slice_gen are set): the last one's meter goes, this one's
        starts ``meter_after`` from now if the slice lasts that long."""
        self._meter = self._meter_base = None
        if self._meter_timer is not None:
            self._meter_timer.cancel()
            self._meter_timer = None
        if self._hold_meter is not None and self.holder is not None:
            self._meter_timer = asyncio.get_running_loop().call_later(self.meter_after, self._start_meter,
                                                                      self._slice_gen)

    def _start_meter(self, gen: int) -> None:
        self._meter_timer = None
        if gen != self._slice_gen or self.holder is None or self._hold_meter is None:
            return
        self._meter = self._hold_meter(self.holder)
        self._meter_at = self._clock()

    def _consumed(self, since: float) -> float:
        """The device seconds the holder consumed from ``since`` (in the current slice) to now: the meter's
        reading, with any time before the meter started counted as wall time; without a meter, the wall time."""
        now = self._clock()
        meter = self._meter
        if meter is None:
            return now - since
        if self._meter_at >= since:
            return self._meter_at - since + meter().consumed
        base = self._meter_base
        if base is not None and base[0] == since:
            return meter().consumed - base[1]
        return now - since

    def held_seconds(self, tenant: str) -> float:
        """Wall seconds the tenant has held the device, the running slice included."""
        held = self._use(tenant).held
        if self.holder == tenant:
            held += max(0.0, self._clock() - self.slice_start)
        return held

    def charge_outside(self, tenant: str, device_seconds: float) -> None:
        """Charge the tenant for host CPU its worker used outside its turns, in device seconds (on a CPU device that
        CPU is the device; on any device it is taken from the other tenants' workers): its fair-queuing clock, and
        its usage (``device_seconds``, its share)."""
        if device_seconds <= 0:
            return
        self._use(tenant).outside_seconds += device_seconds
        self._charge(tenant, device_seconds, device_seconds)  # (its usage and share show it too)

    def check_overrun(self) -> None:
        """Report a holder past its limit (once per slice), else arm a timer for when it would be."""
        found = self._hold_deadline()
        if found is None or self._overran == self._slice_gen:
            return
        start, length, message = found
        deadline = start + length
        measured = self._measured
        if measured is not None and measured[:2] == (self._slice_gen, start):
            deadline = max(deadline, measured[2])
        now = self._clock()
        if now >= deadline:
            consumed = self._consumed(start)
            if consumed < length:
                # Others slowed it: its own consumption is still under the limit. Look again when it could reach it.
                log.info("tenant %s: %.2f s of its own device time in %.2f s of its hold (others slowed it), "
                         "under its limit of %g s", self.holder, consumed, now - start, length)
                deadline = now + max(length - consumed, self.meter_after)
                self._measured = (self._slice_gen, start, deadline)
        if now >= deadline:
            self._overran = self._slice_gen
            holder = self.holder
            assert holder is not None
            log.warning("tenant %s: %s", holder, message)
            if self._on_overrun is not None:
                self._on_overrun(holder, message)
            return
        if self._watchdog is None or deadline < self._watchdog_at:
            if self._watchdog is not None:
                self._watchdog.cancel()
            self._watchdog_at = deadline
            self._watchdog = asyncio.get_running_loop().call_later(deadline - now, self._watchdog_fired)

    def _watchdog_fired(self) -> None:
        self._watchdog = None
        self.check_overrun()

    def _contended_hold(self, holder: str) -> float:
        """Wall time the holder kept the device while others waited, up to its last release.

        Round trips the holder came back from within its grace kept the device idle but its own (a tenant bound
        by round trips runs tiny kernels on a device nobody else may use), so they count; a trailing grace it
        never used does not, so a light tenant pays for its calls and not for the scheduler's patience.
        """
        last = self._use(holder).last_release
        if self.contended_since is None or last is None:
            return 0.0
        return max(0.0, last - max(self.contended_since, self.slice_start))

    def _grant(self, tenant: str) -> None:
        queue = self._waiters.get(tenant)
        use = self._use(tenant)
        while queue:
            fut = queue.popleft()
            use.queued -= 1
            if not fut.done():
                use.inflight += 1
                fut.set_result(None)

    def _charge(self, tenant: str, seconds: float, fair_seconds: float) -> None:
        """``seconds`` of measured device time (usage, shares); ``fair_seconds`` for the tenant's fair-queuing clock."""
        use = self._use(tenant)
        use.device_seconds += seconds
        use.charges.append((self._clock(), seconds))
        self.policy.charge(tenant, fair_seconds)
