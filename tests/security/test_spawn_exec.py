"""attack3: a kernel makes processes with posix_spawn's clone shape and execs them; each got rlimits of its own.

On OpenCL the worker's seccomp filter lets ``clone(CLONE_VM | CLONE_VFORK)`` through (PoCL's in-process clang driver
starts the system linker with posix_spawn, at kernel enqueue time too), and ``execve`` was allowed: a kernel could
do what posix_spawn does, a vfork-style child that execs any program the sandbox shows (here the worker's own
Python). Each such process has an address space of its own, and without a cgroup the worker's memory bound is a pair
of *per-process* rlimits (RLIMIT_DATA, RLIMIT_AS): measured, five children of 300 MiB made the worker's tree hold
1.6 GiB against a ``worker_memory_max`` of 1 GiB, and up to ``worker_pids_max`` of them could be made.

Now (sandbox/_landlock.py, sandbox/_spawn.py), by the kernel:

- Landlock: the worker and everything it starts may execute only the linker PoCL uses and its ELF interpreter, so a
  child exec'ing the worker's Python is refused (EACCES);
- the launcher supervises every exec and posix_spawn-shaped clone of the worker's tree (seccomp user notification):
  a spawned process runs only once the previous one has exited, with RLIMIT_DATA and RLIMIT_AS of 128 MiB (taken
  out of the worker's own), and spawns nothing itself. That interpreter runs any ELF it is given (here the worker's
  Python again): such a process is held to that budget, one at a time.

PoCL's own linking (each newly compiled kernel, each new work-group size) still works.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator

import numpy as np
import pytest

from gpubroker.broker.launcher import BrokerProcess, TenantSpec
from gpubroker.broker.sandbox import WorkerSandbox, _landlock
from gpubroker.broker.sandbox._landlock import elf_interpreter
from gpubroker.client import ModuleFormat, RemoteGpu, connect

from .exploits import SYSCALL_SOURCE, check_arch

MiB = 1 << 20
MEMORY_MAX = 1024 * MiB
CHILD_BYTES = 300 * MiB  # more than a spawned process's 128 MiB, well within the worker's own rlimits
PYTHON = os.path.realpath(sys.executable)  # (the sandbox shows the worker's Python at the same path)
ALLOCATE = f"""
try:
    b = b'x' * {CHILD_BYTES}
except MemoryError:
    raise SystemExit(3)
raise SystemExit(42)
"""
SLEEP = 2.0  # seconds each of two spawned processes lives in the one-at-a-time case

SPAWN_SOURCE = SYSCALL_SOURCE + r"""
/* clone(CLONE_VM | CLONE_VFORK | SIGCHLD) and, in the child, execve at once: posix_spawn's shape, all in one asm
   block so the child touches nothing of the parent's stack. The child exits 127 if the exec fails. */
static long spawn(long flags, long path, long argv) {
    long r;
    __asm__ volatile(
        "mov $56, %%eax\n\t" "mov %1, %%rdi\n\t" "xor %%esi, %%esi\n\t" "xor %%edx, %%edx\n\t"
        "xor %%r10d, %%r10d\n\t" "xor %%r8d, %%r8d\n\t" "syscall\n\t"
        "test %%rax, %%rax\n\t" "jnz 1f\n\t"
        "mov $59, %%eax\n\t" "mov %2, %%rdi\n\t" "mov %3, %%rsi\n\t" "xor %%edx, %%edx\n\t" "syscall\n\t"
        "mov $60, %%eax\n\t" "mov $127, %%edi\n\t" "syscall\n\t"
        "1:\n\t"
        : "=&a"(r) : "r"(flags), "r"(path), "r"(argv)
        : "rcx", "r11", "rdi", "rsi", "rdx", "r10", "r8", "r9", "memory");
    return r;
}
/* blob: NUL-terminated strings at offs[0..nargs); argv: room for nargs + 1 pointers. For child k: res[3k] the
   clone's result (its pid, or -errno), res[3k+1] CLOCK_MONOTONIC in ns once the clone returned (the child has
   exec'd or exited by then), res[3k+2] its wait status (or wait4's -errno). All are spawned, then all waited for. */
__kernel void gpb_spawn(__global char* blob, __global const long* offs, const int nargs, __global long* argv,
                        const int times, __global long* res) {
    for (int i = 0; i < nargs; ++i) argv[i] = (long)(blob + offs[i]);
    argv[nargs] = 0;
    for (int k = 0; k < times; ++k) {
        long ts[2] = {0, 0};
        res[3 * k] = spawn(0x00000100 | 0x00004000 | 17, (long)(blob + offs[0]), (long)argv);
        sys6(228, 1, (long)ts, 0, 0, 0, 0);
        res[3 * k + 1] = ts[0] * 1000000000L + ts[1];
    }
    for (int k = 0; k < times; ++k) {
        int status = 0;
        long r = res[3 * k] > 0 ? sys6(61, res[3 * k], (long)&status, 0, 0, 0, 0) : -10;
        res[3 * k + 2] = r < 0 ? r : status;
    }
}
"""
# The linking case compiles this kernel for three work-group sizes: PoCL links one shared object for each.
LINK_SOURCE = "__kernel void gpb_scale(__global float* a, const float f) { a[get_global_id(0)] *= f; }"


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerProcess]:
    check_arch()
    tmp = tmp_path_factory.mktemp("spawn")
    settings = {"cache_dir": str(tmp / "caches"), "worker_memory_max": MEMORY_MAX,
                "worker_tmp_max_bytes": 32 * MiB, "cache_max_bytes": 64 * MiB}
    with BrokerProcess([TenantSpec("alice", memory_quota=256 * MiB)], backend="opencl",
                       settings=settings) as proc:
        yield proc


@pytest.fixture(scope="module")
def gpu(broker: BrokerProcess) -> Iterator[RemoteGpu]:
    with connect(broker.target, token=broker.tokens["alice"], timeout=60) as remote:
        yield remote


def spawn(gpu: RemoteGpu, args: list[str], times: int = 1) -> list[tuple[int, float, int]]:
    """Run the spawning kernel: for each child, (clone's result, seconds at its return, wait status)."""
    blob = bytearray()
    offs = []
    for a in args:
        offs.append(len(blob))
        blob += a.encode() + b"\0"
    blob += b"\0" * (-len(blob) % 64)
    module = gpu.load_module(SPAWN_SOURCE, ModuleFormat.OPENCL_C)
    kernel = gpu.get_kernel(module, "gpb_spawn")
    bufs = [gpu.allocate_memory(len(blob)), gpu.allocate_memory(8 * len(offs)),
            gpu.allocate_memory(8 * (len(args) + 1)), gpu.allocate_memory(8 * 3 * times)]
    try:
        gpu.copy_h2d(bytes(blob), bufs[0])
        gpu.copy_h2d(np.array(offs, dtype=np.int64), bufs[1])
        gpu.execute_kernel(kernel, 1, 1, [bufs[0], bufs[1], np.int32(len(args)), bufs[2], np.int32(times),
                                          bufs[3]])
        gpu.synchronize()
        res = np.empty(3 * times, dtype=np.int64)
        gpu.copy_d2h(bufs[3], res)
    finally:
        for buf in bufs:
            gpu.free_memory(buf)
    children = [(int(res[3 * k]), int(res[3 * k + 1]) / 1e9, int(res[3 * k + 2])) for k in range(times)]
    print(f"\n{args[:2]} x {times}: (clone, at, wait status) {children}")
    return children


def exit_code(status: int) -> int | str:
    return os.waitstatus_to_exitcode(status) if status >= 0 else f"wait4 failed: {status}"


def interpreter() -> str:
    path = elf_interpreter(PYTHON)
    assert path is not None, f"{PYTHON} names no ELF interpreter"
    return path


def test_a_kernels_child_cannot_exec_python(gpu: RemoteGpu) -> None:
    ((pid, _, status),) = spawn(gpu, [PYTHON, "-S", "-c", ALLOCATE])
    assert pid > 0, "posix_spawn's clone is PoCL's: it stays allowed"
    # 127: the child's exec failed (Landlock: EACCES) and it left; 42 was the Python it ran, 300 MiB allocated.
    assert exit_code(status) == 127, f"the child exec'd the worker's Python (exit {exit_code(status)})"


def test_a_spawned_process_is_held_to_the_linkers_memory(gpu: RemoteGpu) -> None:
    # The interpreter PoCL's linker needs may run, and it runs any ELF: the same Python, through it.
    ((pid, _, status),) = spawn(gpu, [interpreter(), PYTHON, "-S", "-c", ALLOCATE])
    assert pid > 0
    # 3: MemoryError under the spawned process's 128 MiB; 42: it held 300 MiB outside the worker's budget.
    assert exit_code(status) == 3, f"a spawned process allocated {CHILD_BYTES // MiB} MiB (exit {exit_code(status)})"


def test_spawned_processes_run_one_at_a_time(gpu: RemoteGpu) -> None:
    code = f"import time; b = bytearray({16 * MiB}); time.sleep({SLEEP})"
    first, second = spawn(gpu, [interpreter(), PYTHON, "-S", "-c", code], times=2)
    assert [exit_code(first[2]), exit_code(second[2])] == [0, 0], "each ran to its end"
    # The second exec waited for the first process to exit, which slept SLEEP s (a loaded machine only lengthens
    # it); without supervision both start at once, some 0.05 s apart.
    gap = second[1] - first[1]
    assert gap >= 0.75 * SLEEP, f"the second spawned process started {gap:.2f} s after the first, which still lived"


def test_a_spawned_process_spawns_nothing(gpu: RemoteGpu) -> None:
    # A spawned process's own posix_spawn is refused (EPERM at its clone): a CLONE_VM child of its would keep its
    # address space alive past its exit, beside the next one's.
    ldso = interpreter()
    code = (f"import os\ntry:\n    pid = os.posix_spawn({ldso!r}, [{ldso!r}, '--version'], {{}})\n"
            "except PermissionError:\n    raise SystemExit(5)\nos.waitpid(pid, 0)\n")
    ((_, _, status),) = spawn(gpu, [ldso, PYTHON, "-S", "-c", code])
    assert exit_code(status) == 5, f"a spawned process spawned another (exit {exit_code(status)})"


def test_pocls_own_linking_still_works(gpu: RemoteGpu) -> None:
    # A kernel new to this broker's caches, launched at three work-group sizes: PoCL links a shared object for each,
    # with the system linker, through the supervision above.
    module = gpu.load_module(LINK_SOURCE, ModuleFormat.OPENCL_C)
    kernel = gpu.get_kernel(module, "gpb_scale")
    host = np.arange(64, dtype=np.float32)
    buf = gpu.allocate_memory(host.nbytes)
    try:
        gpu.copy_h2d(host, buf)
        for block in (1, 4, 16):
            gpu.execute_kernel(kernel, host.size // block, block, [buf, np.float32(2.0)])
        gpu.synchronize()
        back = np.empty_like(host)
        gpu.copy_d2h(buf, back)
    finally:
        gpu.free_memory(buf)
    np.testing.assert_array_equal(back, host * 8)


def test_without_landlock_the_sandbox_says_so_and_still_supervises(monkeypatch: pytest.MonkeyPatch) -> None:
    # A kernel without Landlock (older than 5.19, or the LSM not enabled): the status says which layers hold, the
    # worker is not told to apply it (it would fail to start), and the exec supervision still bounds what it spawns.
    monkeypatch.setattr(_landlock, "abi", lambda: 0)
    sandbox = WorkerSandbox(enabled=True, backend="opencl", use_cgroups=False)
    assert sandbox.description == "namespaces+seccomp+rlimits"
    spec = sandbox.spec(None, [], None)
    assert _landlock.EXEC_ENV not in spec["env"] and spec["spawn"] is True
    monkeypatch.setattr(_landlock, "abi", lambda: 7)
    landlocked = WorkerSandbox(enabled=True, backend="cuda", use_cgroups=False)
    assert landlocked.description == "namespaces+seccomp+rlimits+landlock"
    cuda = landlocked.spec(None, [], None)
    assert cuda["env"][_landlock.EXEC_ENV] == "none" and cuda["spawn"] is False  # (CUDA: no exec at all)
