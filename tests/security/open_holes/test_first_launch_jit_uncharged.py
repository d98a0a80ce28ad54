"""On PoCL, the device work a kernel's first launch does (PoCL's JIT of its work-group function) is never charged.

The hole: a hold's charge is the worker's own report (``take_device_time``: OpenCL profiling of its commands, plus
what its library and torch operators time themselves), only bounded by the front's meter (``_device.py``:
``seconds = min(report, consumed)``); the fair-queuing clock gets ``max(seconds, contended)``, the wall time while
another tenant waited. So whatever the report leaves out is free while nobody waits, and missing from Usage and
``gpubroker_device_seconds`` always. PoCL builds a kernel's work-group function at its first launch (and again
for each new local size), inside the launch's turn but outside the kernel's profiled duration: a large kernel's
first launch runs for many CPU-seconds that the report calls ~0. (A hostile worker can report 0 for everything;
this needs no exploit at all.) On PoCL the device *is* the host's CPUs, which that JIT takes.

Measured (PoCL, 2 shared cores, mallory alone): a 10,000-statement kernel (1.5 s to compile, itself uncharged:
test_compile_cpu_uncharged.py) whose first launch took 19-21 s and 19-20 CPU-seconds of mallory's worker; three of
them, ~60 CPU-seconds: Usage charged mallory 0.000 device-seconds (this test, one: 18.6 CPU-s, 0.000 charged).
The client uses the gRPC transport: over its link (the SDK's default) the same first launch killed the worker with
SIGSEGV in 3 runs of 3 (the JIT on the link's executor thread; a separate bug, charged to the tenant as its crash).

Suggested fix: on a CPU device charge the front's own meter (``consumed``: the worker tree's CPU over the compute
units, less what others took), never less, instead of the worker's report; on any device, never let a worker's
report lower a charge the front can measure itself (the hold's wall time without a meter).
"""

from __future__ import annotations

import os
import time

from gpubroker.broker.launcher import BrokerProcess, TenantSpec
from gpubroker.client import AdminClient, connect

from ...conftest import worker_pids
from ..test_time_limit_cause import _tree_cpu
from .test_compile_cpu_uncharged import BOMB

# 10,000 statements (test_compile_cpu_uncharged's): ~20 s of PoCL's JIT at the first launch, ~1.5 s to compile
SOURCE = BOMB
LAUNCHES = 1


def test_a_kernels_first_launch_is_charged_to_its_tenant() -> None:
    tenants = [TenantSpec("ops", admin=True), TenantSpec("mallory")]
    with BrokerProcess(tenants, backend="opencl") as broker, \
            connect(broker.target, token=broker.tokens["mallory"], device=0, transport="grpc") as mallory, \
            AdminClient(broker.target, broker.tokens["ops"]) as admin:
        scratch = mallory.allocate_memory(4096)
        [worker] = worker_pids(broker, "mallory")
        kernels = [mallory.compile_kernel(SOURCE.replace("SEED", f"{n + 7}.5f"), "k") for n in range(LAUNCHES)]
        time.sleep(1.5)
        charged_before = {u.tenant: u.device_seconds for u in admin.usage(window_seconds=600).tenants}.get(
            "mallory", 0.0)
        before = _tree_cpu(worker)
        for kernel in kernels:
            mallory.execute_kernel(kernel, 1, 1, [scratch])
            mallory.synchronize()
        used = _tree_cpu(worker) - before
        time.sleep(1.5)  # (the next fence and CPU watch)
        charged = {u.tenant: u.device_seconds for u in admin.usage(window_seconds=600).tenants}.get(
            "mallory", 0.0) - charged_before
        print(f"\n{LAUNCHES} first launches: mallory's worker used {used:.1f} CPU-s, charged {charged:.3f} s")
        assert used > 3.0, used  # (the JIT ran)
        # Device-seconds on a CPU device are CPU-seconds over its compute units: at least a quarter of that.
        assert charged >= used / len(os.sched_getaffinity(0)) / 4, (
            f"mallory's first launches used {used:.1f} CPU-seconds of the PoCL device (the host's CPUs) in its own "
            f"turns and were charged {charged:.3f} device-seconds")
