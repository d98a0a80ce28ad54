"""On a CPU device (PoCL), a tenant's compiles are charged to it: they take the device's own CPUs.

The hole (closed): a compile (``LoadModule``) takes no device turn, and the CPU watch allowed the CPU of the worker's
serving thread while it served one (``_cpuwatch.py``), so none of it reached the tenant's fair share or its usage,
and nothing bounds it past ``compile_timeout_seconds`` (60 s) per compile: a tenant may compile distinct sources
back to back forever. On PoCL the device *is* the host's CPUs, so that CPU was taken from every other tenant's
kernels while the attacker's fair-share clock stood still. Measured before the fix (PoCL, 2 shared cores): 15 s of
back-to-back compiles of a small macro-expanded source used 15.1 CPU-seconds (a full CPU) of the attacker's worker;
``Usage`` charged it 0.0 device-seconds; another tenant's 1.0 s kernel took 1.3-2.8 s meanwhile.

The fix: on a CPU device the watch charges a compile's CPU (the serving thread's) to the tenant's fair-queuing clock
and usage like the rest of its worker's CPU outside its turns, over the compute units; it still never counts towards
``max_cpu_seconds_outside_turns`` (a compile is bounded by ``compile_timeout_seconds``).
"""

from __future__ import annotations

import os
import time

from gpubroker.broker.launcher import BrokerProcess, TenantSpec
from gpubroker.client import AdminClient, connect

from ..conftest import worker_pids
from ..helpers import wait_for
from .exploits import COMPILE_BOMB
from .test_time_limit_cause import _tree_cpu

SECONDS = 4.0


def test_compile_cpu_is_charged_to_the_tenant() -> None:
    tenants = [TenantSpec("ops", admin=True), TenantSpec("mallory")]
    with BrokerProcess(tenants, backend="opencl") as broker, \
            connect(broker.target, token=broker.tokens["mallory"], device=0) as mallory, \
            AdminClient(broker.target, broker.tokens["ops"]) as admin:

        def charged() -> float:
            return {u.tenant: u.device_seconds for u in admin.usage(window_seconds=600).tenants}.get("mallory", 0.0)

        # (no device work: mallory never holds the device, whose turns are charged at their fences)
        [worker] = worker_pids(broker, "mallory")
        charged_before, before = charged(), _tree_cpu(worker)
        end, n = time.monotonic() + SECONDS, 0
        while time.monotonic() < end:
            mallory.compile_kernel(COMPILE_BOMB.replace("SEED", f"{n}.0f + {os.getpid()}.0f"), "k")
            n += 1
        used = _tree_cpu(worker) - before
        assert used > 1.0, used  # (the attack ran)
        # On a CPU device, CPU-seconds over its compute units are device-seconds: at least a quarter of it. (The
        # CPU watch charges what it saw at its next look, every half second.)
        floor = used / len(os.sched_getaffinity(0)) / 4
        try:
            wait_for(lambda: charged() - charged_before >= floor, 10.0, "the compiles' charge")
        finally:
            print(f"\n{n} compiles in {SECONDS:g} s: mallory's worker used {used:.1f} CPU-s, charged "
                  f"{charged() - charged_before:.2f} s (at least {floor:.2f} expected)")
