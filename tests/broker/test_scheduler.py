"""The fair scheduler on a virtual clock: shares follow weights, idle credit is bounded, work-conserving."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

import pytest

from gpubroker.broker.front.scheduler import DeviceScheduler, FairPolicy, HoldMeter, Metered, TurnLease
from gpubroker.wire.worker import LeaseToWorker, Want


class Device:
    """A simulated device: work advances a virtual clock; fences report the device time used since the last."""

    def __init__(self) -> None:
        self.now = 0.0
        self.pending: dict[str, float] = {}
        self.fences = 0

    def clock(self) -> float:
        return self.now

    def run(self, tenant: str, seconds: float) -> None:
        self.now += seconds
        self.pending[tenant] = self.pending.get(tenant, 0.0) + seconds

    async def fence(self, tenant: str) -> float:
        self.fences += 1
        return self.pending.pop(tenant, 0.0)


async def _saturate(sched: DeviceScheduler, dev: Device, tenant: str, kernel: float, until: float) -> None:
    while dev.now < until:
        async with sched.turn(tenant):
            dev.run(tenant, kernel)
        await asyncio.sleep(0)  # the client's next call arrives later than the others' waits


def _shares(sched: DeviceScheduler) -> dict[str, float]:
    total = sum(u.device_seconds for u in sched.usage.values())
    return {t: u.device_seconds / total for t, u in sched.usage.items()}


def test_shares_follow_weights_with_mixed_kernel_lengths() -> None:
    async def scenario() -> dict[str, float]:
        dev = Device()
        sched = DeviceScheduler(dev.fence, quantum=0.005, clock=dev.clock)
        weights = {"a": 1, "b": 2, "c": 4}
        kernels = {"a": 0.004, "b": 0.0005, "c": 0.002}  # long, short and middling kernels
        for tenant, weight in weights.items():
            sched.set_weight(tenant, weight)
        await asyncio.gather(*(_saturate(sched, dev, t, kernels[t], until=20.0) for t in weights))
        return _shares(sched)

    shares = asyncio.run(scenario())
    for tenant, target in {"a": 1 / 7, "b": 2 / 7, "c": 4 / 7}.items():
        assert shares[tenant] == pytest.approx(target, rel=0.05), shares


def test_equal_tenants_get_equal_shares() -> None:
    async def scenario() -> dict[str, float]:
        dev = Device()
        sched = DeviceScheduler(dev.fence, quantum=0.005, clock=dev.clock)
        kernels = [0.0001, 0.001, 0.003, 0.0002, 0.002, 0.0007, 0.004, 0.0004]
        await asyncio.gather(*(_saturate(sched, dev, f"t{i}", k, until=10.0) for i, k in enumerate(kernels)))
        return _shares(sched)

    shares = list(asyncio.run(scenario()).values())
    jain = sum(shares) ** 2 / (len(shares) * sum(s * s for s in shares))
    assert jain >= 0.99, shares


def test_idle_credit_is_bounded() -> None:
    """A tenant idle while another ran alone for a long time gets a fair share, not the device, on its return."""

    async def scenario() -> tuple[float, float]:
        dev = Device()
        sched = DeviceScheduler(dev.fence, quantum=0.005, clock=dev.clock)
        await _saturate(sched, dev, "early", 0.001, until=50.0)  # 50 s alone
        before = {t: u.device_seconds for t, u in sched.usage.items()}
        await asyncio.gather(_saturate(sched, dev, "early", 0.001, until=60.0),
                             _saturate(sched, dev, "late", 0.001, until=60.0))
        return (sched.usage["early"].device_seconds - before["early"], sched.usage["late"].device_seconds)

    early, late = asyncio.run(scenario())
    assert early / (early + late) == pytest.approx(0.5, abs=0.05)


def test_newcomers_do_not_get_the_holders_uncharged_slice_as_credit() -> None:
    """A tenant alone for 0.9 s (not yet charged) then joined by 7 others keeps its fair share, not starved."""

    async def scenario() -> dict[str, float]:
        dev = Device()
        sched = DeviceScheduler(dev.fence, quantum=0.005, clock=dev.clock, accounting_period=1.0)
        await _saturate(sched, dev, "first", 0.002, until=0.9)
        before = {"first": sched.usage["first"].device_seconds + dev.pending.get("first", 0.0)}
        await asyncio.gather(*(_saturate(sched, dev, t, 0.002, until=2.5)
                               for t in ["first", *[f"n{i}" for i in range(7)]]))
        used = {t: u.device_seconds - before.get(t, 0.0) for t, u in sched.usage.items()}
        return {t: v / sum(used.values()) for t, v in used.items()}

    shares = asyncio.run(scenario())
    assert shares["first"] == pytest.approx(1 / 8, rel=0.1), shares


def test_a_light_tenant_does_not_drag_newcomers_below_the_tenants_they_join() -> None:
    """A light tenant is busy but never behind the others; newcomers must level with the contending tenants."""

    async def scenario() -> dict[str, float]:
        dev = Device()
        sched = DeviceScheduler(dev.fence, quantum=0.005, clock=dev.clock)

        async def light() -> None:
            while dev.now < 2.5:
                think_until = dev.now + 0.01
                while dev.now < think_until:
                    await asyncio.sleep(0)
                async with sched.turn("light"):
                    dev.run("light", 0.00001)

        async def joining(tenant: str, start: float) -> None:
            while dev.now < start:
                await asyncio.sleep(0)
            await _saturate(sched, dev, tenant, 0.002, until=2.5)

        first = asyncio.create_task(_saturate(sched, dev, "first", 0.002, until=2.5))
        light_task = asyncio.create_task(light())
        while dev.now < 0.3:  # "first" alone (beside the light tenant) for 0.3 s
            await asyncio.sleep(0)
        before = {"first": sched.usage["first"].device_seconds + dev.pending.get("first", 0.0)}
        await asyncio.gather(first, light_task, *(joining(f"n{i}", 0.3) for i in range(6)))
        used = {t: u.device_seconds - before.get(t, 0.0) for t, u in sched.usage.items() if t != "light"}
        return {t: v / sum(used.values()) for t, v in used.items()}

    shares = asyncio.run(scenario())
    assert shares["first"] == pytest.approx(1 / 7, rel=0.15), shares


def test_lone_tenant_never_waits_and_is_rarely_fenced() -> None:
    async def scenario() -> tuple[DeviceScheduler, Device]:
        dev = Device()
        sched = DeviceScheduler(dev.fence, quantum=0.005, clock=dev.clock, accounting_period=1.0)
        await _saturate(sched, dev, "solo", 0.0001, until=10.0)
        return sched, dev

    sched, dev = asyncio.run(scenario())
    assert max(sched.usage["solo"].waits) == 0.0
    assert dev.fences <= 11  # one accounting fence a second, not one per command
    assert sched.usage["solo"].device_seconds == pytest.approx(10.0, abs=1.0)


def test_light_tenant_waits_at_most_quantum_plus_longest_kernel() -> None:
    """A tenant far below its share (a small synchronous launch every 2 ms) is served within one slice."""

    async def scenario() -> list[float]:
        dev = Device()
        sched = DeviceScheduler(dev.fence, quantum=0.005, clock=dev.clock)
        heavy = [asyncio.create_task(_saturate(sched, dev, f"h{i}", 0.003, until=5.0)) for i in range(3)]
        waits = []
        while dev.now < 4.5:
            think_until = dev.now + 0.002
            while dev.now < think_until:  # the light tenant's think time passes as the others run
                await asyncio.sleep(0)
            start = dev.now
            async with sched.turn("light"):
                if start > 0.05:  # past the start, when every tenant's virtual time is still level
                    waits.append(dev.now - start)
                dev.run("light", 0.00001)
        await asyncio.gather(*heavy)
        return waits

    waits = asyncio.run(scenario())
    assert len(waits) > 50
    # One holder's quantum plus one 3 ms kernel: everything the light tenant can be stuck behind.
    assert max(waits) <= 0.005 + 0.003 + 1e-9, max(waits)


def test_a_tenant_bound_by_round_trips_pays_for_the_device_it_keeps_idle() -> None:
    """Tiny kernels with a host round trip each leave the device idle but held; while another tenant waits that
    time is charged, so the waiting tenant gets the device every other slice, not once it out-waits the idler."""

    async def scenario() -> DeviceScheduler:
        dev = Device()
        sched = DeviceScheduler(dev.fence, quantum=0.005, clock=dev.clock)

        async def chatty() -> None:
            while dev.now < 5.0:
                async with sched.turn("chatty"):
                    dev.run("chatty", 0.00001)
                dev.now += 0.0003  # its round trip: the host is busy, the device idle (and still chatty's)
                await asyncio.sleep(0)

        await asyncio.gather(chatty(), _saturate(sched, dev, "long", 0.005, until=5.0))
        return sched

    sched = asyncio.run(scenario())
    long = sched.usage["long"]
    assert long.device_seconds >= 0.4 * 5.0, long.device_seconds  # about half the wall time: alternate slices
    # About one chatty slice at a time (its quantum ends within a round trip), never a long run of them.
    assert max(long.waits) <= 2 * 0.005, sorted(long.waits)[-5:]


def test_disabled_scheduler_passes_everything_through() -> None:
    async def scenario() -> int:
        dev = Device()
        sched = DeviceScheduler(dev.fence, enabled=False, clock=dev.clock)
        await asyncio.gather(*(_saturate(sched, dev, t, 0.001, until=1.0) for t in "ab"))
        return dev.fences

    assert asyncio.run(scenario()) == 0


def test_cancelled_waiter_leaves_no_trace() -> None:
    async def scenario() -> DeviceScheduler:
        dev = Device()
        sched = DeviceScheduler(dev.fence, quantum=0.005, clock=dev.clock)
        hold = asyncio.Event()

        async def holder() -> None:
            async with sched.turn("a"):
                await hold.wait()

        task = asyncio.create_task(holder())
        await asyncio.sleep(0)
        waiter = asyncio.create_task(_saturate(sched, dev, "b", 0.001, until=0.01))
        await asyncio.sleep(0)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        hold.set()
        await task
        async with sched.turn("b"):  # b is served again, and nothing of the cancelled wait lingers
            pass
        return sched

    sched = asyncio.run(scenario())
    assert sched.usage["b"].queued == 0 and sched.usage["b"].inflight == 0


def test_policy_picks_least_weighted_time() -> None:
    policy = FairPolicy()
    for tenant, weight in (("a", 1), ("b", 3)):
        policy.set_weight(tenant, weight)
        policy.arrive(tenant, ["a", "b"], 0.0)
    policy.charge("a", 1.0)
    policy.charge("b", 2.0)
    assert policy.pick(["a", "b"]) == "b"  # 2/3 < 1/1
    policy.charge("b", 2.0)
    assert policy.pick(["a", "b"]) == "a"


class StuckDevice(Device):
    """A device whose work can hang (an endless kernel): a hung tenant's fence and calls end only when it is
    killed, as a killed worker's would, with the error the front gives them."""

    def __init__(self) -> None:
        super().__init__()
        self.killed: dict[str, str] = {}
        self.hung: dict[str, asyncio.Future[None]] = {}

    def hang(self, tenant: str) -> asyncio.Future[None]:
        self.hung[tenant] = asyncio.get_running_loop().create_future()
        return self.hung[tenant]

    def kill(self, tenant: str, message: str) -> None:
        self.killed[tenant] = message
        hung = self.hung.pop(tenant, None)
        if hung is not None and not hung.done():
            hung.set_exception(RuntimeError(message))

    async def fence(self, tenant: str) -> float:
        if tenant in self.hung:
            await self.hung[tenant]
        return await super().fence(tenant)


async def _settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


def test_a_holder_past_the_kernel_limit_while_others_wait_is_killed_and_the_waiter_goes_on() -> None:
    async def scenario() -> None:
        dev = StuckDevice()
        sched = DeviceScheduler(dev.fence, quantum=0.005, clock=dev.clock, max_hold=2.0, on_overrun=dev.kill)
        hung = dev.hang("a")

        async def endless() -> str:
            async with sched.turn("a"):  # a synchronous call into a kernel that never ends
                try:
                    await hung
                except RuntimeError as exc:
                    return str(exc)
            return "finished"

        a = asyncio.ensure_future(endless())
        await _settle()
        dev.now = 5.0  # alone, it may run as long as it likes (lone_hold 0)
        sched.check_overrun()
        assert not dev.killed
        b_waited: list[float] = []

        async def light() -> None:
            start = dev.now
            async with sched.turn("b"):
                b_waited.append(dev.now - start)

        b = asyncio.ensure_future(light())
        await _settle()
        dev.now = 6.9  # b has waited 1.9 s of the 2 s limit
        sched.check_overrun()
        await _settle()
        assert not dev.killed and not b.done()
        dev.now = 7.0
        sched.check_overrun()
        await _settle()
        assert "max_kernel_seconds = 2 s" in dev.killed["a"]
        assert "max_kernel_seconds = 2 s" in await a
        await b
        assert b_waited == [pytest.approx(2.0)]
        # The killed holder is charged the hold it made others wait through, not nothing.
        assert sched.policy.account("a").vtime >= 2.0

    asyncio.run(scenario())


def test_a_fence_that_hangs_while_others_wait_is_killed_too() -> None:
    async def scenario() -> None:
        dev = StuckDevice()
        sched = DeviceScheduler(dev.fence, quantum=0.005, clock=dev.clock, max_hold=1.0, on_overrun=dev.kill)
        async with sched.turn("a"):  # an asynchronous launch: the call returns, the kernel runs on
            dev.hang("a")
        served = asyncio.Event()

        async def light() -> None:
            async with sched.turn("b"):
                served.set()

        b = asyncio.ensure_future(light())
        await _settle()  # the switch is fencing a, whose kernel never ends
        assert not served.is_set()
        dev.now = 1.5
        sched.check_overrun()
        await _settle()
        await b
        assert served.is_set() and "max_kernel_seconds = 1 s" in dev.killed["a"]

    asyncio.run(scenario())


def test_a_lone_holder_is_limited_only_by_lone_kernel_seconds() -> None:
    async def scenario() -> None:
        dev = StuckDevice()
        sched = DeviceScheduler(dev.fence, quantum=0.005, clock=dev.clock, max_hold=1.0, lone_hold=3.0,
                                on_overrun=dev.kill, accounting_period=1.0)
        hung = dev.hang("a")

        async def endless() -> None:
            async with sched.turn("a"):
                with contextlib.suppress(RuntimeError):
                    await hung

        a = asyncio.ensure_future(endless())
        await _settle()
        dev.now = 3.9  # its slice's accounting period (1 s) plus 2.9 s: within lone_kernel_seconds
        sched.check_overrun()
        assert not dev.killed
        dev.now = 4.0
        sched.check_overrun()
        await a
        assert "lone_kernel_seconds = 3 s" in dev.killed["a"]

    asyncio.run(scenario())


def test_the_limit_is_enforced_by_the_schedulers_own_timer() -> None:
    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        sched = DeviceScheduler(StuckDevice().fence, quantum=0.005, clock=loop.time, max_hold=0.2)
        killed: list[str] = []
        release = asyncio.Event()
        sched._on_overrun = lambda tenant, message: (killed.append(tenant), release.set())

        async def holder() -> None:
            async with sched.turn("a"):
                await release.wait()

        a = asyncio.ensure_future(holder())
        await asyncio.sleep(0)
        start = loop.time()
        async with sched.turn("b"):  # no one calls check_overrun: the watchdog timer must
            waited = loop.time() - start
        await a
        assert killed == ["a"] and 0.2 <= waited < 1.0

    asyncio.run(scenario())


def test_a_worker_that_keeps_its_leased_turn_past_the_limit_is_killed() -> None:
    async def scenario() -> None:
        dev = StuckDevice()
        sent: list[str] = []
        lease: TurnLease | None = None

        def kill(tenant: str, message: str) -> None:
            dev.killed[tenant] = message
            assert lease is not None
            lease.close()  # what the worker's death does (WorkerClient.on_death)

        sched = DeviceScheduler(dev.fence, quantum=0.005, clock=dev.clock, max_hold=1.0, on_overrun=kill)

        async def send(message: LeaseToWorker) -> None:
            sent.append(type(message).__name__.lower())

        lease = TurnLease(sched, "a", send)
        lease.on_message(Want())  # the worker's direct link runs a kernel that never ends: it never says "released"
        await _settle()
        assert sent == ["grant"]
        served = asyncio.Event()

        async def light() -> None:
            async with sched.turn("b"):
                served.set()

        b = asyncio.ensure_future(light())
        dev.now = 0.01
        await _settle()
        assert "yield" in sent or "revoke" in sent  # asked to give the turn back...
        dev.now = 0.99
        sched.check_overrun()
        await _settle()
        assert not served.is_set() and not dev.killed
        dev.now = 1.01  # ...and a second after b began to wait (at 0.01), it has not
        sched.check_overrun()
        await b
        assert "max_kernel_seconds = 1 s" in dev.killed["a"]

    asyncio.run(scenario())


def _metered(loop: asyncio.AbstractEventLoop, rates: dict[str, float]) -> HoldMeter:
    """A hold meter whose holder consumes the device at ``rates[tenant]`` device seconds per second (1: alone;
    below 1: slowed by others' use of a CPU device); None (wall time) for a tenant without a rate."""

    def start(tenant: str) -> Callable[[], Metered] | None:
        if tenant not in rates:
            return None
        began = loop.time()
        return lambda: Metered((loop.time() - began) * rates[tenant], (loop.time() - began) * rates[tenant])

    return start


@pytest.mark.parametrize("rate", [1.0, 0.25])
def test_the_limit_counts_the_holders_own_consumption_not_its_slowdown(rate: float) -> None:
    """A holder slowed by others (a quarter of the device: rate 0.25) reaches its limit four times later in wall time
    and is charged what it consumed, not the wall time others made it take."""

    async def scenario() -> tuple[float, float]:
        loop = asyncio.get_running_loop()
        dev = StuckDevice()

        async def fence(tenant: str) -> float:  # (a killed worker's fence fails, as the front's does)
            if tenant in dev.killed:
                raise RuntimeError("the worker is gone")
            return await dev.fence(tenant)

        sched = DeviceScheduler(fence, quantum=0.005, clock=loop.time, max_hold=0.2, meter_after=0.02,
                                hold_meter=_metered(loop, {"a": rate}), on_overrun=dev.kill)
        hung = dev.hang("a")

        async def holder() -> None:
            async with sched.turn("a"):
                with contextlib.suppress(RuntimeError):
                    await hung

        a = asyncio.ensure_future(holder())
        await asyncio.sleep(0.05)  # (the meter starts 20 ms into the slice)
        start = loop.time()
        async with sched.turn("b"):
            waited = loop.time() - start
        await a
        assert list(dev.killed) == ["a"]
        return waited, sched.usage["a"].device_seconds

    waited, charged = asyncio.run(scenario())
    assert 0.2 / rate <= waited < 0.2 / rate + 0.5, waited
    # (killed: its hold is charged though its worker died; what it consumed, at its rate, since the slice began)
    assert charged == pytest.approx(0.02 + rate * (0.05 + waited - 0.02), abs=0.05), (charged, waited)


def test_a_dead_workers_hold_is_charged() -> None:
    async def scenario() -> float:
        loop = asyncio.get_running_loop()

        async def fence(tenant: str) -> float:
            if tenant == "a":
                raise RuntimeError("the worker is gone")
            return 0.0

        sched = DeviceScheduler(fence, quantum=0.005, clock=loop.time)
        async with sched.turn("a"):
            await asyncio.sleep(0.1)  # its kernel ran 0.1 s, then its worker died
        async with sched.turn("b"):
            pass
        return sched.usage["a"].device_seconds

    assert asyncio.run(scenario()) == pytest.approx(0.1, abs=0.05)


def test_work_running_past_its_call_is_charged_until_its_worker_dies() -> None:
    """A kernel launched asynchronously returns at once and runs on; a fence waits for it, and the worker is killed
    while it waits (a cancel, the time limit): the tenant is charged the time its kernel held the device, not the
    moment its launch took."""

    async def scenario() -> float:
        loop = asyncio.get_running_loop()

        async def fence(tenant: str) -> float:
            if tenant == "a":
                await asyncio.sleep(0.3)  # its kernel still runs...
                raise RuntimeError("the worker is gone")  # ...until its worker is killed
            return 0.0

        sched = DeviceScheduler(fence, quantum=0.005, clock=loop.time)
        async with sched.turn("a"):
            pass  # the launch returned at once
        async with sched.turn("b"):
            pass
        return sched.usage["a"].device_seconds

    assert asyncio.run(scenario()) == pytest.approx(0.3, abs=0.1)


def test_an_idle_lone_holder_is_fenced_and_gives_the_device_up() -> None:
    """With fence_idle, a lone holder's hold ends (fenced) an accounting period after its last work: the time it
    counts as holding the device, when its worker's CPU is device work, ends with its work."""

    async def scenario() -> tuple[str | None, float, int]:
        loop = asyncio.get_running_loop()
        dev = Device()
        sched = DeviceScheduler(dev.fence, quantum=0.005, clock=loop.time, accounting_period=0.1, fence_idle=True)
        async with sched.turn("a"):
            pass
        await asyncio.sleep(0.3)
        held = sched.held_seconds("a")
        await asyncio.sleep(0.2)
        assert sched.held_seconds("a") == held  # no longer holding: its held time stopped
        return sched.holder, held, dev.fences

    holder, held, fences = asyncio.run(scenario())
    assert holder is None and fences == 1 and 0.1 <= held < 0.25, (holder, held, fences)
