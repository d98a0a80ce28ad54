"""A sleeping kernel holds the device past ``max_kernel_seconds`` once the host is busy.

The hole: on PoCL a hold's device time is ``max(cpu / units, wall - min(others / ncpu, wall * delay / (run +
delay)))`` (front/workers/_cpu.py), with ``delay / (run + delay)`` taken over *all* the worker's threads. A kernel
whose work-item 0 sleeps (it holds the device and uses no CPU, never slowed) while work-item 1 spins (a thread that
is always waiting for a CPU on a busy host) makes the whole hold look "slowed by others": once the host's CPUs are
busy with anything outside the worker (here the attacker's own client-side processes, each a session of its own,
as a same-host container's would be; on a shared host, anyone's load), its wall time is discounted almost to
nothing and the time limit never fires while another tenant waits.

Measured (2 shared cores, 6 client-side burners): a 30 s sleep held the device the whole 30 s, bob's 16-item
launch waited 28.7 s against max_kernel_seconds = 10 and alice's kernel completed, no DEADLINE_EXCEEDED. Without
the burners the same hold is killed at 10.1 s. The spinner is not even needed: a lone sleeping work-item on the
same busy host held 28.6 s too (the worker's other threads, which wake rarely and then wait for a CPU, make
``delay / (run + delay)`` near 1), so any tenant's sleeping (or blocked) kernel escapes the limit whenever the host
is saturated by anyone. (Writing 19 to /proc/self/autogroup, to starve the spinner without outside load, is
refused: EACCES.)

Suggested fix: discount a hold only by the slowdown of threads that were doing the hold's device work, never let
a thread that waits for a CPU lend that wait to a thread that sleeps: e.g. count, per thread, ``wall - delay`` and
take the hold's consumption as the largest of those (a sleeping thread's is its whole wall time), or charge at
least ``wall - others_on_the_worker's_CPUs`` measured per thread from schedstat; and cap the discount (a hold is
never charged less than, say, half its wall time while others wait), so a contended host stretches the limit at
most 2x.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import numpy as np

from gpubroker.broker.launcher import BrokerProcess, TenantSpec
from gpubroker.client import connect

from ..exploits import SYSCALL_SOURCE

HOLD = 30
LIMIT = 10.0
SOURCE = SYSCALL_SOURCE + r"""
__kernel void hold(__global long* s, long secs) {
    if (get_global_id(0) == 0) {                      /* the hold: sleep, no CPU */
        s[8] = secs; s[9] = 0;
        s[0] = sys6(35, (long)&s[8], 0, 0, 0, 0, 0);  /* nanosleep */
    } else {                                          /* the "slowdown": a thread that always wants a CPU */
        sys6(228, 1, (long)&s[40], 0, 0, 0, 0);       /* clock_gettime(CLOCK_MONOTONIC) */
        long end = s[40] + secs;
        while (1) { sys6(228, 1, (long)&s[42], 0, 0, 0, 0); if (s[42] >= end) break; }
    }
}
"""
VICTIM = r"__kernel void tiny(__global int* x) { x[get_global_id(0)] += 1; }"
BURN = "import time\nt = time.time() + %f\nwhile time.time() < t: pass"


def test_a_sleeping_kernel_is_held_to_the_time_limit_on_a_busy_host() -> None:
    with BrokerProcess([TenantSpec("alice"), TenantSpec("bob")], backend="opencl",
                       settings={"max_kernel_seconds": LIMIT}) as broker:
        alice = connect(broker.target, token=broker.tokens["alice"])
        bob = connect(broker.target, token=broker.tokens["bob"])
        hold = alice.compile_kernel(SOURCE, "hold")
        tiny = bob.compile_kernel(VICTIM, "tiny")
        scratch, out = alice.allocate_memory(4096), bob.allocate_memory(64)
        bob.execute_kernel(tiny, 16, 16, [out])
        bob.synchronize()
        # The attacker's client-side load, outside the broker: six processes, each a session (an autogroup) of its own.
        burners = [subprocess.Popen([sys.executable, "-c", BURN % (HOLD + 3)], start_new_session=True)
                   for _ in range(6)]
        try:
            def attack() -> None:
                try:
                    alice.execute_kernel(hold, 2, 1, [scratch, np.int64(HOLD)])
                    alice.synchronize()
                except Exception:
                    pass

            attacker = threading.Thread(target=attack)
            attacker.start()
            time.sleep(1.5)
            start = time.monotonic()
            bob.execute_kernel(tiny, 16, 16, [out])
            bob.synchronize()
            waited = time.monotonic() - start
            attacker.join()
        finally:
            for p in burners:
                p.kill()
                p.wait()
        assert waited < LIMIT + 5, (f"bob's 16-item launch waited {waited:.1f} s behind alice's sleeping kernel, "
                                    f"max_kernel_seconds = {LIMIT:g}")
