"""A worker's output flood costs the front's event loop CPU that nobody is charged for.

The front reads each worker's stdout and stderr pipes on its event loop and always drains them (workers/_output.py:
"so a worker never blocks on a full pipe"); over the rate limit it drops the bytes, but only after reading them:
a read of up to 256 KiB, a search for the last newline and a copy of the chunk, per chunk, on the front's one event
loop. A tenant's kernel that writes to its stderr as fast as it can (two PoCL work-items, 64 KiB per write(2),
within its device turn: the time limits see honest device work) makes the front read gigabytes a second. The
worker's own CPU is charged to its tenant; the front's is not, and it is the loop that serves every other tenant's
calls, hellos and health checks.

Measured here (2 cores, shared): with its stderr pipe grown to 1 MiB (F_SETPIPE_SZ on the pipe the front made), the
worker wrote 3,608 MiB in 3.1 s and the front used 1.28 CPU-s meanwhile (42% of a CPU; 14% with the default 64 KiB
pipe; 0.70 CPU-s for 2,000 MiB at a load average of 8). One flooding tenant per CPU the front has would take all
of its event loop.

The fix (issue 21, round 9): the front reads a pipe no faster than it may log from it. Once the rate limit has
refused something, the pipe is not read until a line could be logged again (at least 0.1 s): the worker then
blocks in its own write, within its own turn and time limit. After: the same flood moved a few MiB and the front
used about as much CPU as idle.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from gpubroker.broker.launcher import BrokerProcess, TenantSpec
from gpubroker.client import ModuleFormat, connect

from .exploits import SYSCALL_SOURCE, check_arch

FLOOD_SECONDS = 3.0
# What the front may spend on one worker's output over the whole flood (an idle front uses ~0.05 CPU-s in 3 s; a
# front that reads no faster than it logs, far less than this). An absolute bound: on a loaded machine the worker
# writes less, and the front's share of a CPU with it.
ALLOWED_FRONT_CPU_SECONDS = 0.25

SOURCE = SYSCALL_SOURCE + r"""
/* Each work-item writes its 64 KiB block to stderr until `seconds` have passed (CLOCK_MONOTONIC). */
__kernel void gpb_flood(__global char* block, const long seconds, __global long* res) {
    __global long* ts = (__global long*)(block + 65536) + 4 * get_global_id(0);
    sys6(228, 1, (long)ts, 0, 0, 0, 0);
    long end = ts[0] + seconds, written = 0;
    sys6(72, 2, 1031, 1 << 20, 0, 0, 0);                 /* fcntl(F_SETPIPE_SZ, 1 MiB): bigger reads for the front */
    for (;;) {
        for (int i = 0; i < 64; ++i) {
            long w = sys6(1, 2, (long)block, 65536, 0, 0, 0);
            if (w > 0) written += w;
        }
        sys6(228, 1, (long)ts, 0, 0, 0, 0);
        if (ts[0] >= end) break;
    }
    res[get_global_id(0)] = written;
}
"""


def cpu_seconds(pid: int) -> float:
    """utime + stime of the process (all its threads), in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / 100.0  # (USER_HZ is 100 on Linux)


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerProcess]:
    check_arch()
    tmp = tmp_path_factory.mktemp("flood")
    with BrokerProcess([TenantSpec("mallory")], backend="opencl",
                       settings={"cache_dir": str(tmp / "caches")}) as proc:
        yield proc


def test_a_workers_output_flood_does_not_take_the_fronts_cpu(broker: BrokerProcess) -> None:
    assert broker.process is not None
    front = broker.process.pid
    with connect(broker.target, token=broker.tokens["mallory"], timeout=120) as gpu:
        kernel = gpu.get_kernel(gpu.load_module(SOURCE, ModuleFormat.OPENCL_C), "gpb_flood")
        block = gpu.allocate_memory(65536 + 4096)
        gpu.copy_h2d(np.frombuffer(b"x" * 65535 + b"\n" + b"\0" * 4096, dtype=np.uint8), block)
        res = gpu.allocate_memory(64)
        gpu.synchronize()
        cpu0, t0 = cpu_seconds(front), time.monotonic()
        gpu.execute_kernel(kernel, 2, 1, [block, np.int64(FLOOD_SECONDS), res])
        gpu.synchronize()
        cpu, wall = cpu_seconds(front) - cpu0, time.monotonic() - t0
        out = np.empty(8, dtype=np.int64)
        gpu.copy_d2h(res, out)
    written = int(out[0] + out[1])
    share = cpu / wall
    print(f"\nthe worker wrote {written >> 20} MiB to its stderr in {wall:.1f} s; the front used {cpu:.2f} CPU-s "
          f"meanwhile ({share:.0%} of a CPU)")
    assert cpu < ALLOWED_FRONT_CPU_SECONDS, (
        f"a tenant's kernel wrote {written >> 20} MiB to its worker's stderr and the front spent {cpu:.2f} CPU-s "
        f"({share:.0%} of a CPU) of its event loop reading it, charged to nobody")
