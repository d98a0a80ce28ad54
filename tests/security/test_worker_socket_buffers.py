"""A worker cannot hold host memory in Unix socket buffers, past its memory limit (issue 21, round 4).

The attack (when AF_UNIX sockets were allowed): what a worker's sockets hold queued is counted by no rlimit
(RLIMIT_AS and RLIMIT_DATA count mappings), only by a memory cgroup, which a host without a delegated memory
controller does not have.

On such a host (the broker's own log says "rlimits only: the memory controller is not delegated") a
tenant's kernel makes socketpairs, raises each end's SO_SNDBUF to ``net.core.wmem_max`` (which the kernel doubles)
and writes into each end until EAGAIN, reading nothing. Each socket then holds up to 2 x wmem_max of skbs in its
peer's receive queue: with NOFILE = 4096 descriptors, 4096 x 2 x wmem_max (1.7 GiB at the default wmem_max of
208 KiB; 32 GiB with wmem_max = 4 MiB, as on the VM measured), and as much again for sockets passed in flight
(SCM_RIGHTS, up to RLIMIT_NOFILE in flight per uid), whatever ``worker_memory_max`` says. The memory is the host's
(no process shows it in its RSS), and goes only when the worker dies.

Measured (2-core VM, 24 GiB, wmem_max = 4 MiB, PoCL, worker_memory_max = 1024 MiB): the kernel below, asked to stop
at 2 GiB, queued 2048 MiB in 261 sockets in about a second, and the host's MemAvailable dropped by ~1.6 GiB (a
noisy reading on a shared machine) while the worker went on serving; it came back when the session closed. The
bound here is the test's own (it stops at TARGET); the kernel's is NOFILE x 2 x wmem_max per worker.

The fix: once its device is open, a worker loads a second seccomp filter (over every thread) that refuses new
sockets of any family (``socket`` and ``socketpair``, EPERM): all of a worker's sockets are made by the front or a
client and inherited or received, so none holds what no limit counts. The kernel below now gets EPERM at its first
socketpair and queues nothing. On CUDA too (where a kernel cannot make syscalls, but host code of a tenant's is
assumed): test_sandbox.py counts the filter on every thread of a CUDA worker, which the CUDA suite ran under.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from gpubroker.broker.launcher import BrokerProcess, TenantSpec
from gpubroker.client import ModuleFormat, connect

from ..helpers import mem_available
from .exploits import SYSCALL_SOURCE, check_arch

MiB = 1 << 20
MEMORY_MAX = 1024 * MiB
TARGET = 2048 * MiB  # the test stops there: the kernel alone would go on to NOFILE x 2 x wmem_max

HOG_SOURCE = SYSCALL_SOURCE + r"""
/* Socketpairs whose ends each hold a full send buffer, nobody reading: until `target` bytes are queued. */
__kernel void gpb_hog(__global uchar* buf, const long target, const int max_pairs, __global long* res) {
    long total = 0;
    int sockets = 0;
    __global int* sv = (__global int*)buf;
    __global int* val = (__global int*)(buf + 16);
    val[0] = 1 << 30;  /* capped by the kernel at wmem_max, then doubled */
    for (int i = 0; i < max_pairs && total < target; ++i) {
        long r = sys6(53, 1, 1 | 0x800, 0, (long)sv, 0, 0);  /* socketpair(AF_UNIX, SOCK_STREAM|SOCK_NONBLOCK) */
        if (r < 0) { res[3] = r; break; }
        for (int e = 0; e < 2 && total < target; ++e) {
            long fd = sv[e];
            sys6(54, fd, 1, 7, (long)val, 4, 0);  /* setsockopt(SOL_SOCKET, SO_SNDBUF) */
            ++sockets;
            for (;;) {
                long w = sys6(1, fd, (long)(buf + 4096), 65536, 0, 0, 0);
                if (w <= 0) break;
                total += w;
            }
        }
    }
    res[0] = total;
    res[1] = sockets;
}
"""


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerProcess]:
    check_arch()
    tmp = tmp_path_factory.mktemp("sockbuf")
    settings = {"cache_dir": str(tmp / "caches"), "worker_memory_max": MEMORY_MAX,
                "cache_max_bytes": 64 * MiB, "worker_tmp_max_bytes": 32 * MiB}
    with BrokerProcess([TenantSpec("mallory")], backend="opencl", settings=settings) as proc:
        yield proc


def test_a_worker_cannot_hold_host_memory_in_socket_buffers_past_its_limit(broker: BrokerProcess) -> None:
    with connect(broker.target, token=broker.tokens["mallory"], timeout=120, transport="grpc",
                 shared_memory=False) as gpu:
        kernel = gpu.get_kernel(gpu.load_module(HOG_SOURCE, ModuleFormat.OPENCL_C), "gpb_hog")
        buf, res = gpu.allocate_memory(4096 + 65536), gpu.allocate_memory(32)
        before = mem_available()
        gpu.execute_kernel(kernel, 1, 1, [buf, np.int64(TARGET), np.int32(1900), res])
        gpu.synchronize()
        out = np.zeros(4, dtype=np.int64)
        gpu.copy_d2h(res, out)
        dropped = before - mem_available()
        gpu.free_memory(gpu.allocate_memory(16))  # the worker goes on serving
    queued, sockets = int(out[0]), int(out[1])
    print(f"\nthe worker (worker_memory_max {MEMORY_MAX >> 20} MiB) queued {queued >> 20} MiB in {sockets} Unix "
          f"sockets; the host's MemAvailable dropped by {dropped >> 20} MiB")
    assert int(out[3]) == -1, f"socketpair in a worker answered {int(out[3])}, not EPERM"
    assert queued <= MEMORY_MAX, (f"a worker limited to {MEMORY_MAX >> 20} MiB held {queued >> 20} MiB of host memory "
                                  f"in socket buffers ({sockets} sockets), counted by no limit")
