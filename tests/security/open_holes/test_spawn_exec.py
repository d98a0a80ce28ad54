"""attack3: a kernel makes processes with posix_spawn's clone shape and execs them; each gets rlimits of its own.

On OpenCL the worker's seccomp filter lets ``clone(CLONE_VM | CLONE_VFORK)`` through (PoCL's linker starts with
posix_spawn), and ``execve`` is allowed. So a kernel can do what posix_spawn does: a vfork-style child that execs
any program the sandbox can see (here the worker's own Python). The child is a new process with a fresh address
space, and without a cgroup the worker's memory bound is a pair of *per-process* rlimits (RLIMIT_DATA, RLIMIT_AS):
every spawned process gets the whole budget again. Five children of 300 MiB each make the worker's tree hold far
more than ``worker_memory_max``; up to ``worker_pids_max`` of them could be made.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from gpubroker.broker.launcher import BrokerProcess, TenantSpec
from gpubroker.client import ModuleFormat, connect

from ...conftest import worker_pids
from ...helpers import descendants, wait_for
from ..exploits import check_arch

MiB = 1 << 20
MEMORY_MAX = 1024 * MiB
CHILDREN = 5
CHILD_BYTES = 300 * MiB

SPAWN_SOURCE = r"""
/* clone(CLONE_VM | CLONE_VFORK | SIGCHLD) and, in the child, execve at once: posix_spawn's shape, all in one asm
   block so the child touches nothing of the parent's stack. */
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
/* blob: NUL-terminated strings at offs[0..nargs); argv: room for nargs + 1 pointers. */
__kernel void gpb_spawn(__global char* blob, __global const long* offs, const int nargs, __global long* argv,
                        const int times, __global long* res) {
    for (int i = 0; i < nargs; ++i) argv[i] = (long)(blob + offs[i]);
    argv[nargs] = 0;
    for (int k = 0; k < times; ++k)
        res[k] = spawn(0x00000100 | 0x00004000 | 17, (long)(blob + offs[0]), (long)argv);
}
"""


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerProcess]:
    check_arch()
    tmp = tmp_path_factory.mktemp("spawn")
    settings = {"cache_dir": str(tmp / "caches"), "worker_memory_max": MEMORY_MAX,
                "worker_tmp_max_bytes": 32 * MiB, "cache_max_bytes": 64 * MiB}
    with BrokerProcess([TenantSpec("alice", memory_quota=256 * MiB)], backend="opencl",
                       settings=settings) as proc:
        yield proc


def rss(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def test_a_kernel_cannot_spawn_processes_with_budgets_of_their_own(broker: BrokerProcess) -> None:
    python = os.path.realpath(sys.executable)
    code = f"import time; b = b'x' * {CHILD_BYTES}; open('/dev/null', 'w'); time.sleep(60)"
    args = [python, "-S", "-c", code]
    blob = bytearray()
    offs = []
    for a in args:
        offs.append(len(blob))
        blob += a.encode() + b"\0"
    blob += b"\0" * (-len(blob) % 64)
    assert broker.process is not None
    with connect(broker.target, token=broker.tokens["alice"], timeout=60) as gpu:
        module = gpu.load_module(SPAWN_SOURCE, ModuleFormat.OPENCL_C)
        kernel = gpu.get_kernel(module, "gpb_spawn")
        bufs = [gpu.allocate_memory(len(blob)), gpu.allocate_memory(8 * len(offs)),
                gpu.allocate_memory(8 * (len(args) + 1)), gpu.allocate_memory(8 * CHILDREN)]
        gpu.copy_h2d(bytes(blob), bufs[0])
        gpu.copy_h2d(np.array(offs, dtype=np.int64), bufs[1])
        gpu.execute_kernel(kernel, 1, 1, [bufs[0], bufs[1], np.int32(len(args)), bufs[2], np.int32(CHILDREN),
                                          bufs[3]])
        gpu.synchronize()
        res = np.empty(CHILDREN, dtype=np.int64)
        gpu.copy_d2h(bufs[3], res)
        (worker,) = worker_pids(broker, "alice")
        print(f"\nclone results {res.tolist()}")

        def tree_rss() -> int:
            return sum(rss(p) for p in descendants(worker))

        # The children allocate as they start: wait until they have (or a deadline says they could not).
        spawned = [p for p in descendants(worker)]
        if spawned:
            wait_for(lambda: tree_rss() >= CHILDREN * CHILD_BYTES * 0.9, 30, "the children to fill their memory")
        total = rss(worker) + tree_rss()
        print(f"worker {worker}: {len(spawned)} processes below it; worker + children RSS {total / MiB:.0f} MiB "
              f"(worker_memory_max {MEMORY_MAX // MiB} MiB)")
        assert not spawned, f"the worker made {len(spawned)} processes (clone results {res.tolist()})"
        assert total <= MEMORY_MAX
