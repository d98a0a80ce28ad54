"""A thread a kernel left running is bounded even while its tenant keeps calls in flight (found by a fresh attacker).

The CPU watch allows a worker CPU outside its device turns only while it serves a request that works on the host's
CPU (a compile, a copy). It used to allow a CPU whenever any request was in flight: a tenant whose kernel left a
thread spinning only had to keep cheap calls going (three sessions allocating and freeing over gRPC) for the
spinner's CPU to pass as the requests', uncharged and never stopped. On a CPU device that CPU is the device.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from gpubroker.broker.launcher import BrokerProcess, TenantSpec
from gpubroker.client import GpuBrokerError, ModuleFormat, connect

from ..conftest import worker_pids
from ..helpers import wait_for
from .exploits import check_arch

LIMIT = 2.0  # max_cpu_seconds_outside_turns
DURATION = 15.0
SESSIONS = 3

SPIN_SOURCE = r"""
/* A raw thread (CLONE_VM|FS|FILES|SIGHAND|THREAD|SYSVSEM) on a stack of its own, made in one asm block: it spins
   ``iters`` iterations, sleeps 1 ms, and again, forever. */
__kernel void gpb_spinner(__global char* stack, const long size, const long iters, __global long* res) {
    long r;
    long top = ((long)(stack + size)) & ~15L;
    __asm__ volatile(
        "mov $56, %%eax\n\t" "mov $0x50f00, %%edi\n\t" "mov %1, %%rsi\n\t" "xor %%edx, %%edx\n\t"
        "xor %%r10d, %%r10d\n\t" "xor %%r8d, %%r8d\n\t" "syscall\n\t"
        "test %%rax, %%rax\n\t" "jnz 3f\n\t"
        "sub $16, %%rsp\n\t" "movq $0, (%%rsp)\n\t" "movq $1000000, 8(%%rsp)\n\t"
        "1: mov %2, %%rcx\n\t"
        "2: dec %%rcx\n\t" "jnz 2b\n\t"
        "mov $35, %%eax\n\t" "mov %%rsp, %%rdi\n\t" "xor %%esi, %%esi\n\t" "syscall\n\t"
        "jmp 1b\n\t"
        "3:\n\t"
        : "=&a"(r) : "r"(top), "r"(iters)
        : "rcx", "r11", "rdi", "rsi", "rdx", "r10", "r8", "r9", "memory");
    res[0] = r;
}
"""


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerProcess]:
    check_arch()
    tmp = tmp_path_factory.mktemp("busy")
    settings = {"cache_dir": str(tmp / "caches"), "max_cpu_seconds_outside_turns": LIMIT,
                "cpu_outside_turns_window_seconds": 30.0}
    with BrokerProcess([TenantSpec("alice")], backend="opencl", settings=settings) as proc:
        yield proc


def cpu_seconds(pid: int) -> float:
    import os

    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def thread_cpu(pid: int) -> dict[int, float]:
    import os

    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            fields = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[int(tid)] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return out


def test_a_left_thread_is_bounded_while_calls_are_in_flight(broker: BrokerProcess) -> None:
    token = broker.tokens["alice"]
    stop = threading.Event()
    errors: list[str] = []

    calls = [0]

    def keep_busy() -> None:
        with connect(broker.target, token=token, transport="grpc", shared_memory=False, timeout=30) as gpu:
            while not stop.is_set():
                try:
                    gpu.free_memory(gpu.allocate_memory(4096))
                    calls[0] += 1
                except GpuBrokerError as exc:
                    errors.append(f"{type(exc).__name__}: {exc}")
                    return

    with connect(broker.target, token=token, transport="grpc", shared_memory=False, timeout=30) as gpu:
        module = gpu.load_module(SPIN_SOURCE, ModuleFormat.OPENCL_C)
        kernel = gpu.get_kernel(module, "gpb_spinner")
        stack, res = gpu.allocate_memory(1 << 16), gpu.allocate_memory(8)
        (worker,) = worker_pids(broker, "alice")
        threads = [threading.Thread(target=keep_busy, daemon=True) for _ in range(SESSIONS)]
        for t in threads:
            t.start()
        wait_for(lambda: calls[0] >= 10 * SESSIONS, 30, "the sessions to be calling")
        gpu.execute_kernel(kernel, 1, 1, [stack, np.int64(1 << 16), np.int64(2_000_000), res])
        gpu.synchronize()
        out = np.empty(1, dtype=np.int64)
        gpu.copy_d2h(res, out)
        assert out[0] > 0, f"the spinner was not made: {out[0]}"
        start, cpu0 = time.monotonic(), cpu_seconds(worker)
        threads0 = thread_cpu(worker)
        with contextlib.suppress(AssertionError):  # (what it did by the deadline is told below)
            wait_for(lambda: bool(errors) or worker_pids(broker, "alice") != [worker], DURATION,
                     "the worker to be stopped")
        alive = worker_pids(broker, "alice") == [worker]
        spun = 0.0
        if alive:
            # (the spinner's tid is its namespace's: take the thread that used the most meanwhile)
            spun = max(cpu - threads0.get(tid, 0.0) for tid, cpu in thread_cpu(worker).items())
            used = cpu_seconds(worker) - cpu0
        else:
            used = float("nan")
        stop.set()
        for t in threads:
            t.join(30)
        print(f"\nafter {time.monotonic() - start:.1f} s: worker alive {alive}, the kernel's thread used {spun:.1f} "
              f"CPU-s, the worker {used:.1f} CPU-s (limit outside turns {LIMIT}); calls' errors {errors[:1]}")
        assert not alive, (
            f"a thread the kernel left running used {spun:.1f} CPU-seconds outside its tenant's turns in "
            f"{DURATION:g} s, past max_cpu_seconds_outside_turns = {LIMIT}, and the worker was neither killed nor "
            "stopped: its tenant kept calls in flight")
