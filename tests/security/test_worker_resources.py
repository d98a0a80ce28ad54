"""A hostile tenant's kernel takes its worker's resources past their bounds, on PoCL, without a cgroup (issue 21,
items 1, 3 and 4): processes, host memory outside the worker's memory limit, and the host's disk.

The kernel is the system-call interpreter of exploits.py, so each attempt is the real call a native kernel would
make. Every attempt must be refused with an errno the tenant sees (EPERM from seccomp, ENOSPC from a bounded
tmpfs, EFBIG from RLIMIT_FSIZE), every byte a run of attempts got accepted must fit the configured bound, and the
worker must go on serving.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from gpubroker.broker.launcher import BrokerProcess, TenantSpec
from gpubroker.broker.sandbox._spawn import LINKER_MEMORY
from gpubroker.client import ModuleFormat, RemoteGpu, connect

from ..conftest import worker_pids
from ..helpers import descendants, wait_for
from . import exploits
from .exploits import AT_FDCWD, ATTACK_SOURCE, O_CREAT, O_RDWR, Attempt, Program, check_arch, process_env, run

MiB = 1 << 20
MEMORY_MAX = 1024 * MiB
TMP_MAX = 32 * MiB
CACHE_MAX = 64 * MiB
TIMEOUT = 60.0

# System calls these attacks need beyond exploits.NR (x86_64 numbers; added here, not there, to keep that table
# the attacks' common one).
for _name, _nr in (("shmget", 29), ("shmat", 30), ("shmctl", 31), ("clone", 56), ("fork", 57), ("vfork", 58),
                   ("exit", 60), ("shmdt", 67), ("ftruncate", 77), ("unlinkat", 263), ("fallocate", 285),
                   ("memfd_create", 319)):
    exploits.NR.setdefault(_name, _nr)
SIGCHLD = 17
IPC_PRIVATE, IPC_CREAT, IPC_RMID = 0, 0o1000, 0
REFUSALS = {"EPERM", "ENOSPC", "EFBIG", "ENOMEM"}


@dataclass
class Tenant:
    name: str
    gpu: RemoteGpu
    attack: object  # the interpreter kernel
    pid: int  # its worker


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerProcess]:
    check_arch()
    tmp = tmp_path_factory.mktemp("resources")
    settings = {"cache_dir": str(tmp / "caches"), "worker_memory_max": MEMORY_MAX, "worker_tmp_max_bytes": TMP_MAX,
                "cache_max_bytes": CACHE_MAX, "worker_idle_seconds": 1.0}
    with BrokerProcess([TenantSpec("alice"), TenantSpec("carol")], backend="opencl", settings=settings) as proc:
        yield proc


@contextlib.contextmanager
def tenant(broker: BrokerProcess, name: str) -> Iterator[Tenant]:
    with connect(broker.target, token=broker.tokens[name], timeout=TIMEOUT) as gpu:
        module = gpu.load_module(ATTACK_SOURCE, ModuleFormat.OPENCL_C)
        kernel = gpu.get_kernel(module, "gpb_attack")
        probe = Program()
        probe.getpid("getpid")
        run(gpu, kernel, probe)  # (the worker is up)
        (pid,) = worker_pids(broker, name)
        yield Tenant(name, gpu, kernel, pid)


def launch(who: Tenant, program: Program) -> list[Attempt]:
    attempts = run(who.gpu, who.attack, program)
    print("\n" + "\n".join(f"  {a}" for a in attempts))
    return attempts


def errno_name(ret: int) -> str:
    import errno

    return errno.errorcode.get(-ret, str(ret)) if ret < 0 else "allowed"


def assert_serves(broker: BrokerProcess, who: Tenant) -> None:
    """The front lives, the same worker runs the tenant's next launch, and nothing else runs in its namespace."""
    assert broker.process is not None and broker.process.poll() is None, "the front died"
    program = Program()
    me = program.getpid("getpid")
    launch(who, program)
    assert me.ret == 1, "the worker is PID 1 of its namespace"
    assert worker_pids(broker, who.name) == [who.pid], "the worker was replaced, or a process of its image remains"


def accepted(attempts: list[Attempt], size: int) -> int:
    """Bytes the kernel accepted over a run of fallocate attempts of ``size`` bytes each."""
    return sum(size for a in attempts if a.ret >= 0)


def fill(program: Program, path: str, size: int, *, label: str, must_fail: bool = True) -> Attempt:
    """Create ``path`` and fallocate ``size`` bytes in it (the file stays: what was accepted is held)."""
    a = program.attempt(label, must_fail=must_fail)
    fd = program.call(a, "openat", AT_FDCWD, program.cstr(path), O_CREAT | O_RDWR | os.O_CLOEXEC, 0o600)
    program.call(a, "fallocate", fd, 0, 0, size)
    program.call(a, "close", fd, cleanup=True)
    return a


def sparse(program: Program, path: str, size: int, *, label: str) -> Attempt:
    """Create ``path`` with an apparent size of ``size`` bytes and no blocks (ftruncate)."""
    a = program.attempt(label, must_fail=False)
    fd = program.call(a, "openat", AT_FDCWD, program.cstr(path), O_CREAT | O_RDWR | os.O_CLOEXEC, 0o600)
    program.call(a, "ftruncate", fd, size)
    program.call(a, "close", fd, cleanup=True)
    return a


def remove(program: Program, paths: list[str]) -> None:
    a = program.attempt("clean up", must_fail=False)
    for path in paths:
        program.call(a, "unlinkat", AT_FDCWD, program.cstr(path), 0, cleanup=True)


def spawn(program: Program, label: str, call: str, *args: int) -> Attempt:
    """Make a process: a child (the call returned 0) that exits at once, reaped by its parent; the worker itself
    (the call returned the child's pid) goes on. kill(pid, 0) tells them apart: the worker may not signal another
    pid (EPERM: its children's skip the exit), a child may signal pid 0 (its group)."""
    a = program.attempt(label)
    child = program.call(a, call, *args)
    in_child = program.call(a, "kill", child, 0, cleanup=True)
    program.call(a, "exit", in_child, cleanup=True)
    program.call(a, "wait4", child, 0, 0, 0, cleanup=True)
    return a


def test_a_worker_cannot_make_processes(broker: BrokerProcess) -> None:
    with tenant(broker, "alice") as alice:
        # One launch each, vfork last: a vfork child that got through would run on the worker's own stack.
        for label, call, args in (("fork()", "fork", ()), ("clone(SIGCHLD), a fork", "clone", (SIGCHLD, 0, 0, 0, 0)),
                                  ("vfork()", "vfork", ())):
            program = Program()
            attempt = spawn(program, label, call, *args)
            launch(alice, program)
            assert errno_name(attempt.ret) == "EPERM", str(attempt)
        assert_serves(broker, alice)


def test_host_memory_outside_the_worker_limit_is_refused(broker: BrokerProcess) -> None:
    with tenant(broker, "alice") as alice:
        program = Program()
        big = []
        a = program.attempt("memfd_create + fallocate 2 GiB")
        fd = program.call(a, "memfd_create", program.cstr("gpb"), 0)
        program.call(a, "fallocate", fd, 0, 0, 2048 * MiB)
        program.call(a, "close", fd, cleanup=True)
        big.append(a)
        a = program.attempt("shmget + shmat 64 MiB (System V)")
        seg = program.call(a, "shmget", IPC_PRIVATE, 64 * MiB, IPC_CREAT | 0o600)
        at = program.call(a, "shmat", seg, 0, 0)
        program.call(a, "shmdt", at, cleanup=True)
        program.call(a, "shmctl", seg, IPC_RMID, 0, cleanup=True)
        big.append(a)
        big.append(fill(program, "/tmp/gpb-big", 2048 * MiB, label="fallocate 2 GiB in /tmp"))
        big.append(fill(program, "/dev/shm/gpb-big", 2048 * MiB, label="fallocate 2 GiB in /dev/shm"))
        # /tmp and /dev/shm together hold at most worker_tmp_max_bytes, however it is asked for.
        chunk = 8 * MiB
        tmp = [fill(program, f"/tmp/gpb-{i}", chunk, label=f"/tmp chunk {i}", must_fail=False)
               for i in range(12)]
        shm = [fill(program, f"/dev/shm/gpb-{i}", chunk, label=f"/dev/shm chunk {i}", must_fail=False)
               for i in range(12)]
        remove(program, ["/tmp/gpb-big", "/dev/shm/gpb-big", *(f"/tmp/gpb-{i}" for i in range(12)),
                         *(f"/dev/shm/gpb-{i}" for i in range(12))])
        launch(alice, program)
        for a in big:
            assert errno_name(a.ret) in REFUSALS, str(a)
        assert accepted(tmp + shm, chunk) <= TMP_MAX, f"/tmp and /dev/shm took {accepted(tmp + shm, chunk)} bytes"
        refused = {errno_name(a.ret) for a in tmp + shm if a.ret < 0}
        assert refused and refused <= REFUSALS, refused
        assert_serves(broker, alice)


def test_the_compile_cache_is_bounded_on_the_host_disk(broker: BrokerProcess) -> None:
    with tenant(broker, "carol") as carol:
        cache = process_env(carol.pid)["HOME"]  # the tenant's cache directory: the same path inside and out
        host = Path(cache)
        program = Program()
        big = fill(program, f"{cache}/gpb-big", 2048 * MiB, label="fallocate 2 GiB in the cache")
        chunk = 6 * MiB  # each under the file-size limit; together past cache_max_bytes
        chunks = [fill(program, f"{cache}/gpb-{i}", chunk, label=f"cache chunk {i}", must_fail=False)
                  for i in range(16)]
        # Apparent sizes and no blocks: allowed, and the save must not make them real past the bound.
        holes = [sparse(program, f"{cache}/gpb-hole-{i}", 48 * MiB, label=f"sparse file {i}") for i in range(4)]
        launch(carol, program)
        assert errno_name(big.ret) in REFUSALS, str(big)
        assert accepted(chunks, chunk) <= CACHE_MAX
        assert any(a.ret < 0 for a in chunks), "no chunk was refused"
        assert all(a.ret >= 0 for a in holes)
        assert usage(host) <= CACHE_MAX, "the worker wrote the host disk past the bound"
        assert_serves(broker, carol)
    # The worker exits (idle), and its launcher saves the cache back within the bound before it exits too.
    wait_for(lambda: not launchers(broker, "carol"), 30, "carol's worker and its launcher to exit")
    assert usage(host) <= CACHE_MAX, f"{usage(host)} bytes on the host disk"
    # Its next worker starts from that cache and serves.
    with tenant(broker, "carol") as again:
        assert_serves(broker, again)


def usage(root: Path) -> int:
    """What a directory holds on disk: the larger of apparent size and allocated blocks, over every file."""
    total = 0
    for path in root.rglob("*"):
        st = path.lstat()
        total += max(st.st_size, st.st_blocks * 512)
    return total


def launchers(broker: BrokerProcess, name: str) -> list[int]:
    """The tenant's live sandbox launchers (their spec names its cache directory)."""
    assert broker.process is not None
    found = []
    for pid in descendants(broker.process.pid):
        try:
            args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"gpubroker.broker.sandbox" in args and any(f"/{name}".encode() in arg for arg in args):
            found.append(pid)
    return found


def test_the_sandbox_limits_are_what_the_config_says(broker: BrokerProcess) -> None:
    with tenant(broker, "alice") as alice:
        limits = Path(f"/proc/{alice.pid}/limits").read_text()
        fsize = next(line for line in limits.splitlines() if line.startswith("Max file size")).split()[3]
        assert fsize == str(max(TMP_MAX, CACHE_MAX))
        # Private writable memory (both backends), and on OpenCL the address space: worker_memory_max less what its
        # tmpfs may hold, so that they are counted inside it, and on OpenCL less the linker PoCL runs.
        for name in ("Max data size", "Max address space"):
            value = next(line for line in limits.splitlines() if line.startswith(name)).split()[3]
            assert value == str(MEMORY_MAX - TMP_MAX - CACHE_MAX - LINKER_MEMORY), limits
        mounts = Path(f"/proc/{alice.pid}/mounts").read_text()
        home = process_env(alice.pid)["HOME"]
        options = {fields[1]: fields[3] for fields in (line.split() for line in mounts.splitlines())
                   if fields[2] == "tmpfs"}
        for path in ("/tmp", "/dev/shm"):  # (one tmpfs: /dev/shm is noexec besides)
            assert f"size={TMP_MAX // 1024}k" in options[path], options
        assert f"size={CACHE_MAX // 1024}k" in options[home]
