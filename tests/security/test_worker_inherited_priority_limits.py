"""A worker's scheduling priority past every other worker's, through limits it inherits from the broker (issue 21,
round 6), on PoCL without a cgroup.

Found by the attacker: the launcher sets the worker's rlimits for memory, files, processes and signals, but leaves
``RLIMIT_RTPRIO`` and ``RLIMIT_NICE`` as the broker got them. Where the broker runs with either above 0 (started
from a login of a user that ``limits.conf`` gives real-time priority, as desktop distributions do for the audio
group; a container or unit with ``LimitRTPRIO=`` or ``LimitNICE=`` set), any tenant's kernel could, with no
capability at all:

- make its threads real-time (``sched_setscheduler(SCHED_FIFO)``): a spinning real-time thread runs before every
  normal thread of the host, the front and the other tenants' workers included, leaving them the kernel's
  real-time throttling share (5 %) of that CPU;
- lower its own nice value (``setpriority``) and its autogroup's (``/proc/self/autogroup``): at nice -20 its
  workers' CPU weight is 86 times another worker's, so a victim sharing the CPUs runs far slower than
  ``max_kernel_slowdown`` allows for.

Measured here with the broker started under RLIMIT_RTPRIO 50 and RLIMIT_NICE 40: all three calls succeeded from a
kernel. Now the launcher fixes both limits at 0, soft and hard, whatever the broker's: every call is refused.
"""

from __future__ import annotations

import contextlib
import resource
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpubroker.broker.launcher import BrokerProcess, TenantSpec
from gpubroker.client import ModuleFormat, connect

from ..conftest import worker_pids
from . import exploits
from .exploits import AT_FDCWD, ATTACK_SOURCE, O_WRONLY, Attempt, Program, Result, check_arch, run

for _name, _nr in (("setpriority", 141), ("sched_setscheduler", 144)):
    exploits.NR.setdefault(_name, _nr)
SCHED_OTHER, SCHED_FIFO = 0, 1
PRIO_PROCESS = 0
RAISED = {resource.RLIMIT_RTPRIO: 50, resource.RLIMIT_NICE: 40}  # real-time priority up to 50; nice down to -20


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerProcess]:
    check_arch()
    # The broker inherits this process's limits, as it would a login's or a unit's.
    saved = {kind: resource.getrlimit(kind) for kind in RAISED}
    try:
        for kind, value in RAISED.items():
            resource.setrlimit(kind, (value, value))
    except (ValueError, OSError):
        for kind, limits in saved.items():
            resource.setrlimit(kind, limits)
        pytest.skip("raising RLIMIT_RTPRIO and RLIMIT_NICE needs root (CAP_SYS_RESOURCE)")
    tmp = tmp_path_factory.mktemp("priority")
    try:
        with BrokerProcess([TenantSpec("alice")], backend="opencl",
                           settings={"cache_dir": str(tmp / "caches")}) as proc:
            yield proc
    finally:
        for kind, limits in saved.items():
            resource.setrlimit(kind, limits)


def test_a_kernel_gets_no_priority_over_other_workers(broker: BrokerProcess) -> None:
    with contextlib.closing(connect(broker.target, token=broker.tokens["alice"], timeout=60)) as gpu:
        kernel = gpu.get_kernel(gpu.load_module(ATTACK_SOURCE, ModuleFormat.OPENCL_C), "gpb_attack")
        program = Program()
        fifo = program.attempt("sched_setscheduler(SCHED_FIFO, 1) of the kernel's thread")
        program.call(fifo, "sched_setscheduler", 0, SCHED_FIFO, program.put((1).to_bytes(4, "little")))
        program.call(fifo, "sched_setscheduler", 0, SCHED_OTHER, program.put((0).to_bytes(4, "little")),
                     cleanup=True)
        nice = program.attempt("setpriority(PRIO_PROCESS, 0, -10)")
        program.call(nice, "setpriority", PRIO_PROCESS, 0, -10)
        program.call(nice, "setpriority", PRIO_PROCESS, 0, 0, cleanup=True)
        group = program.attempt("write -10 to /proc/self/autogroup")
        fd = program.call(group, "openat", AT_FDCWD, program.cstr("/proc/self/autogroup"), O_WRONLY)
        program.call(group, "write", Result(fd.index), program.put(b"-10"), 3)
        program.call(group, "write", Result(fd.index), program.put(b"0"), 1, cleanup=True)
        program.call(group, "close", Result(fd.index), cleanup=True)
        attempts: list[Attempt] = [fifo, nice, group]
        run(gpu, kernel, program)
        (pid,) = worker_pids(broker, "alice")
        limits = [line for line in Path(f"/proc/{pid}/limits").read_text().splitlines()
                  if line.startswith(("Max nice", "Max realtime priority"))]
        print("\n" + "\n".join(f"  {a}" for a in attempts) + "\n" + "\n".join(f"  {line}" for line in limits))
        got_through = [str(a) for a in attempts if a.succeeded]
        assert not got_through, f"a kernel raised its worker's priority: {got_through}"
        # The worker serves on.
        buf = gpu.allocate_memory(16)
        assert buf is not None
        assert worker_pids(broker, "alice") == [pid]


def test_the_launcher_pins_both_limits_at_zero() -> None:
    # Where this runs without CAP_SYS_RESOURCE (the attack above skips), at least the launcher's instructions:
    # both limits at 0, for every backend, whatever the broker's.
    from gpubroker.broker.sandbox import WorkerSandbox

    for backend in ("opencl", "cuda"):
        rlimits = WorkerSandbox(enabled=True, backend=backend).spec(None, [], None)["rlimits"]
        assert (rlimits["rtprio"], rlimits["nice"]) == (0, 0), (backend, rlimits)
