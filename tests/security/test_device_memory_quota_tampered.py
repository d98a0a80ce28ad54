"""A kernel that overwrites its worker's quota: on PoCL the kernel's memory limit holds, and the front stops it.

The device-memory quota is counted inside the tenant's own worker (worker/_handles.py ``Tables.reserve``), which
runs the tenant's native code. A PoCL kernel reads ``/proc/self/maps``, finds the quota's PyLong (ob_size 1, its one
digit the quota) and rewrites the digit to 2^30 - 1; measured before the fix, seven 100 MB allocations then
succeeded against a 123 MB quota, stopped only by the worker's address-space limit, while Usage and the metrics
showed the quota as used (the front clamps the worker's report).

What bounds it:

- on PoCL a buffer is host memory, so the kernel-enforced bound is the worker's memory limit (worker_memory_max,
  by default the tenant's quota plus its shared memory and the runtime's own: RLIMIT_DATA, or memory.max where
  the broker has a cgroup): the tampered worker never holds more than that, whatever its accounting says;
- a worker never rightly reports more in use than the highest quota the front sent it, so the front takes such a
  report as its accounting overwritten: it kills the worker at once, the tenant's calls fail with
  RESOURCE_EXHAUSTED saying so, the kill is the tenant's crash and a ``gpubroker_device_memory_kills{cause="report"}``
  (before the fix the report was clamped and the worker served on);
- another tenant is unharmed, and the tenant's next session gets a fresh worker whose quota holds.

(On CUDA the front also reads every worker's device memory from NVML: test_device_memory_nvml_watch.py.)
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from gpubroker.broker.launcher import BrokerProcess, TenantSpec
from gpubroker.client import GpuBrokerError, RemoteGpu, ResourceExhausted, connect

from ..conftest import worker_pids
from ..helpers import wait_for
from ._probes import metric
from .exploits import SYSCALL_SOURCE

QUOTA = 123_456_789  # distinctive: a single-digit PyLong in the worker
BOB_QUOTA = 256 << 20
CHUNK = 100_000_000
SOURCE = SYSCALL_SOURCE + r"""
__kernel void maps(__global char* buf, long cap, __global long* out) {
    long fd = sys6(257, -100, (long)buf, 0, 0, 0, 0);   /* openat("/proc/self/maps") */
    out[0] = fd;
    if (fd < 0) return;
    long got = 0;
    while (got < cap - 4096) { long n = sys6(0, fd, (long)(buf + got), 4096, 0, 0, 0); if (n <= 0) break; got += n; }
    out[1] = got;
    sys6(3, fd, 0, 0, 0, 0, 0);
}
__kernel void patch(__global long* ranges, int n, long want, long give, __global long* out) {
    long hits = 0;
    for (int r = 0; r < n; r++) {
        __global long* p = (__global long*)ranges[2 * r];
        __global long* end = (__global long*)ranges[2 * r + 1];
        for (p = p + 1; p + 2 <= end; p++) {
            if (p[0] == 1 && (p[1] & 0xffffffffL) == want && p[-1] > 0x10000) {  /* ob_size 1, the digit, ob_type */
                ((__global uint*)&p[1])[0] = (uint)give;
                hits++;
            }
        }
    }
    out[0] = hits;
}
"""


@pytest.fixture(scope="module")
def broker() -> Iterator[BrokerProcess]:
    tenants = [TenantSpec("alice", memory_quota=QUOTA), TenantSpec("bob", memory_quota=BOB_QUOTA)]
    with BrokerProcess(tenants, backend="opencl", settings={"metrics_listen": "127.0.0.1:0"}) as proc:
        yield proc




def _memory_limit(pid: int) -> int:
    """The worker's memory limit as the kernel holds it: its RLIMIT_DATA (/proc/PID/limits: "Max data size  soft
    hard  bytes"), or where a cgroup holds it instead, its cgroup's memory.max."""
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max data size") and line.split()[3] != "unlimited":
            return int(line.split()[3])
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        if line.startswith("0::"):
            return int(Path(f"/sys/fs/cgroup{line[3:]}/memory.max").read_text())
    raise AssertionError("the worker has no memory limit")


def _tamper(gpu: RemoteGpu) -> int:
    """Overwrite the worker's quota with 2^30 - 1 from a kernel; the bytes this held to do it."""
    maps, patch = gpu.compile_kernel(SOURCE, "maps"), gpu.compile_kernel(SOURCE, "patch")
    cap = 1 << 20
    buf, out = gpu.allocate_memory(cap), gpu.allocate_memory(64)
    gpu.copy_h2d(b"/proc/self/maps\0", buf)
    gpu.execute_kernel(maps, 1, 1, [buf, np.int64(cap), out])
    gpu.synchronize()
    got = np.zeros(8, np.int64)
    gpu.copy_d2h(out, got)
    assert got[0] >= 0, f"open /proc/self/maps: {got[0]}"
    raw = bytearray(cap)
    gpu.copy_d2h(buf, raw)
    ranges = []
    for line in raw[:got[1]].decode().splitlines():
        fields = line.split()
        if fields[1].startswith("rw") and not (len(fields) >= 6 and fields[5].startswith("[v")):
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            if hi - lo <= 256 << 20:
                ranges.append((lo, hi))
    with pytest.raises(ResourceExhausted, match="memory quota exceeded"):
        gpu.allocate_memory(2 * CHUNK)  # the quota holds before the patch
    table = gpu.allocate_memory(16 * len(ranges))
    gpu.copy_h2d(np.array(ranges, np.int64).ravel(), table)
    gpu.execute_kernel(patch, 1, 1, [table, np.int32(len(ranges)), np.int64(QUOTA), np.int64((1 << 30) - 1), out])
    gpu.synchronize()
    gpu.copy_d2h(out, got)
    assert got[0] >= 1, "the kernel found no quota to overwrite"
    return cap + 64 + 16 * len(ranges)


def test_a_tampered_quota_is_held_by_the_memory_limit_and_the_worker_is_stopped(broker: BrokerProcess) -> None:
    bob = connect(broker.target, token=broker.tokens["bob"])
    bob_buf = bob.allocate_memory(CHUNK)
    gpu = connect(broker.target, token=broker.tokens["alice"])
    (pid,) = worker_pids(broker, "alice")
    limit = _memory_limit(pid)
    held = _tamper(gpu)
    stopped: GpuBrokerError | None = None
    for _ in range(limit // CHUNK + 2):  # more than the memory limit could ever hold
        try:
            gpu.allocate_memory(CHUNK)
        except GpuBrokerError as exc:  # the memory limit (out of memory), or the front stopping the worker
            stopped = exc
            break
        held += CHUNK
    assert stopped is not None and held <= limit, f"alice held {held:,} bytes past her worker's limit of {limit:,}"

    # Her worker reported more than her quota (at a fence, or asked now): the front stopped it, charged to her.
    def killed() -> bool:
        try:
            gpu.device_info()
            gpu.allocate_memory(64)
        except ResourceExhausted as exc:
            assert "more than its quota" in exc.message and "accounting was overwritten" in exc.message, exc.message
            return True
        return False

    wait_for(killed, 10, "alice's worker killed for reporting more than her quota in use")
    wait_for(lambda: metric(broker, "gpubroker_device_memory_kills_total", tenant="alice", cause="report") == 1,
             10, "the kill counted")
    assert metric(broker, "gpubroker_tenant_worker_crashes_total", tenant="alice") == 1
    assert metric(broker, "gpubroker_tenant_worker_crashes_total", tenant="bob") == 0
    assert metric(broker, "gpubroker_device_memory_kills_total", tenant="bob", cause="report") == 0

    # Bob was unharmed throughout; alice's next session has a fresh worker whose quota holds again.
    data = np.arange(CHUNK // 8, dtype=np.int64)
    bob.copy_h2d(data, bob_buf)
    back = np.empty_like(data)
    bob.copy_d2h(bob_buf, back)
    assert (back == data).all()
    assert bob.device_info().memory_used == CHUNK
    again = connect(broker.target, token=broker.tokens["alice"])
    with pytest.raises(ResourceExhausted, match="memory quota exceeded"):
        again.allocate_memory(2 * CHUNK)
    again.allocate_memory(CHUNK)
    assert again.device_info().memory_used == CHUNK
