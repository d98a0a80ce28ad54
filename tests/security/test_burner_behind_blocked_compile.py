"""A kernel's CPU burner was free while a compile was in flight (found by a fresh attacker, issue 21): it burned a
CPU outside its turns for as long as its tenant liked, never charged to the tenant's fair share and never killed for
``max_cpu_seconds_outside_turns``.

The hole: the CPU watch (front/_cpuwatch.py) let a worker use one CPU outside its device turns while it served a
request of the front's that works on the host (``busy_seconds``: a compile, a copy), meant for the compile's own
CPU. But the allowance was for the worker, not for the compile: whatever thread used it, nothing was charged. And a
tenant can keep a compile in flight that uses no CPU at all: a kernel makes a FIFO in its private ``/tmp``
(``mknodat`` was allowed) and leaves a bare thread behind (``clone(CLONE_THREAD)`` is allowed); each compile's
source does ``#include "/tmp/gpb-fifo"``, so PoCL's clang blocks reading the FIFO; the thread opens the FIFO for
writing (it sleeps until a compile opens it: no CPU between compiles), spins for 2 s, then writes a newline, and the
compile finishes normally, well within ``compile_timeout_seconds``. Measured (2-core VM, PoCL,
max_cpu_seconds_outside_turns = 2 within 60 s): 11.9 CPU-seconds outside its turns (6 x the limit) in 12.2 s behind
2 compiles, not killed, its tenant charged 0.00 device-seconds.

Now:

- the sandbox refuses ``mknod``/``mknodat`` of every node but a regular file (FIFOs, sockets, devices: seccomp, on
  the mode's file type), so the first test's kernel gets EPERM;
- that alone would not do: a pipe reopened through ``/proc/self/fd`` blocks a compile that ``#include``s it just
  as well, which the second test does (its thread holds the pipe's write end and polls with one-byte writes, EPIPE
  while no compile reads it, then spins 2 s and closes it). So the watch allows, during host work, only the CPU of
  the worker's serving thread (the one that runs the compile: the worker's main thread, tid == the worker's pid,
  which the front finds on the host's /proc itself), at most one CPU; every other thread's CPU is outside the turns.
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

from ..conftest import worker_pids
from ..helpers import descendants
from .exploits import SYSCALL_SOURCE, check_arch

LIMIT = 2.0  # max_cpu_seconds_outside_turns
SPIN = 2.0  # seconds the planted thread burns for each time a compile reads its pipe
EPERM = 1
DOUBLINGS = 17  # a legitimate compile of 2^DOUBLINGS statements, a few CPU-seconds

MKNOD = SYSCALL_SOURCE + r"""
/* out: mknodat's result for a FIFO, a socket node and a regular file in the worker's private /tmp. */
__kernel void gpb_mknod(__global long* out) {
    __constant char* names[3] = {"/tmp/gpb-fifo", "/tmp/gpb-sock", "/tmp/gpb-file"};
    const long modes[3] = {0010000 | 0600, 0140000 | 0600, 0100000 | 0600};
    char path[32];
    for (int k = 0; k < 3; ++k) {
        int i = 0;
        for (; names[k][i]; ++i) path[i] = names[k][i];
        path[i] = 0;
        out[k] = sys6(259, -100, (long)path, modes[k], 0, 0, 0);
    }
}
"""

PLANT = SYSCALL_SOURCE + r"""
/* A bare thread of the worker's (clone with CLONE_VM|FS|FILES|SIGHAND|THREAD|SYSVSEM) on its own stack, registers
   only. Forever: open the pipe at `path` for writing; write one newline every 5 ms until one goes through (EPIPE
   while no compile has the pipe open to read: next to no CPU between compiles); then spin for `ns` nanoseconds (the
   compile meanwhile blocked reading it), write a newline, close (end-of-file: the compile goes on), sleep 50 ms
   (for the compile to see it) and again. */
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
        "2:\n\t"
        "movb $10, -72(%%rsp)\n\t"          /* write(fd, "\n", 1): 1 once a compile reads the pipe */
        "mov $1, %%eax\n\t"
        "mov %%r14, %%rdi\n\t"
        "lea -72(%%rsp), %%rsi\n\t"
        "mov $1, %%edx\n\t"
        "syscall\n\t"
        "cmp $1, %%rax\n\t"
        "je 3f\n\t"
        "movq $0, -96(%%rsp)\n\t"            /* nanosleep(5 ms) */
        "movq $5000000, -88(%%rsp)\n\t"
        "mov $35, %%eax\n\t"
        "lea -96(%%rsp), %%rdi\n\t"
        "xor %%esi, %%esi\n\t"
        "syscall\n\t"
        "jmp 2b\n\t"
        "3:\n\t"
        "mov $228, %%eax\n\t"               /* clock_gettime(CLOCK_MONOTONIC): the end of the spin */
        "mov $1, %%edi\n\t"
        "lea -64(%%rsp), %%rsi\n\t"
        "syscall\n\t"
        "mov -64(%%rsp), %%rax\n\t"
        "imul $1000000000, %%rax, %%rax\n\t"
        "add -56(%%rsp), %%rax\n\t"
        "add %%r13, %%rax\n\t"
        "mov %%rax, %%r15\n\t"
        "4:\n\t"
        "mov $228, %%eax\n\t"
        "mov $1, %%edi\n\t"
        "lea -64(%%rsp), %%rsi\n\t"
        "syscall\n\t"
        "mov -64(%%rsp), %%rax\n\t"
        "imul $1000000000, %%rax, %%rax\n\t"
        "add -56(%%rsp), %%rax\n\t"
        "cmp %%r15, %%rax\n\t"
        "jl 4b\n\t"
        "movb $10, -72(%%rsp)\n\t"          /* write(fd, "\n", 1), close: the compile goes on */
        "mov $1, %%eax\n\t"
        "mov %%r14, %%rdi\n\t"
        "lea -72(%%rsp), %%rsi\n\t"
        "mov $1, %%edx\n\t"
        "syscall\n\t"
        "mov $3, %%eax\n\t"
        "mov %%r14, %%rdi\n\t"
        "syscall\n\t"
        "movq $0, -96(%%rsp)\n\t"            /* nanosleep(50 ms) */
        "movq $50000000, -88(%%rsp)\n\t"
        "mov $35, %%eax\n\t"
        "lea -96(%%rsp), %%rdi\n\t"
        "xor %%esi, %%esi\n\t"
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

/* "/proc/self/fd/<fd>" into path. */
static void fd_path(char* path, long fd) {
    __constant char* prefix = "/proc/self/fd/";
    int i = 0;
    for (; prefix[i]; ++i) path[i] = prefix[i];
    char digits[20];
    int n = 0;
    do { digits[n++] = '0' + fd % 10; fd /= 10; } while (fd > 0);
    while (n > 0) path[i++] = digits[--n];
    path[i] = 0;
}

/* A pipe that needs no mknod: made with pipe2, kept by an O_PATH descriptor (through /proc/self/fd) that is neither
   a reader nor a writer, both ends closed. Opening /proc/self/fd/<that> opens the pipe afresh: a compile that
   includes it reads until every writer has closed, and a writer learns from EPIPE that no one reads.
   out: the O_PATH descriptor, the stack's address, the thread's tid. */
__kernel void gpb_plant(__global long* out, const long ns) {
    long stack = sys6(9, 0, 65536, 3, 0x22, -1, 0);        /* mmap: the thread's stack, the path's and fds' home */
    out[1] = stack;
    out[0] = out[2] = -1;
    if (stack < 0 && stack > -4096) return;
    int* fds = (int*)(stack + 128);
    if (sys6(293, (long)fds, 0, 0, 0, 0, 0) < 0) return;   /* pipe2 */
    char* path = (char*)stack;
    fd_path(path, fds[0]);
    out[0] = sys6(257, -100, (long)path, 010000000, 0, 0, 0);   /* openat(O_PATH) */
    sys6(3, fds[0], 0, 0, 0, 0, 0);
    sys6(3, fds[1], 0, 0, 0, 0, 0);
    if (out[0] < 0) return;
    fd_path(path, out[0]);
    out[2] = plant((long)path, ns, stack + 65536 - 256);
}
"""

@pytest.fixture(scope="module")
def broker() -> Iterator[BrokerProcess]:
    check_arch()
    settings: dict[str, object] = {"max_cpu_seconds_outside_turns": LIMIT, "cpu_outside_turns_window_seconds": 60.0,
                "tenant_crash_budget": 100}
    tenants = [TenantSpec("ops", admin=True), TenantSpec("mallory"), TenantSpec("alice")]
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


def test_a_kernel_cannot_make_a_fifo_or_a_socket_node(broker: BrokerProcess) -> None:
    with connect(broker.target, token=broker.tokens["mallory"]) as mallory:
        kernel = mallory.compile_kernel(MKNOD, "gpb_mknod")
        out = mallory.allocate_memory(64)
        mallory.execute_kernel(kernel, 1, 1, [out])
        mallory.synchronize()
        results = np.zeros(8, dtype=np.int64)
        mallory.copy_d2h(out, results)
        assert list(results[:3]) == [-EPERM, -EPERM, 0], results[:3]  # FIFO, socket: refused; a regular file: made


def test_a_compile_longer_than_the_limit_is_its_own_and_not_killed(broker: BrokerProcess) -> None:
    # The compile's CPU is the serving thread's, found by the front: a compile that uses more than the limit on it
    # is not stopped, and charged no more than its own CPU (on PoCL, whose device is those CPUs, a compile's CPU is
    # charged to its tenant's fair share: test_host_work_charged.py).
    # (PoCL's build parses: 2^DOUBLINGS statements through a chain of macros keep its front end busy)
    macros = "".join(f"#define S{k + 1} S{k} S{k}\n" for k in range(DOUBLINGS))
    source = (f"#define S0 acc = acc * 1.5f + x[1];\n{macros}"
              f"__kernel void gpb_big(__global float* x) {{\n    float acc = x[0];\n    S{DOUBLINGS}\n"
              "    x[0] = acc;\n}\n")
    with connect(broker.target, token=broker.tokens["alice"]) as alice, \
            AdminClient(broker.target, broker.tokens["ops"]) as admin:
        alice.compile_kernel("__kernel void gpb_warm(__global float* x) { x[0] = 1; }", "gpb_warm")
        [worker] = worker_pids(broker, "alice")
        before = _tree_cpu(worker)
        alice.compile_kernel(source, "gpb_big")
        used = _tree_cpu(worker) - before
        usage = {u.tenant: u for u in admin.usage(window_seconds=120).tenants}
        charged = usage["alice"].device_seconds if "alice" in usage else 0.0
    assert used > 1.5 * LIMIT, f"the compile used only {used:.1f} CPU-seconds: make it longer"
    assert worker in worker_pids(broker, "alice") and "'alice'" not in broker.log_tail(1_000_000), used
    units = min(len(os.sched_getaffinity(0)), os.cpu_count() or 1)  # (PoCL's compute units: this host's CPUs)
    assert charged <= used / units + 0.5, (
        f"a compile of {used:.1f} CPU-seconds was charged {charged:.2f} device-seconds")


def test_a_burner_hidden_behind_a_blocked_compile_is_charged_and_stopped(broker: BrokerProcess) -> None:
    with connect(broker.target, token=broker.tokens["mallory"]) as mallory, \
            AdminClient(broker.target, broker.tokens["ops"]) as admin:
        kernel = mallory.compile_kernel(PLANT, "gpb_plant")
        out = mallory.allocate_memory(64)
        [worker] = worker_pids(broker, "mallory")
        mallory.execute_kernel(kernel, 1, 1, [out, np.int64(int(SPIN * 1e9))])
        mallory.synchronize()
        planted = np.zeros(8, dtype=np.int64)
        mallory.copy_d2h(out, planted)
        assert planted[0] >= 0 and planted[2] > 0, planted[:3]  # the pipe kept, the thread running
        include = f"/proc/self/fd/{planted[0]}"

        before, start = _tree_cpu(worker), time.monotonic()
        compiles = 0
        errors: list[GpuBrokerError] = []
        # Compile until the thread has burned 4 x the limit (or a minute passes): each compile blocks on the pipe
        # while the thread spins.
        while _tree_cpu(worker) - before < 4 * LIMIT and time.monotonic() - start < 60:
            source = (f'#include "{include}"\n'
                      f"__kernel void gpb_k{compiles}(__global float* x) {{ x[0] = {compiles}; }}\n")
            try:
                mallory.compile_kernel(source, f"gpb_k{compiles}")
            except GpuBrokerError as exc:  # (the worker killed: what the limit does)
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
        print(f"killed after {burned:.1f} CPU-seconds in {took:.1f} s behind {compiles} compiles; charged "
              f"{charged:.2f} device-seconds; errors: {errors}")
