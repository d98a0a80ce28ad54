"""The worker as a process of the host (issue 21, round 2): what a tenant's kernel could reach through what its
worker *is* rather than what it may open. Each test runs the attacker's kernel (``exploits.py``: arbitrary syscalls
inside the worker, on PoCL) through one real broker.

- **User site**: the worker's HOME is its tenant's compile cache, which its kernels write. Python, started without
  ``-s``, runs the ``.pth`` files of ``$HOME/.local/lib/pythonX.Y/site-packages``: a kernel planted one, and the
  tenant's next sandbox launcher ran it on the host, as the broker's user with every capability, before any
  namespace existed. The launcher now has no HOME of the tenant's (the worker gets it at its exec, inside the
  sandbox), and the launcher and the worker start with ``-s -P``.
- **Process group**: workers shared the front's process group, and ``kill(0, SIGSTOP)`` (pid 0: "my group", found
  across PID namespaces) stopped the front and every other worker; ``setpriority(PRIO_PGRP, 0, 19)`` reniced
  another tenant's worker. Each launcher now has a session of its own, each worker another, and the filter lets
  signals through only to pid 1 (the worker itself) and priorities only for PRIO_PROCESS.
- **Threads**: the kernel never holds the host's root to RLIMIT_NPROC, so under a root broker (here, the GPU host)
  ``worker_pids_max`` bounded nothing without a pids cgroup (256 threads made against 64). A root broker's workers
  now run as other host users (``worker_uids``, one each), whom the kernel does hold to it.

The broker runs under a Python whose user site is on (a virtualenv with the system site packages that also sees
this checkout): the repository's own .venv turns the user site off, which would hide the first hole, but the
DaemonSet's image, a system-wide pip install or a conda env do not.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import signal
import subprocess
import sys
import sysconfig
import tomllib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from gpubroker.broker.launcher import BrokerProcess, TenantSpec
from gpubroker.client import Kernel, ModuleFormat, RemoteGpu, ResourceExhausted, connect

from ..helpers import descendants, wait_for
from .exploits import (
    ATTACK_SOURCE,
    NR,
    O_CREAT,
    O_TRUNC,
    O_WRONLY,
    SIGSTOP,
    VICTIM_SOURCE,
    Program,
    check_arch,
    pid_state,
    run,
)

TIMEOUT = 30.0
PY = f"python{sys.version_info.major}.{sys.version_info.minor}"
PIDS_MAX = 64  # the configured limit (the default is 512: smaller here, to keep the attack small)
NR.setdefault("mkdirat", 258)
NR.setdefault("setpriority", 141)
NR.setdefault("ioprio_set", 251)
NR.setdefault("sched_setscheduler", 144)
NR.setdefault("sched_setaffinity", 203)
NR.setdefault("prlimit64", 302)
SCHED_IDLE, RLIMIT_NOFILE = 5, 7
PRIO_PGRP, PRIO_USER = 1, 2
IOPRIO_WHO_PGRP, IOPRIO_WHO_USER = 2, 3
IOPRIO_IDLE = 3 << 13  # class IDLE, level 0


@pytest.fixture(scope="module")
def user_site_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Python with the user site enabled that imports what this checkout's interpreter imports."""
    env = tmp_path_factory.mktemp("pyenv") / "venv"
    base = Path(sys.base_prefix) / "bin" / PY
    subprocess.run([str(base), "-m", "venv", "--system-site-packages", "--without-pip", str(env)], check=True)
    site_dir = Path(subprocess.run([str(env / "bin" / "python"), "-c",
                                    "import sysconfig; print(sysconfig.get_path('purelib'))"],
                                   check=True, capture_output=True, text=True).stdout.strip())
    (site_dir / "gpb_checkout.pth").write_text(f"import site; site.addsitedir({sysconfig.get_path('purelib')!r})\n")
    probe = subprocess.run([str(env / "bin" / "python"), "-c", "import site, gpubroker; print(site.ENABLE_USER_SITE)"],
                           check=True, capture_output=True, text=True)
    assert probe.stdout.strip() == "True", probe
    return env / "bin" / "python"


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory, user_site_python: Path) -> Iterator[BrokerProcess]:
    check_arch()
    tmp = tmp_path_factory.mktemp("process")
    # The front runs under that Python (so its launchers do too): the wrapper swaps the interpreter.
    wrapper = ["/bin/sh", "-c", 'shift; exec "$0" "$@"', str(user_site_python)]
    tenants = [TenantSpec("alice"), TenantSpec("bob"), TenantSpec("carol"), TenantSpec("dave")]
    with BrokerProcess(tenants, backend="opencl", wrapper=wrapper,
                       settings={"cache_dir": str(tmp / "caches"), "worker_idle_seconds": 0.5,
                                 "worker_pids_max": PIDS_MAX}) as broker:
        yield broker


# ---- the user site ----

def test_a_kernel_cannot_plant_code_that_the_next_launcher_runs_on_the_host(broker: BrokerProcess,
                                                                           tmp_path: Path) -> None:
    cache = Path(_cache_dir(broker)) / "tenants" / "carol"
    proof = tmp_path / "escaped"  # a host path the sandbox does not show
    payload = f"import os; exec({_escape_code(proof)!r})\n".encode()
    with contextlib.closing(connect(broker.target, token=broker.tokens["carol"], timeout=TIMEOUT)) as gpu:
        kernel = gpu.get_kernel(gpu.load_module(ATTACK_SOURCE, ModuleFormat.OPENCL_C), "gpb_attack")
        worker = _workers(broker, "carol")
        assert len(worker) == 1
        home = _environ(worker[0]).get("HOME", "")
        assert home.startswith(str(cache)), f"carol's worker's HOME is {home!r}, not in her cache {cache}"
        program = Program()
        a = program.attempt("plant $HOME/.local/lib/pythonX.Y/site-packages/gpb.pth in the tenant's cache",
                            must_fail=False)
        path = Path(home)
        for part in (".local", "lib", PY, "site-packages"):
            path = path / part
            program.call(a, "mkdirat", -100, program.cstr(path), 0o755, cleanup=True)
        fd = program.call(a, "openat", -100, program.cstr(path / "gpb.pth"), O_WRONLY | O_CREAT | O_TRUNC, 0o644)
        program.call(a, "write", fd, program.put(payload), len(payload))
        program.call(a, "close", fd, cleanup=True)
        attempts = run(gpu, kernel, program)
        print("\n  " + "\n  ".join(str(x) for x in attempts))
        assert attempts[0].ret == len(payload), "the kernel could not plant the file (the attack did not run)"
    # The session is over; once the idle worker is reaped (and its cache saved to the host), the tenant's next
    # session starts a new launcher, then a new worker.
    wait_for(lambda: not _workers(broker, "carol"), timeout=TIMEOUT, what="the idle worker to be reaped")
    wait_for(lambda: list(cache.glob(f"*/.local/lib/{PY}/site-packages/gpb.pth")), timeout=TIMEOUT,
             what="the launcher to save the planted file to the host cache")
    with contextlib.closing(connect(broker.target, token=broker.tokens["carol"], timeout=TIMEOUT)) as gpu:
        gpu.device_info()
        escaped = proof.read_text() if proof.exists() else ""
        print(f"what the planted code wrote on the host: {escaped!r}")
        assert not escaped, f"code a kernel planted in its cache ran on the host at the next worker start: {escaped}"
        launchers = [p for p in descendants(_front(broker)) if b"gpubroker.broker.sandbox" in _cmdline(p)]
        assert launchers
        for pid in launchers:
            env = _environ(pid)
            assert not any(v.startswith(str(cache)) for v in env.values()), \
                f"a launcher's environment names the tenant's cache: {env}"


def _escape_code(proof: Path) -> str:
    # Runs in every Python started with this HOME and the user site on; only outside the sandbox can it reach
    # ``proof``'s directory.
    return ("try:\n"
            " s = dict(l.split(':', 1) for l in open('/proc/self/status') if ':' in l)\n"
            f" open({str(proof)!r}, 'a').write('pid %s uid %s CapEff %s NSpid %s\\n' % ("
            " os.getpid(), s['Uid'].split()[0], s['CapEff'].strip(), s['NSpid'].strip()))\n"
            "except OSError:\n"
            " pass\n")


# ---- the process group ----

@dataclass
class World:
    broker: BrokerProcess
    attacker: RemoteGpu
    kernel: Kernel
    victim: RemoteGpu


@pytest.fixture(scope="module")
def world(broker: BrokerProcess) -> Iterator[World]:
    with contextlib.ExitStack() as stack:
        attacker = connect(broker.target, token=broker.tokens["alice"], timeout=TIMEOUT)
        stack.callback(attacker.close)
        kernel = attacker.get_kernel(attacker.load_module(ATTACK_SOURCE, ModuleFormat.OPENCL_C), "gpb_attack")
        victim = connect(broker.target, token=broker.tokens["bob"], timeout=TIMEOUT)
        stack.callback(victim.close)
        victim.get_kernel(victim.load_module(VICTIM_SOURCE, ModuleFormat.OPENCL_C), "gpb_scale")
        yield World(broker, attacker, kernel, victim)


def test_a_kernel_cannot_stop_the_front_or_other_workers_through_its_process_group(world: World) -> None:
    front = _front(world.broker)
    group = os.getpgid(front)
    everyone = [front, *descendants(front)]
    print(f"\nthe front (pid {front}) leads process group {group}; its processes: "
          f"{[(p, os.getpgid(p)) for p in everyone if pid_state(p) is not None]}")
    program = Program()
    program.kill("kill(0, SIGSTOP): the caller's process group", 0, SIGSTOP)
    program.kill("kill(-1, SIGSTOP): every process the caller may signal", -1, SIGSTOP)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        # A stopped front cannot answer the launch: run it aside, and resume everyone afterwards.
        pending = pool.submit(run, world.attacker, world.kernel, program)
        try:
            wait_for(lambda: pending.done() or pid_state(front) == "T", timeout=TIMEOUT, what="the attacker's launch")
            stopped = sorted(p for p in everyone if pid_state(p) == "T")
        finally:
            for pid in everyone:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
        attempts = pending.result(TIMEOUT)
    print("  " + "\n  ".join(str(a) for a in attempts))
    assert not stopped, (f"a tenant's kernel stopped {len(stopped)} of the broker's processes with kill(0 or -1, "
                         f"SIGSTOP), the front (pid {front}) " + ("among them" if front in stopped else "not")
                         + f": {stopped}")
    assert not [a for a in attempts if a.succeeded], "a signal to a process group got past the filter"
    assert world.victim.device_info().name  # bob's worker still answers


def test_a_kernel_cannot_renice_another_tenants_worker(world: World) -> None:
    """``setpriority(PRIO_PGRP, 0, 19)`` reniced every process of the group that holds no capability the attacker
    lacks: every other tenant's worker. The same through ``ioprio_set``, and by user (all share the uid). Calls
    that name a pid (the scheduler's, prlimit) find none but the worker's own: its PID namespace shows no other."""
    victims = _workers(world.broker, "bob")
    assert victims, "bob has no worker"
    before = {p: _priorities(p) for p in victims}
    program = Program()
    for pid in victims:
        program.call(program.attempt(f"sched_setscheduler(bob's worker {pid}, SCHED_IDLE)"), "sched_setscheduler",
                     pid, SCHED_IDLE, program.put(bytes(8)))
        program.call(program.attempt(f"sched_setaffinity(bob's worker {pid}, CPU 0 only)"), "sched_setaffinity",
                     pid, 8, program.put((1).to_bytes(8, "little")))
        program.call(program.attempt(f"prlimit64(bob's worker {pid}, RLIMIT_NOFILE, 0)"), "prlimit64",
                     pid, RLIMIT_NOFILE, program.put(bytes(16)), 0)
    for label, args in (("setpriority(PRIO_PGRP, 0, 19): the caller's process group", (PRIO_PGRP, 0, 19)),
                        ("setpriority(PRIO_USER, 0, 19): the caller's uid", (PRIO_USER, 0, 19))):
        program.call(program.attempt(label), "setpriority", *args)
    for label, args in (("ioprio_set(IOPRIO_WHO_PGRP, 0, IDLE)", (IOPRIO_WHO_PGRP, 0, IOPRIO_IDLE)),
                        ("ioprio_set(IOPRIO_WHO_USER, 0, IDLE)", (IOPRIO_WHO_USER, 0, IOPRIO_IDLE))):
        program.call(program.attempt(label), "ioprio_set", *args)
    attempts = run(world.attacker, world.kernel, program)
    after = {p: _priorities(p) for p in victims}
    print("\n  " + "\n  ".join(str(a) for a in attempts) + f"\nbob's worker's priorities: {before} -> {after}")
    for pid in victims:  # (as root, the test may undo it)
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, pid, 0)
    assert after == before, f"alice's kernel reniced bob's worker: {before} -> {after}"
    assert not [a for a in attempts if a.succeeded], "a process group's or a user's priority got past the filter"


# ---- threads ----

THREADS_SOURCE = r"""
/* n threads, each on its own 512-byte stack in `stacks`, parked in pause() forever (they never return to C). */
__kernel void gpb_threads(const int n, __global char* stacks, __global long* res) {
    long made = 0, err = 0;
    for (int i = 0; i < n; ++i) {
        long r;
        long sp = (long)(stacks + (long)(i + 1) * 512);
        __asm__ volatile(
            "xor %%r10, %%r10\n\t"
            "xor %%r8, %%r8\n\t"
            "syscall\n\t"
            "test %%rax, %%rax\n\t"
            "jnz 1f\n\t"
            "2: mov $34, %%eax\n\t"    /* the child: pause() forever */
            "syscall\n\t"
            "jmp 2b\n\t"
            "1:"
            : "=a"(r)
            : "a"(56L), "D"(0x50f00L), "S"(sp), "d"(0L)  /* clone(VM|FS|FILES|SIGHAND|THREAD|SYSVSEM, sp) */
            : "rcx", "r11", "r10", "r8", "memory");
        if (r < 0) { err = r; break; }
        made++;
    }
    res[0] = made;
    res[1] = err;
}
"""


def test_a_kernel_cannot_make_more_threads_than_worker_pids_max(broker: BrokerProcess) -> None:
    attempt = PIDS_MAX * 4
    with contextlib.closing(connect(broker.target, token=broker.tokens["dave"], timeout=TIMEOUT)) as gpu:
        kernel = gpu.get_kernel(gpu.load_module(THREADS_SOURCE, ModuleFormat.OPENCL_C), "gpb_threads")
        stacks = gpu.allocate_memory(512 * (attempt + 1))
        res = gpu.allocate_memory(16)
        gpu.execute_kernel(kernel, 1, 1, [np.int32(attempt), stacks, res])  # type: ignore[list-item]
        gpu.synchronize()
        out = np.empty(2, dtype=np.int64)
        gpu.copy_d2h(res, out)
        made, err = int(out[0]), int(out[1])
        workers = _workers(broker, "dave")
        threads = {p: len(os.listdir(f"/proc/{p}/task")) for p in workers}
    print(f"\nworker_pids_max = {PIDS_MAX}: the kernel made {made} of {attempt} threads (first error {err}); the "
          f"worker has {threads} threads; broker uid {os.stat(f'/proc/{_front(broker)}').st_uid}")
    assert made < PIDS_MAX, (f"a tenant's kernel made {made} threads in its worker, past worker_pids_max = "
                             f"{PIDS_MAX} (RLIMIT_NPROC does not hold a root worker)")
    assert err == -11, f"the clone past the limit failed with {err}, not -EAGAIN"
    assert all(n <= PIDS_MAX + 1 for n in threads.values()), threads


@pytest.fixture(scope="module")
def root_workers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerProcess]:
    """A root broker told to run its workers as root (``worker_uids = "0"``, as for a GPU that only root may open)."""
    check_arch()
    if os.getuid() != 0:
        pytest.skip("worker_uids applies to a root broker only")
    tmp = tmp_path_factory.mktemp("rootworkers")
    with BrokerProcess([TenantSpec("erin")], backend="opencl",
                       settings={"cache_dir": str(tmp / "caches"), "worker_pids_max": PIDS_MAX,
                                 "worker_uids": "0"}) as broker:
        yield broker


def test_without_a_kernel_bound_the_front_kills_a_worker_with_too_many_threads(root_workers: BrokerProcess) -> None:
    """With workers as root and no pids cgroup nothing in the kernel bounds their threads: the broker says so at
    start, and the front's CPU watch (which scans each worker's threads every 0.5 s) kills one seen past
    worker_pids_max, charged to its tenant."""
    assert "is not enforced by the kernel" in root_workers.log_tail(100_000)
    attempt = PIDS_MAX * 4
    with contextlib.closing(connect(root_workers.target, token=root_workers.tokens["erin"], timeout=TIMEOUT)) as gpu:
        kernel = gpu.get_kernel(gpu.load_module(THREADS_SOURCE, ModuleFormat.OPENCL_C), "gpb_threads")
        stacks = gpu.allocate_memory(512 * (attempt + 1))
        res = gpu.allocate_memory(16)
        (worker,) = _workers(root_workers, "erin")
        gpu.execute_kernel(kernel, 1, 1, [np.int32(attempt), stacks, res])  # type: ignore[list-item]
        with pytest.raises(ResourceExhausted) as info:
            gpu.synchronize()
            wait_for(lambda: pid_state(worker) is None, timeout=TIMEOUT, what="the worker to be killed")
            gpu.device_info()
    print(f"\n{info.value}")
    assert "worker_pids_max" in str(info.value)


# ---- helpers ----

def _front(broker: BrokerProcess) -> int:
    assert broker.process is not None
    return broker.process.pid


def _cache_dir(broker: BrokerProcess) -> str:
    return str(tomllib.loads(broker.config_path.read_text())["broker"]["cache_dir"])


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _environ(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(item.decode(errors="replace").split("=", 1) for item in raw.split(b"\0") if b"=" in item)


def _workers(broker: BrokerProcess, tenant: str) -> list[int]:
    """The tenant's worker processes (not their launchers)."""
    found = []
    for pid in descendants(_front(broker)):
        args = _cmdline(pid).split(b"\0")
        if b"gpubroker.broker.worker" in args and tenant.encode() in args and b"--spec" not in args:
            found.append(pid)
    return found


def _priorities(pid: int) -> tuple[object, ...]:
    """What another process could change of ``pid``: nice, I/O priority, scheduling policy, CPUs, descriptors."""
    def get(read: Callable[[], object]) -> object:
        try:
            return read()
        except (OSError, subprocess.SubprocessError):
            return None

    return (get(lambda: os.getpriority(os.PRIO_PROCESS, pid)),
            get(lambda: subprocess.run(["ionice", "-p", str(pid)], capture_output=True, text=True,
                                       timeout=10).stdout.strip()),
            get(lambda: os.sched_getscheduler(pid)), get(lambda: sorted(os.sched_getaffinity(pid))),
            get(lambda: [line for line in Path(f"/proc/{pid}/limits").read_text().splitlines()
                         if line.startswith("Max open files")]))
