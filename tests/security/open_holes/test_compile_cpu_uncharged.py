"""A tenant's compiles burn host CPU that is never charged to it: on PoCL, the device's own CPUs, for free.

The hole: a compile (``LoadModule``) takes no device turn, and the CPU watch allows the CPU of the worker's serving
thread while it serves one (``_cpuwatch.py``: "a long compile not charged"), so none of it reaches the tenant's fair
share or its usage, and nothing bounds it past ``compile_timeout_seconds`` (60 s) per compile: a tenant may compile
distinct sources back to back forever. On PoCL the device *is* the host's CPUs, so that CPU is taken from every
other tenant's kernels while the attacker's fair-share clock stands still (it keeps winning turns too).

Measured (PoCL, 2 shared cores): 15 s of back-to-back compiles of a small macro-expanded source (each a distinct
kernel: the seed is in the code, PoCL's cache keys the preprocessed source) used 15.1 CPU-seconds (a full CPU) of
the attacker's worker; ``Usage`` charged mallory 0.0 device-seconds; alice's 1.0 s kernel took 1.3-2.8 s
meanwhile (8.9 s for the one that overlapped a 9 s compile).

Suggested fix: charge a compile's CPU (the serving thread's, as the watch already measures it) to the tenant's
fair-queuing clock like the rest of its worker's CPU (on a CPU device, over its compute units), and give compiles
a per-tenant budget (CPU-seconds of compiling per window), or run them under a turn on CPU devices.
"""

from __future__ import annotations

import os
import time

from gpubroker.broker.launcher import BrokerProcess, TenantSpec
from gpubroker.client import AdminClient, connect

from ...conftest import worker_pids
from ..test_time_limit_cause import _tree_cpu

SECONDS = 15.0
# Each statement distinct per compile (a seed in the code, not a comment: PoCL keys its cache on the preprocessed
# source); 10,000 statements from a few hundred bytes of macros, a second or more of clang each.
BOMB = r"""
#define A v = v * 1.0001f + (float)i + SEED; i = i ^ (int)v;
#define B A A A A A A A A A A
#define C B B B B B B B B B B
#define D C C C C C C C C C C
#define E D D D D D D D D D D
__kernel void k(__global float* x) { float v = x[0]; int i = get_global_id(0); E x[get_global_id(0)] = v + (float)i; }
"""


def test_compile_cpu_is_charged_to_the_tenant() -> None:
    tenants = [TenantSpec("ops", admin=True), TenantSpec("mallory")]
    with BrokerProcess(tenants, backend="opencl", settings={"tenant_crash_budget": 100}) as broker, \
            connect(broker.target, token=broker.tokens["mallory"], device=0) as mallory, \
            AdminClient(broker.target, broker.tokens["ops"]) as admin:
        mallory.allocate_memory(8)
        [worker] = worker_pids(broker, "mallory")
        before = _tree_cpu(worker)
        end, n = time.monotonic() + SECONDS, 0
        while time.monotonic() < end:
            mallory.compile_kernel(BOMB.replace("SEED", f"{n}.0f + {os.getpid()}.0f"), "k")
            n += 1
        time.sleep(1.5)  # (the CPU watch's next look)
        used = _tree_cpu(worker) - before
        charged = {u.tenant: u.device_seconds for u in admin.usage(window_seconds=120).tenants}.get("mallory", 0.0)
        print(f"\n{n} compiles in {SECONDS:g} s: mallory's worker used {used:.1f} CPU-s, charged {charged:.2f} s")
        assert used > 3.0, used  # (the attack ran)
        # On a CPU device, CPU-seconds over its compute units (2 here) are device-seconds: at least a quarter of it.
        assert charged >= used / len(os.sched_getaffinity(0)) / 4, (
            f"mallory's compiles used {used:.1f} CPU-seconds of the host (the PoCL device's CPUs) and were charged "
            f"{charged:.2f} device-seconds")
