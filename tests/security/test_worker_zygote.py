"""Sandboxed workers forked from the zygote (issue 25: a first session in half a second): the same sandbox, the face
of an exec, and the zygote's death nobody's failure.

The zygote (``broker/zygote``) loads a worker's code once and forks each worker's launcher, whose child runs the
worker in its own process once every layer is in place, rather than exec'ing a new interpreter that imports it all
again. These tests look at real workers of a real broker from outside, as an operator (and an attacker) would.
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from gpubroker.broker.launcher import BrokerProcess, TenantSpec
from gpubroker.client import ModuleFormat, WorkerCrashed, connect

from ..conftest import worker_pids
from ..helpers import proc_status, wait_for

TIMEOUT = 60.0
SOURCE = "__kernel void gpb_zygote_touch(__global int *x) { x[get_global_id(0)] += 1; }"


def _cmdline(pid: int) -> list[bytes]:
    return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[:-1]


def _environ(pid: int) -> dict[str, str]:
    pairs = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(p.decode().split("=", 1) for p in pairs if b"=" in p)


def _parent(pid: int) -> int:
    return int(proc_status(pid)["PPid"])


def _oom_score_adj(pid: int) -> int:
    return int(Path(f"/proc/{pid}/oom_score_adj").read_text())


def _may_lower_oom_score_adj() -> bool:
    """Whether a process of this user may lower its OOM score adjustment here (CAP_SYS_RESOURCE)."""
    probe = subprocess.run(["sh", "-c", "echo -1 > /proc/self/oom_score_adj"], capture_output=True)
    return probe.returncode == 0


def _run_tenant_code(gpu: object) -> None:
    """A compile and a kernel: tenant code ran in the worker (its death would be its tenant's)."""
    from gpubroker.client import RemoteGpu

    assert isinstance(gpu, RemoteGpu)
    kernel = gpu.get_kernel(gpu.load_module(SOURCE, ModuleFormat.OPENCL_C), "gpb_zygote_touch")
    buf = gpu.allocate_memory(4 * 16)
    gpu.copy_h2d(np.zeros(16, np.int32), buf)
    gpu.execute_kernel(kernel, 1, 16, [buf])  # (one block of 16)
    out = np.empty(16, np.int32)
    gpu.copy_d2h(buf, out)
    assert (out == 1).all()


@pytest.fixture(scope="module")
def broker() -> Iterator[BrokerProcess]:
    with BrokerProcess([TenantSpec("alice"), TenantSpec("bob")], backend="opencl") as proc:
        yield proc


def test_a_worker_forked_from_the_zygote_looks_and_is_confined_as_an_execd_one(broker: BrokerProcess) -> None:
    assert broker.process is not None
    with (connect(broker.target, token=broker.tokens["alice"], timeout=TIMEOUT) as alice,
          connect(broker.target, token=broker.tokens["bob"], timeout=TIMEOUT) as bob):
        _run_tenant_code(alice)
        _run_tenant_code(bob)
        (worker,), (bobs,) = worker_pids(broker, "alice"), worker_pids(broker, "bob")
        launcher = _parent(worker)
        zygote = _parent(launcher)
        assert _parent(_parent(bobs)) == zygote, "each worker's launcher is a fork of the same zygote"
        # The chain: the broker, its zygote, the launcher the zygote forked, the worker (PID 1 of its namespace).
        assert _parent(zygote) == broker.process.pid
        assert b"gpubroker.broker.zygote" in _cmdline(zygote)
        assert proc_status(worker)["NSpid"].split()[-1] == "1"
        # What ps shows, and what the front's process scans read, is what an exec would have shown.
        launcher_argv, worker_argv = _cmdline(launcher), _cmdline(worker)
        assert launcher_argv[launcher_argv.index(b"-m") + 1] == b"gpubroker.broker.sandbox" and b"--spec" in \
            launcher_argv, launcher_argv
        assert worker_argv[worker_argv.index(b"-m") + 1] == b"gpubroker.broker.worker", worker_argv
        assert worker_argv[worker_argv.index(b"--tenant") + 1] == b"alice"
        # Its environment is its own (HOME is its tenant's cache), the launcher's has none of a tenant's, and
        # nothing the zygote's imports set (pyopencl's PYOPENCL_HOME) shows as if it came with an exec.
        alice_env, bob_env, launcher_env = _environ(worker), _environ(bobs), _environ(launcher)
        assert "/tenants/alice/" in alice_env["HOME"] and "/tenants/bob/" in bob_env["HOME"]
        assert "HOME" not in launcher_env and "PYOPENCL_HOME" not in alice_env
        # Confined as ever: the seccomp filters, no_new_privs, no capability, a host uid of its own.
        for pid in (worker, bobs):
            status = proc_status(pid)
            assert status["Seccomp"] == "2" and status["NoNewPrivs"] == "1", status
            assert int(status["CapEff"], 16) == 0 and int(status["CapBnd"], 16) == 0
        if os.getuid() == 0:
            assert proc_status(worker)["Uid"].split()[0] != proc_status(bobs)["Uid"].split()[0] != "0"
        # The zygote is what the OOM killer takes last (every launcher dies with it); the launchers and workers are
        # as the broker is.
        front_adj = _oom_score_adj(broker.process.pid)
        assert _oom_score_adj(launcher) == _oom_score_adj(worker) == front_adj
        if _may_lower_oom_score_adj():
            assert _oom_score_adj(zygote) < front_adj
        else:
            assert _oom_score_adj(zygote) == front_adj
        # Nothing of the zygote's holds a device or a tenant's file: no descriptor but its socket to the front,
        # stdio, and what Python keeps open.
        held = [os.readlink(f"/proc/{zygote}/fd/{fd}") for fd in os.listdir(f"/proc/{zygote}/fd")]
        assert not [h for h in held if "/tenants/" in h or ("/dev/" in h and "null" not in h)], held
    assert "workers start from the zygote" in broker.log_tail(1_000_000)


def test_a_worker_that_dies_with_the_zygote_is_nobodys_failure(tmp_path: Path) -> None:
    """The zygote killed from outside (the OOM killer, an operator): the running workers die with it (their
    launchers' parent-death signal), which is charged to no tenant (a crash budget of one would refuse alice's next
    session) nor to the device; the next workers start exec'd, as without a zygote."""
    with BrokerProcess([TenantSpec("alice")], backend="opencl",
                       settings={"tenant_crash_budget": 1, "cache_dir": str(tmp_path / "caches")}) as broker:
        gpu = connect(broker.target, token=broker.tokens["alice"], timeout=TIMEOUT)
        _run_tenant_code(gpu)
        (worker,) = worker_pids(broker, "alice")
        zygote = _parent(_parent(worker))
        os.kill(zygote, signal.SIGKILL)
        wait_for(lambda: "its launcher ended with the workers' zygote" in broker.log_tail(1_000_000), TIMEOUT,
                 "the front to see alice's worker die with the zygote")
        with pytest.raises(WorkerCrashed):
            gpu.synchronize()
        gpu.close()
        with connect(broker.target, token=broker.tokens["alice"], timeout=TIMEOUT) as again:
            _run_tenant_code(again)
            (worker,) = worker_pids(broker, "alice")
            assert broker.process is not None and _parent(_parent(worker)) != zygote
            assert _parent(worker) in [int(p) for p in _children(broker.process.pid)]
        log = broker.log_tail(1_000_000)
        assert "workers start without the zygote from now on" in log
        assert "failed before running any tenant code" not in log, "the zygote's death was charged to the device"


def _children(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/task/{pid}/children").read_text().split()


def test_without_the_zygote_each_launcher_is_execd_by_the_front(tmp_path: Path) -> None:
    with BrokerProcess([TenantSpec("alice")], backend="opencl",
                       settings={"worker_zygote": False, "cache_dir": str(tmp_path / "caches")}) as broker, \
            connect(broker.target, token=broker.tokens["alice"], timeout=TIMEOUT) as gpu:
        _run_tenant_code(gpu)
        (worker,) = worker_pids(broker, "alice")
        assert broker.process is not None and _parent(_parent(worker)) == broker.process.pid
        assert "zygote" not in broker.log_tail(1_000_000)
