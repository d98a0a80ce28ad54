"""A fork the zygote cannot make must not kill every running worker of every tenant (it did).

The workers' zygote (``broker/zygote/_serve.py``) forks each sandboxed worker's launcher, and every launcher dies
with it (its parent-death signal). ``_serve_one`` did not catch a failed ``os.fork()``: EAGAIN (the broker's unit
at its task limit, systemd's ``TasksMax=``, i.e. its pids cgroup; ``kernel.threads-max``; ``pid_max``) or ENOMEM
raised out of the zygote's loop and the zygote exited, and with it every launcher and worker it ever forked.

With exec'd launchers the same moment costs only the start that could not be made (the front's Popen fails). With
the zygote, one tenant that fills the broker's task budget with its own threads (each worker may make up to
``worker_pids_max``; the unit's limit bounds them all together) and one session start by anybody are enough to end
every other tenant's running worker and the device state it holds; the deaths are charged to no one.

Reproduced here with a pids cgroup (v1, as this host has) standing for the unit's ``TasksMax``: alice's kernel makes
threads (clone with CLONE_THREAD, which the sandbox allows) until the cgroup refuses one; bob then opens a session;
carol, whose worker ran before, must still be served. (The same test with ``worker_zygote = false`` passes: carol's
worker lives, bob's start fails or waits, nothing else.) Alice's own worker dies too, charged to no one ("its launcher
ended with the workers' zygote"), so the attacker's crash budget is untouched.

Fixed: the zygote answers a Fork it cannot make with ``ForkFailed`` (the system's reason) and serves on; the front
starts that one launcher exec'd (which the same limit may refuse: then that start fails, as without the zygote).
"""

from __future__ import annotations

import os
import platform
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from gpubroker.broker.launcher import BrokerProcess, TenantSpec
from gpubroker.client import ModuleFormat, RemoteGpu, connect

from ..conftest import worker_pids
from ..helpers import wait_for
from .exploits import SYSCALL_SOURCE

TIMEOUT = 60.0
PIDS_V1 = Path("/sys/fs/cgroup/pids")
HEADROOM = 40  # tasks the cgroup allows past what the broker holds once carol's and alice's workers run

# Threads that never return to C: each clone's child loops on pause(2) on a stack of its own in ``stacks``.
THREAD_BOMB = SYSCALL_SOURCE + r"""
__kernel void gpb_threads(__global char* stacks, const int n, __global long* res) {
    long made = 0, last = 0;
    for (int i = 0; i < n; ++i) {
        long sp = (long)(stacks + (long)(i + 1) * 4096 - 64);
        long r;
        /* CLONE_VM | CLONE_FS | CLONE_FILES | CLONE_SIGHAND | CLONE_THREAD | CLONE_SYSVSEM */
        __asm__ volatile("mov $56, %%eax\n\t"
                         "syscall\n\t"
                         "test %%rax, %%rax\n\t"
                         "jnz 1f\n\t"
                         "2: mov $34, %%eax\n\t"
                         "syscall\n\t"
                         "jmp 2b\n\t"
                         "1:\n\t"
                         : "=a"(r) : "D"(0x50F00L), "S"(sp), "d"(0L) : "rcx", "r11", "memory");
        if (r < 0) { last = r; break; }
        made++;
    }
    res[0] = made; res[1] = last;
}
"""
TOUCH = "__kernel void gpb_touch(__global int *x) { x[get_global_id(0)] += 1; }"


def _touch(gpu: RemoteGpu) -> None:
    kernel = gpu.get_kernel(gpu.load_module(TOUCH, ModuleFormat.OPENCL_C), "gpb_touch")
    buf = gpu.allocate_memory(64)
    gpu.copy_h2d(np.zeros(16, np.int32), buf)
    gpu.execute_kernel(kernel, 1, 16, [buf])
    out = np.empty(16, np.int32)
    gpu.copy_d2h(buf, out)
    assert (out == 1).all()


@pytest.fixture
def pids_cgroup() -> Iterator[Path]:
    if os.geteuid() != 0 or not (PIDS_V1 / "cgroup.procs").exists() or platform.machine() != "x86_64":
        pytest.skip("needs root, a cgroup v1 pids hierarchy at /sys/fs/cgroup/pids and x86_64")
    group = PIDS_V1 / f"gpb-zygote-{uuid.uuid4().hex[:8]}"
    group.mkdir()
    try:
        yield group
    finally:
        for pid in (group / "cgroup.procs").read_text().split():
            try:
                (PIDS_V1 / "cgroup.procs").write_text(pid)
            except OSError:
                pass
        for _ in range(50):
            try:
                group.rmdir()
                break
            except OSError:
                time.sleep(0.1)


def test_a_failed_fork_in_the_zygote_spares_the_running_workers(pids_cgroup: Path, tmp_path: Path) -> None:
    # The broker in the cgroup, as a unit with TasksMax= is: the front, the zygote and every worker count there.
    wrapper = ["sh", "-c", f'echo $$ > {pids_cgroup}/cgroup.procs && exec "$@"', "gpb-in-cgroup"]
    tenants = [TenantSpec("alice"), TenantSpec("bob"), TenantSpec("carol")]
    with BrokerProcess(tenants, backend="opencl", wrapper=wrapper,
                       settings={"cache_dir": str(tmp_path / "caches")}) as broker:
        carol = connect(broker.target, token=broker.tokens["carol"], timeout=TIMEOUT)
        alice = connect(broker.target, token=broker.tokens["alice"], timeout=TIMEOUT)
        try:
            _touch(carol)
            (carols_worker,) = worker_pids(broker, "carol")
            bomb = alice.get_kernel(alice.load_module(THREAD_BOMB, ModuleFormat.OPENCL_C), "gpb_threads")
            _touch(alice)
            # The unit's budget: what runs now and a little more, which alice's threads take.
            current = int((pids_cgroup / "pids.current").read_text())
            (pids_cgroup / "pids.max").write_text(str(current + HEADROOM))
            n = 2 * HEADROOM
            stacks, res = alice.allocate_memory(4096 * (n + 1)), alice.allocate_memory(16)
            alice.execute_kernel(bomb, 1, 1, [stacks, np.int32(n), res])
            alice.synchronize()
            made = np.empty(2, np.int64)
            alice.copy_d2h(res, made)
            assert 0 < made[0] < n and made[1] == -11, f"alice's threads: {made[0]} made, then {made[1]}"
            # Anybody's next start: the zygote's fork is refused (EAGAIN).
            try:
                with connect(broker.target, token=broker.tokens["bob"], timeout=TIMEOUT) as bob:
                    _touch(bob)
            except Exception:
                pass  # (bob's start may fail: there is no room for his worker, as without the zygote)
            # The front has heard of the refused fork: the zygote said so (fixed), or it died (the hole).
            wait_for(lambda: any(said in broker.log_tail(1_000_000) for said in (
                "could not fork a launcher", "ended with the workers' zygote", "workers start without the zygote")),
                10, "the front to hear of the zygote's refused fork")
            # The budget back (as once alice's worker is gone): carol's worker must have lived through it.
            (pids_cgroup / "pids.max").write_text("max")
            log = broker.log_tail(1_000_000)
            lost = [line for line in log.splitlines() if "zygote" in line and "WARNING   " not in line]
            assert "its launcher ended with the workers' zygote" not in log, (
                "a fork the zygote could not make killed every running worker:\n" + "\n".join(lost))
            assert worker_pids(broker, "carol") == [carols_worker], "carol's running worker died with the zygote"
            assert "workers start without the zygote from now on" not in log  # (one refused fork: it serves on)
            _touch(carol)
        finally:
            alice.close()
            carol.close()
