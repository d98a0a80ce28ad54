"""On a CPU device (PoCL) the host work a tenant's worker does for it is charged to that tenant: its compiles, and
the JIT of a kernel's first launch. On PoCL the device *is* the host's CPUs.

Compiles (closed hole). A compile (``LoadModule``) takes no device turn, and the CPU watch allowed the CPU of the
worker's serving thread while it served one (``_cpuwatch.py``), so none of it reached the tenant's fair share or its
usage, and nothing bounds it past ``compile_timeout_seconds`` (60 s) per compile: a tenant may compile distinct
sources back to back forever, taking that CPU from every other tenant's kernels while its fair-share clock stood
still. Measured before the fix (PoCL, 2 shared cores): 15 s of back-to-back compiles of a small macro-expanded
source used 15.1 CPU-seconds (a full CPU) of the attacker's worker; ``Usage`` charged 0.0 device-seconds; another
tenant's 1.0 s kernel took 1.3-2.8 s meanwhile. The fix: on a CPU device the watch charges a compile's CPU (the
serving thread's) to the tenant's fair-queuing clock and usage like the rest of its worker's CPU outside its turns,
over the compute units; it still never counts towards ``max_cpu_seconds_outside_turns`` (a compile is bounded by
``compile_timeout_seconds``).

First launches (closed hole). A hold's charge was the worker's own report (``take_device_time``: OpenCL profiling
of its commands, plus what its library and torch operators time themselves), only bounded by the front's meter
(``seconds = min(report, consumed)``), so whatever the report left out was free while nobody waited, and missing
from Usage and ``gpubroker_device_seconds`` always. PoCL builds a kernel's work-group function at its first launch
(and again for each new local size), inside the launch's turn but outside the kernel's profiled duration: a large
kernel's first launch ran for many CPU-seconds that the report called ~0 (and a hostile worker can report 0 for
everything). Measured before the fix: a 10,000-statement kernel's first launch used 18.6 CPU-seconds of its worker
and was charged 0.000 device-seconds. The fix: on a CPU device the hold meter (front/_server.py ``_hold_meter``)
also reads the worker tree's own CPU over the device's compute units, and a metered hold is charged at least that
(at most what the hold consumed), whatever the worker reports (scheduler/_device.py). The test launches over the
SDK's default transport, its link: the first launch's JIT runs there as well (a SIGSEGV once seen at this point was
the kernel's own out-of-bounds write, since fixed in it).

Each test runs the attack in a fresh tenant of one broker (a worker of its own) and checks that at least a quarter
of the worker's CPU over the compute units reached the tenant's usage.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator

import pytest

from gpubroker.broker.launcher import BrokerProcess, TenantSpec
from gpubroker.client import AdminClient, RemoteGpu, connect

from ..conftest import worker_pids
from ..helpers import wait_for
from .exploits import COMPILE_BOMB
from .test_time_limit_cause import _tree_cpu

SECONDS = 4.0  # of back-to-back compiles


@pytest.fixture(scope="module")
def broker() -> Iterator[BrokerProcess]:
    tenants = [TenantSpec("ops", admin=True), TenantSpec("compiler"), TenantSpec("launcher")]
    with BrokerProcess(tenants, backend="opencl") as proc:
        yield proc


def _charge(tenant: str, admin: AdminClient) -> Callable[[], float]:
    def charged() -> float:
        return {u.tenant: u.device_seconds for u in admin.usage(window_seconds=600).tenants}.get(tenant, 0.0)
    return charged


def _charged_at_least_a_quarter(charged: Callable[[], float], charged_before: float, used: float, what: str) -> None:
    """Device-seconds on a CPU device are CPU-seconds over its compute units: at least a quarter of ``used``. (A
    compile's CPU is charged at the CPU watch's next look, every half second; a hold's with its fence.)"""
    floor = used / len(os.sched_getaffinity(0)) / 4
    try:
        wait_for(lambda: charged() - charged_before >= floor, 10.0, f"the {what}'s charge")
    finally:
        print(f"\n{what}: the worker used {used:.1f} CPU-s, charged {charged() - charged_before:.3f} s "
              f"(at least {floor:.3f} expected)")


def test_compile_cpu_is_charged_to_the_tenant(broker: BrokerProcess) -> None:
    with connect(broker.target, token=broker.tokens["compiler"], device=0) as gpu, \
            AdminClient(broker.target, broker.tokens["ops"]) as admin:
        charged = _charge("compiler", admin)
        # (no device work: the tenant never holds the device, whose turns are charged at their fences)
        [worker] = worker_pids(broker, "compiler")
        charged_before, before = charged(), _tree_cpu(worker)
        end, n = time.monotonic() + SECONDS, 0
        while time.monotonic() < end:
            gpu.compile_kernel(COMPILE_BOMB.replace("SEED", f"{n}.0f + {os.getpid()}.0f"), "k")
            n += 1
        used = _tree_cpu(worker) - before
        assert used > 1.0, used  # (the attack ran)
        _charged_at_least_a_quarter(charged, charged_before, used, f"{n} compiles in {SECONDS:g} s")


def test_a_kernels_first_launch_is_charged_to_its_tenant(broker: BrokerProcess) -> None:
    with connect(broker.target, token=broker.tokens["launcher"], device=0) as gpu, \
            AdminClient(broker.target, broker.tokens["ops"]) as admin:
        assert isinstance(gpu, RemoteGpu)
        charged = _charge("launcher", admin)
        scratch = gpu.allocate_memory(4096)
        [worker] = worker_pids(broker, "launcher")
        kernel = gpu.compile_kernel(COMPILE_BOMB.replace("SEED", f"{os.getpid() % 1000}.5f"), "k")
        gpu.synchronize()
        # The compile's own CPU is charged too (above), at the CPU watch's next look: not in what this test counts.
        with contextlib.suppress(AssertionError):
            wait_for(lambda: charged() > 0, 5.0, "the compile's charge")
        charged_before, before = charged(), _tree_cpu(worker)
        gpu.execute_kernel(kernel, 1, 1, [scratch])
        gpu.synchronize()
        used = _tree_cpu(worker) - before
        assert used > 1.0, used  # (the JIT ran)
        _charged_at_least_a_quarter(charged, charged_before, used, "first launch")
