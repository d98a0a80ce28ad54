"""On PoCL, the device work a kernel's first launch does (PoCL's JIT of its work-group function) is charged.

The hole (closed): a hold's charge was the worker's own report (``take_device_time``: OpenCL profiling of its
commands, plus what its library and torch operators time themselves), only bounded by the front's meter
(``seconds = min(report, consumed)``), so whatever the report left out was free while nobody waited, and missing
from Usage and ``gpubroker_device_seconds`` always. PoCL builds a kernel's work-group function at its first launch
(and again for each new local size), inside the launch's turn but outside the kernel's profiled duration: a large
kernel's first launch ran for many CPU-seconds that the report called ~0 (and a hostile worker can report 0 for
everything). Measured before the fix (PoCL, 2 shared cores): a 10,000-statement kernel's first launch used 18.6
CPU-seconds of its worker and was charged 0.000 device-seconds.

The fix: on a CPU device the hold meter (front/_server.py ``_hold_meter``) also reads the worker tree's own CPU over
the device's compute units, and a metered hold is charged at least that (at most what the hold consumed), whatever
the worker reports (scheduler/_device.py). Over the SDK's default transport, its link: the first launch's JIT runs
there as well (a SIGSEGV once seen at this point was the kernel's own out-of-bounds write, since fixed in it).
"""

from __future__ import annotations

import contextlib
import os

from gpubroker.broker.launcher import BrokerProcess, TenantSpec
from gpubroker.client import AdminClient, connect

from ..conftest import worker_pids
from ..helpers import wait_for
from .exploits import COMPILE_BOMB
from .test_time_limit_cause import _tree_cpu


def test_a_kernels_first_launch_is_charged_to_its_tenant() -> None:
    tenants = [TenantSpec("ops", admin=True), TenantSpec("mallory")]
    with BrokerProcess(tenants, backend="opencl") as broker, \
            connect(broker.target, token=broker.tokens["mallory"], device=0) as mallory, \
            AdminClient(broker.target, broker.tokens["ops"]) as admin:

        def charged() -> float:
            return {u.tenant: u.device_seconds for u in admin.usage(window_seconds=600).tenants}.get("mallory", 0.0)

        scratch = mallory.allocate_memory(4096)
        [worker] = worker_pids(broker, "mallory")
        kernel = mallory.compile_kernel(COMPILE_BOMB.replace("SEED", f"{os.getpid() % 1000}.5f"), "k")
        mallory.synchronize()
        # The compile's own CPU is charged too (test_compile_cpu_charged.py), at the CPU watch's next look: not
        # in what this test counts. (Where compiles are not charged, nothing comes.)
        with contextlib.suppress(AssertionError):
            wait_for(lambda: charged() > 0, 5.0, "the compile's charge")
        charged_before, before = charged(), _tree_cpu(worker)
        mallory.execute_kernel(kernel, 1, 1, [scratch])
        mallory.synchronize()
        used = _tree_cpu(worker) - before
        assert used > 1.0, used  # (the JIT ran)
        # Device-seconds on a CPU device are CPU-seconds over its compute units: at least a quarter of that. (The
        # hold's charge comes with its fence: once its slice ends.)
        floor = used / len(os.sched_getaffinity(0)) / 4
        try:
            wait_for(lambda: charged() - charged_before >= floor, 10.0, "the first launch's charge")
        finally:
            print(f"\nfirst launch: mallory's worker used {used:.1f} CPU-s, charged "
                  f"{charged() - charged_before:.3f} s (at least {floor:.3f} expected)")
