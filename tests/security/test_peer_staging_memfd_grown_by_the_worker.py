"""CopyPeer's host staging: a kernel that keeps the memfd the front hands its worker cannot grow it, nor collect more.

The hole: between two devices without a peer path (OpenCL; CUDA without peer access), ``CopyPeer`` stages the copy
through a memfd the front makes and sends to both workers (``RegisterSegment``, SCM_RIGHTS). It was unsealed, made
afresh for every copy up to 8 MiB, and counted nowhere. A kernel running while the copy starts (a launch returns at
once; the copy's Synchronize comes after the registration) found the memfd in its worker's descriptors, ``dup``ed it
and ``fallocate``d it up to ``RLIMIT_FSIZE``: shmem pages no rlimit of the worker counts (not mapped: not RLIMIT_AS
or RLIMIT_DATA), in no quota, held as long as the worker lives, one more file per copy. Measured (PoCL, two pthread
devices, quota 64 MiB, worker_memory_max 1 GiB): 18 copies of 1 MiB, +1,152 MiB of host Shmem.

Now (front/_peer_cache.py): one staging per tenant, reused by every host-path copy, sealed at its size
(F_SEAL_GROW | F_SEAL_SHRINK | F_SEAL_SEAL: the kernel refuses the ``fallocate``, EPERM), and counted in the
tenant's shared memory until every worker it went to has exited. The kernel here measures what it holds itself
(``fstat`` of each file it kept: its allocated blocks), so no other process on the host moves the figures.
"""

from __future__ import annotations

import numpy as np

from gpubroker.broker.launcher import BrokerProcess, TenantSpec
from gpubroker.client import AdminClient, connect

from .exploits import SYSCALL_SOURCE

LIMIT = 1 << 30  # worker_memory_max
QUOTA = 64 << 20  # mallory's memory, so its shared memory
STAGING = QUOTA // 4  # the staging's size: a quarter of the tenant's shared memory, 128 MiB at most
GROW = 64 << 20  # RLIMIT_FSIZE is at least cache_max_bytes (64 MiB)
COPIES = LIMIT // GROW + 4
EPERM = -1
# Look through the worker's descriptors for the front's staging (its memfd's name), skipping the copies this kernel
# kept before (s[200 + fd], left set across launches); keep a dup of it and grow it to ``size``. Then s[0]: the
# descriptor found (-1: none), s[1]: its file's inode, s[2]: fallocate's result, s[3]: the bytes its file holds.
SOURCE = SYSCALL_SOURCE + r"""
__kernel void grab(__global long* s, long size, long secs) {
    const char want[] = "/memfd:gpubroker-peer";
    char path[32] = "/proc/self/fd/";
    char link[64];
    sys6(228, 1, (long)&s[40], 0, 0, 0, 0);                               /* clock_gettime(CLOCK_MONOTONIC) */
    long end = s[40] + secs;
    s[0] = -1;
    while (1) {
        for (int fd = 3; fd < 1024; fd++) {
            if (s[200 + fd]) continue;
            int n = 14, digits = fd >= 1000 ? 4 : fd >= 100 ? 3 : fd >= 10 ? 2 : 1;
            for (int k = digits - 1, v = fd; k >= 0; k--, v /= 10) path[n + k] = '0' + v % 10;
            path[n + digits] = 0;
            long len = sys6(89, (long)path, (long)link, sizeof(link), 0, 0, 0);   /* readlink */
            if (len < (long)sizeof(want) - 1) continue;
            int same = 1;
            for (int k = 0; k < (int)sizeof(want) - 1; k++) same &= link[k] == want[k];
            if (!same) continue;
            long kept = sys6(32, fd, 0, 0, 0, 0, 0);                              /* dup */
            if (kept < 0 || kept >= 1024) return;
            s[200 + kept] = 1;
            s[2] = sys6(285, kept, 0, 0, size, 0, 0);                            /* fallocate(kept, 0, 0, size) */
            sys6(5, kept, (long)&s[50], 0, 0, 0, 0);                              /* fstat */
            s[0] = fd;
            s[1] = s[51];                                                         /* st_ino */
            s[3] = s[50 + 8] * 512;                                               /* st_blocks */
            return;
        }
        sys6(228, 1, (long)&s[42], 0, 0, 0, 0);
        if (s[42] >= end) return;
    }
}
"""


def _shared_bytes(broker: BrokerProcess, tenant: str) -> int:
    """The tenant's shared memory as the front counts it (Usage: its links' rings, segments, CopyPeer's staging)."""
    with AdminClient(broker.target, broker.tokens["ops"]) as admin:
        return max(u.shared_bytes for u in admin.usage().tenants if u.tenant == tenant)


def test_a_worker_cannot_grow_the_fronts_staging_memfd_nor_collect_more() -> None:
    tenants = [TenantSpec("ops", admin=True), TenantSpec("mallory", memory_quota=QUOTA)]
    with BrokerProcess(tenants, backend="opencl", settings={"worker_memory_max": LIMIT},
                       env={"POCL_DEVICES": "pthread pthread"}) as broker, \
            connect(broker.target, token=broker.tokens["mallory"], device=0) as here, \
            connect(broker.target, token=broker.tokens["mallory"], device=1) as there:
        grab = here.compile_kernel(SOURCE, "grab")
        scratch = here.allocate_memory(16 << 10)
        here.copy_h2d(np.zeros(2048, dtype=np.int64), scratch)
        src, dst = here.allocate_memory(1 << 20), there.allocate_memory(1 << 20)
        before = _shared_bytes(broker, "mallory")  # (its sessions' rings)
        held: dict[int, int] = {}  # the files the kernel kept, by inode: the bytes each holds
        refused = 0
        for _ in range(COPIES):
            here.copy_h2d(np.full(4, -1, dtype=np.int64), scratch)  # (the kept marks at s[200:] stay)
            here.execute_kernel(grab, 1, 1, [scratch, np.int64(GROW), np.int64(10)])  # (returns at once)
            assert here.copy_peer(src, there, dst, 1 << 20) == "host"  # (after the kernel: its Synchronize)
            found = np.zeros(4, dtype=np.int64)
            here.copy_d2h(scratch, found)
            assert found[0] >= 0, "the kernel saw no staging memfd in its worker"
            held[int(found[1])] = max(held.get(int(found[1]), 0), int(found[3]))
            refused += int(found[2] == EPERM)
        counted = _shared_bytes(broker, "mallory") - before
        total = sum(held.values())
        print(f"\n{COPIES} copies: the kernel kept {len(held)} staging memfds holding {total >> 20} MiB "
              f"({refused} fallocates to {GROW >> 20} MiB refused); mallory's shared memory counted: {counted} bytes")
        assert total < LIMIT, (f"mallory's worker holds {total >> 20} MiB of host shared memory in the front's "
                               f"CopyPeer staging memfds, worker_memory_max = {LIMIT >> 20} MiB, quota 64 MiB")
        assert len(held) == 1 and refused == COPIES  # one file, sealed: every fallocate past its size refused
        assert counted == STAGING >= total  # and what it may hold is counted in the tenant's shared memory
