"""CopyPeer's host path hands each worker a memfd the front made, unsealed: a kernel keeps it and grows it at will.

The hole: between two devices without a peer path (OpenCL; CUDA without peer access), ``CopyPeer`` stages the copy
through host memory: the front ``memfd_create``s a file (``_peer.py``: one of its own for a copy up to 8 MiB, else
the tenant's kept 128 MiB one), sizes it, and sends it to both workers (``RegisterSegment``, SCM_RIGHTS). Unlike a
client's segment, which the front checks is sealed against growing, this memfd has no seals at all, and the worker
holds a descriptor of it for as long as it maps it (Python's ``mmap`` keeps a dup). A kernel running while the
copy starts (a launch returns at once; the copy's Synchronize comes after the registration) finds the new memfd
(``fcntl(F_GET_SEALS)`` answers only for memfds), ``dup``s it, and ``fallocate``s it up to ``RLIMIT_FSIZE``:
shmem pages no rlimit of the worker counts (not mapped: not RLIMIT_AS/RLIMIT_DATA), not in the tenant's
``shared_memory`` (the front never counts its staging), nowhere in Usage or the metrics, held as long as the worker
lives. Each CopyPeer adds one; a worker may hold 4,096 descriptors. Even with no hostile code, the kept 128 MiB
staging of every tenant doing large CopyPeers is host memory counted to nobody.

Measured (PoCL with two pthread devices, tenant quota 64 MiB, worker_memory_max 1 GiB): each CopyPeer of 1 MiB
let the kernel keep one more memfd of 64 MiB; after 3 copies /proc/meminfo Shmem had grown by 191 MiB, and it
grows by 64 MiB per copy: 18 copies, +1,152 MiB, past the worker's 1 GiB limit, while GetDeviceInfo showed
mallory using 1 MiB.

Suggested fix: seal every memfd the front hands a worker (``MFD_ALLOW_SEALING``, then ``F_SEAL_GROW | F_SEAL_SHRINK
| F_SEAL_SEAL`` after sizing; ``F_SEAL_WRITE`` is not possible as workers write it) and count its size in the
tenant's ``shared_memory`` while any worker maps it; better, never hand a worker a descriptor at all where a
mapping will do (map it in the launcher and pass the mapping), so a kernel has nothing to keep or grow.
"""

from __future__ import annotations

import time

import numpy as np

from gpubroker.broker.launcher import BrokerProcess, TenantSpec
from gpubroker.client import connect

from ..exploits import SYSCALL_SOURCE

LIMIT = 1 << 30  # worker_memory_max
GROW = 64 << 20  # RLIMIT_FSIZE is at least cache_max_bytes (64 MiB)
WANT = LIMIT // GROW + 2
# Note the memfds the worker holds now; then poll for a new one (the front's staging, as the copy registers it),
# keep a dup of it and grow it to ``size``. s[0]: the descriptor found (-1: none), s[2]: fallocate's result.
SOURCE = SYSCALL_SOURCE + r"""
__kernel void grab(__global long* s, long size, long secs) {
    sys6(228, 1, (long)&s[40], 0, 0, 0, 0);
    long end = s[40] + secs;
    for (int fd = 3; fd < 1024; fd++) s[100 + fd] = sys6(72, fd, 1034, 0, 0, 0, 0) >= 0;  /* F_GET_SEALS */
    s[0] = -1;
    while (1) {
        for (int fd = 3; fd < 1024; fd++) {
            if (s[100 + fd]) continue;
            if (sys6(72, fd, 1034, 0, 0, 0, 0) >= 0) {
                long kept = sys6(32, fd, 0, 0, 0, 0, 0);                  /* dup */
                s[2] = sys6(285, kept, 0, 0, size, 0, 0);                 /* fallocate(kept, 0, 0, size) */
                s[0] = fd;
                return;
            }
        }
        sys6(228, 1, (long)&s[42], 0, 0, 0, 0);
        if (s[42] >= end) return;
    }
}
"""


def _shmem() -> int:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("Shmem:"))


def test_a_worker_cannot_grow_the_fronts_staging_memfds_past_its_limit() -> None:
    with BrokerProcess([TenantSpec("mallory", memory_quota=64 << 20)], backend="opencl",
                       settings={"worker_memory_max": LIMIT}, env={"POCL_DEVICES": "pthread pthread"}) as broker:
        here = connect(broker.target, token=broker.tokens["mallory"], device=0)
        there = connect(broker.target, token=broker.tokens["mallory"], device=1)
        grab = here.compile_kernel(SOURCE, "grab")
        scratch = here.allocate_memory(16 << 10)
        src, dst = here.allocate_memory(1 << 20), there.allocate_memory(1 << 20)
        assert here.copy_peer(src, there, dst, 1 << 20) == "host"
        before, kept = _shmem(), 0
        for _ in range(2 * WANT):
            here.copy_h2d(np.zeros(2048, dtype=np.int64), scratch)
            here.execute_kernel(grab, 1, 1, [scratch, np.int64(GROW), np.int64(5)])  # (returns at once)
            time.sleep(0.3)
            here.copy_peer(src, there, dst, 1 << 20)
            found = np.zeros(4, dtype=np.int64)
            here.copy_d2h(scratch, found)
            kept += int(found[0] >= 0 and found[2] == 0)
            if kept >= WANT:
                break
        grown = _shmem() - before
        print(f"\n{kept} staging memfds kept and grown to {GROW >> 20} MiB: Shmem +{grown >> 20} MiB; "
              f"mallory's use as the front sees it: {(here.device_info().memory_used or 0) >> 20} MiB")
        assert grown < LIMIT, (f"mallory's worker holds {grown >> 20} MiB of host shared memory in the front's "
                               f"CopyPeer staging memfds, worker_memory_max = {LIMIT >> 20} MiB, quota 64 MiB")
