"""The device-memory quota is enforced only by the tenant's own worker, which runs the tenant's native code.

The hole: ``memory`` / ``device_memory`` are checked in the worker (worker/_handles.py ``Tables.reserve``), with the
quota the front sent in ``SetLimits``; the front keeps no count of its own (workers/_client.py: "the mirror only
informs placement and views: the worker enforces the quota"), and a link's Allocate never passes the front at all.
The security docs' table says device memory is checked "by the front before the worker allocates" (*front*). A
kernel can write anywhere in its worker's memory: here it reads ``/proc/self/maps``, finds the quota's PyLong
(ob_size 1, its one digit the quota) and rewrites the digit to 2^30 - 1.

Measured (PoCL, quota 123,456,789 bytes): before the patch a 200 MB Allocate is refused; after it, 7 Allocates of
100 MB succeed (700,000,000 bytes, 5.7x the quota), stopped only by the worker's address-space limit (the quota
plus the runtime's 512 MiB + 32 MiB per CPU), while DeviceInfo, Usage and gpubroker_memory_used_bytes show
memory_used = the quota (the front clamps the worker's report). On CUDA nothing but the device bounds it: one
tenant's worker can take the whole GPU's memory, and every other tenant's allocations on that device fail.

Suggested fix: count device memory in the front, on every path: every Allocate/Free (typed, Commands batches, and
links, which the front must then see: have the worker ask the front for a reservation before it allocates, the
front refusing past the quota, and return it on free, session close and worker death); on CUDA also bound the
worker's context from outside (an MPS client memory limit, `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`, or NVML-reported
per-process use checked by the front, killing a worker over its quota).
"""

from __future__ import annotations

import numpy as np
import pytest

from gpubroker.broker.launcher import BrokerProcess, TenantSpec
from gpubroker.client import GpuBrokerError, connect

from ..exploits import SYSCALL_SOURCE

QUOTA = 123_456_789  # distinctive: a single-digit PyLong in the worker
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


def test_a_tenant_cannot_allocate_past_its_memory_quota() -> None:
    with BrokerProcess([TenantSpec("alice", memory_quota=QUOTA)], backend="opencl") as broker:
        gpu = connect(broker.target, token=broker.tokens["alice"])
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
        with pytest.raises(GpuBrokerError):
            gpu.allocate_memory(200_000_000)  # the quota holds before the patch
        table = gpu.allocate_memory(16 * len(ranges))
        gpu.copy_h2d(np.array(ranges, np.int64).ravel(), table)
        gpu.execute_kernel(patch, 1, 1, [table, np.int32(len(ranges)), np.int64(QUOTA), np.int64((1 << 30) - 1), out])
        gpu.synchronize()
        held = []
        try:
            for _ in range(8):
                held.append(gpu.allocate_memory(100_000_000))
        except GpuBrokerError:
            pass
        total = 100_000_000 * len(held) + cap + 64 + 16 * len(ranges)
        assert total <= QUOTA, (f"alice holds {total:,} bytes of device memory against a quota of {QUOTA:,} "
                                f"(the front reports {gpu.device_info().memory_used:,} used)")
