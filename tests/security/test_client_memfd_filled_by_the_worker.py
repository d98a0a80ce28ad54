"""A memfd the tenant's own client passes over its link is filled by the worker, outside every memory bound.

The hole: links accepted descriptors once handed to the worker (the ring upgrade's offer carried a memfd and a
doorbell from the client straight to the worker); the checks on them (sealed, exactly the ring's size) ran in the
worker, in the tenant's control, and nothing in the front saw or counted them. A kernel ``recvmsg``s a memfd
straight off its link (the worker's main thread is busy running that very launch, so nothing else reads the link)
and ``fallocate``s it: shmem pages that no rlimit counts (RLIMIT_AS counts mappings, RLIMIT_FSIZE a file's growth:
the client sized the file), charged, without a delegated cgroup, to the broker's own memory cgroup.

Measured before the fix (PoCL, rlimits fallback, tenant quota 64 MiB, ``worker_memory_max`` = 1 GiB): one
fallocate of 2 GiB in 0.3 s, /proc/meminfo Shmem +2,048 MiB, still there after the client closed its copy.

The fix (front/_links.py, sandbox/_seccomp.py): no descriptor reaches a worker but the front's. The front makes a
ring's memfd and doorbells itself (charged to the tenant's shared memory) and passes them on its fd channel; the
worker's end of every link refuses descriptors (SO_PASSRIGHTS off, so the client's sendmsg fails with EPERM), the
worker cannot turn that back on (its filter refuses the setsockopt), and recvmsg passes on the fd channel alone
(the lock that holds on kernels before 6.16, where SO_PASSRIGHTS does not exist). This kernel tries both: it turns
SO_PASSRIGHTS back on on every socket it holds, then recvmsgs whatever comes on its link.
"""

from __future__ import annotations

import array
import os
import socket
import threading
from pathlib import Path

import numpy as np
import pytest

from gpubroker.broker.launcher import BrokerProcess, TenantSpec
from gpubroker.client import connect
from gpubroker.client._transports._link import FramedSocket, unix_connector

from ..conftest import worker_pids
from ..helpers import wait_for
from .exploits import SYSCALL_SOURCE

pytestmark = pytest.mark.skipif(os.uname().machine != "x86_64", reason="raw syscall numbers of x86-64")

LIMIT = 1 << 30
SIZE = 2 << 30
NANOSLEEP = 35
SOURCE = SYSCALL_SOURCE + r"""
__kernel void grab(__global long* s, long size, long secs) {
    sys6(228, 1, (long)&s[40], 0, 0, 0, 0);
    long end = s[40] + secs;
    s[0] = -1;
    s[24] = 0;
    for (int fd = 3; fd < 256; fd++) {                                   /* SO_PASSRIGHTS back on, everywhere */
        ((__global int*)&s[44])[0] = 1;
        if (sys6(54, fd, 1, 83, (long)&s[44], 4, 0) == 0) s[24] += 1;   /* setsockopt(fd, SOL_SOCKET, 83) */
    }
    while (1) {
        for (int fd = 3; fd < 256; fd++) {
            long n = sys6(45, fd, (long)&s[12], 4, 2 | 0x40, 0, 0);      /* recvfrom(MSG_PEEK | MSG_DONTWAIT) */
            if (n == 4 && s[12] == 0x5a5a5a5aL) {                       /* "ZZZZ": our link */
                s[8] = (long)&s[12]; s[9] = 4;                          /* iovec */
                s[1] = 0; s[2] = 0; s[3] = (long)&s[8]; s[4] = 1;       /* msghdr */
                s[5] = (long)&s[16]; s[6] = 64; s[7] = 0;
                s[16] = 0; s[17] = 0; s[18] = 0;
                s[20] = sys6(47, fd, (long)&s[1], 0x40, 0, 0, 0);       /* recvmsg */
                s[21] = s[20] >= 0 ? s[6] : 0;                          /* msg_controllen: a descriptor came */
                int memfd = ((__global int*)&s[16])[4];
                s[23] = s[21] ? sys6(285, memfd, 0, 0, size, 0, 0) : -1;  /* fallocate(memfd, 0, 0, size) */
                s[0] = 0;
                return;
            }
        }
        s[46] = 0; s[47] = 1000000;
        sys6(35, (long)&s[46], 0, 0, 0, 0, 0);                          /* nanosleep 1 ms: seen polling */
        sys6(228, 1, (long)&s[42], 0, 0, 0, 0);
        if (s[42] >= end) return;
    }
}
"""


def _shmem() -> int:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("Shmem:"))


def _polling(pid: int) -> bool:
    """One of the worker's threads (the kernel's) sleeps between its polls: the kernel runs, and the link is its
    alone (the worker's main thread waits for the launch's end)."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            if (task / "syscall").read_text().split()[0] == str(NANOSLEEP):
                return True
        except (OSError, IndexError):
            continue
    return False


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
        assert link.sock is not None
        (pid,) = worker_pids(broker, "alice")
        memfd = os.memfd_create("attacker")
        os.ftruncate(memfd, SIZE)  # sparse: nothing charged to the client
        before = _shmem()
        launch = threading.Thread(target=lambda: (gpu.execute_kernel(grab, 1, 1, [scratch, np.int64(SIZE),
                                                                                   np.int64(30)]),
                                                  gpu.synchronize()))
        launch.start()
        try:
            wait_for(lambda: _polling(pid), 30, "the kernel to poll its sockets")
            try:
                link.sock.sendmsg([b"ZZZZ"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [memfd]))])
                refused = ""
            except OSError as exc:  # the worker's end takes no descriptor
                refused = exc.strerror or str(exc)
                link.sock.sendall(b"ZZZZ")  # (the bytes alone: the kernel's recvmsg is tried all the same)
        finally:
            launch.join()
            os.close(memfd)  # the worker's copy, if any, is all that is left
        grown = _shmem() - before
        s = np.empty(64, dtype=np.int64)
        gpu.copy_d2h(scratch, s)
        report = (f"sendmsg: {refused or 'accepted'}; kernel: SO_PASSRIGHTS turned back on for {s[24]} sockets, "
                  f"recvmsg {s[20]}, control bytes {s[21]}, fallocate {s[23]}")
        print(report)
        assert s[0] == 0, f"the kernel never saw the client's bytes ({report})"
        assert grown < LIMIT, (f"alice's worker holds {grown / 2**20:,.0f} MiB of host shared memory, "
                               f"worker_memory_max = {LIMIT >> 20} MiB, quota 64 MiB ({report})")
        assert s[24] == 0 and s[21] == 0, f"a descriptor could reach the worker: {report}"
        link.shut()
        gpu.close()
