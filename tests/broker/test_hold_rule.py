"""The rule a PoCL hold's device time follows (front/workers/_cpu.py), on readings made up to the point.

The real attacks run through a broker in tests/security/test_sleeping_hold_on_a_busy_host.py (a sleeping kernel)
and test_time_limit_cause.py (a victim slowed by another's burners); these pin the arithmetic between them.
"""

from __future__ import annotations

from gpubroker.broker.front.workers import CpuReading, hold_seconds

UNITS = NCPU = 2
SLOWDOWN = 2.0


def _hold(wall: float, cpu: float, host_busy: float, threads: dict[int, tuple[float, float]],
          slowdown: float = SLOWDOWN) -> float:
    start = CpuReading(at=100.0, cpu=5.0, threads={tid: (1.0, 1.0) for tid in threads}, host_busy=50.0)
    end = CpuReading(at=100.0 + wall, cpu=5.0 + cpu,
                     threads={tid: (1.0 + run, 1.0 + delay) for tid, (run, delay) in threads.items()},
                     host_busy=50.0 + host_busy)
    return hold_seconds(start, end, UNITS, NCPU, slowdown)


def test_a_kernel_whose_threads_others_slow_is_charged_its_own_work() -> None:
    # Two work-items' threads, each 2 s of work, on a host where others took a third of the CPUs: 3 s of wall;
    # the worker's serving thread waits for the kernel (blocked: it never wanted a CPU).
    assert _hold(3.0, 4.0, 6.0, {1: (2.0, 1.0), 2: (2.0, 1.0), 3: (0.0, 0.0)}) == 2.0


def test_a_sleeping_kernel_is_charged_its_wall_time_however_busy_the_host() -> None:
    # One thread sleeps 10 s; the worker's event loop woke a few times and waited for a CPU each time (before the
    # fix its delay / (run + delay), near 1, took the whole hold off); others kept both CPUs busy throughout.
    charged = _hold(10.0, 0.001, 20.0, {1: (0.0, 0.0), 2: (0.001, 0.05)})
    assert charged > 9.9, charged


def test_a_spinning_thread_discounts_only_its_own_compute_units_share() -> None:
    # Beside the sleeper, a thread spins until the same deadline and gets 3 s of CPU in 10 s: its 7 s of waiting
    # take 3.5 s off the hold (its unit's share), not 7 s.
    assert _hold(10.0, 3.0, 20.0, {1: (0.0, 0.0), 2: (3.0, 7.0)}, slowdown=10.0) == 6.5


def test_no_load_stretches_a_hold_past_max_kernel_slowdown() -> None:
    # Many spinning threads (a kernel can clone them) waiting on a saturated host look like an honest kernel slowed
    # by others: the discount stops at wall / max_kernel_slowdown.
    spinners = {tid: (0.1, 9.9) for tid in range(2, 12)}
    assert _hold(10.0, 1.0, 20.0, {1: (0.0, 0.0), **spinners}) == 5.0
    assert _hold(10.0, 1.0, 20.0, {1: (0.0, 0.0), **spinners}, slowdown=1.0) == 10.0
