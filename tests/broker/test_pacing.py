"""Pacing (worker/_pacing.py) on a real device: while others want the device, long kernels go one at a time, so
the fence after a turn waits for one kernel at most; pacing lasts a while after the last sign of others."""

from __future__ import annotations

import numpy as np

from gpubroker.broker import samples
from gpubroker.broker.backends import open_backend
from gpubroker.broker.worker._pacing import PACE_HOLD, Pacer
from tests.helpers import spin_iterations


def test_long_kernels_are_paced_one_at_a_time_and_the_front_is_asked_before_each(backend: str) -> None:
    asked: list[int] = []  # how many paced launches were unfinished each time the front was asked

    def front_waiting() -> bool:
        assert pacer is not None
        asked.append(pacer.unfinished)
        return False

    with open_backend(backend, 0) as gpu:
        spin = gpu.compile_kernel(samples.source(backend), "spin")
        buf = gpu.allocate_memory(4)
        iters = spin_iterations(gpu, spin, buf, 0.005)
        pacer = Pacer.for_backend(gpu, front_waiting)
        assert pacer is not None
        pacer.others_waited()
        for _ in range(4):
            assert pacer.before() is False
            gpu.execute_kernel(spin, 1, 1, [buf, np.int64(iters)])
            pacer.after(None)
        # Before each launch the one before it was waited for: never two of these kernels queued.
        assert asked == [0, 0, 0, 0]
        assert (pacer.depth, pacer.unfinished) == (1, 1)
        gpu.synchronize()


def test_pacing_lasts_a_while_after_others_waited(backend: str) -> None:
    now = [100.0]
    with open_backend(backend, 0) as gpu:
        pacer = Pacer(gpu.mark, gpu.wait_mark, lambda: False, clock=lambda: now[0])
        assert not pacer.active  # a lone tenant is never paced
        pacer.others_waited()
        now[0] += PACE_HOLD * 0.99
        assert pacer.active
        now[0] += PACE_HOLD * 0.02
        assert not pacer.active
