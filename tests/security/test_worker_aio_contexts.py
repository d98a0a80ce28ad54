"""A worker cannot take every asynchronous-I/O context of the host (issue 21, round 5). It could: then ``io_setup``
failed with EAGAIN for every other process on it (other tenants' workers, the front, the host's own services) until
the worker died.

The hole: the worker's seccomp filter refuses io_uring but allows Linux native AIO (``io_setup``, ``io_submit``,
``io_getevents``, ``io_destroy``). Every ``io_setup(nr_events)`` reserves events against ``fs.aio-max-nr``, a single
count for the whole host (65,536 by default), not per process, per uid or per namespace; no rlimit bounds it (the
ring each context maps is small: 16 contexts of 4,096 events map about 4 MiB). So one tenant's kernel reserves the
host's whole AIO capacity in a dozen calls, and holds it as long as its worker lives. Every other process's
``io_setup`` then fails with EAGAIN: databases and QEMU on the host, ``libaio`` users, GPUDirect Storage / cuFile on a
GPU host, other tenants' workers. That is a kernel object consumed beyond the tenant's bound and a failure put on
others (the "per-host-user kernel counts" row of the security docs lists epoll, inotify and POSIX message queues,
refused for this reason, but not AIO, whose count is host-wide).

Measured (2-core VM, kernel 6.18, fs.aio-max-nr = 65,536, PoCL, defaults): the kernel below made 16 contexts of
4,096 events in one launch; /proc/sys/fs/aio-nr went from 0 to 65,536, and a plain host process's ``io_setup(1)``
failed with EAGAIN until the tenant's worker exited.

The fix: the worker's seccomp filter refuses native AIO (``io_setup``, ``io_submit``, ``io_cancel``,
``io_getevents``, ``io_pgetevents``, ``io_destroy``: EPERM), as it refuses io_uring.
"""

from __future__ import annotations

import ctypes
import errno
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from gpubroker.broker.launcher import BrokerProcess, TenantSpec
from gpubroker.client import ModuleFormat, connect

from ..helpers import wait_for
from .exploits import SYSCALL_SOURCE, check_arch

MiB = 1 << 20
NR_IO_SETUP, NR_IO_DESTROY = 206, 207

AIO_SOURCE = SYSCALL_SOURCE + r"""
/* io_setup(4096) until the kernel refuses: the host's whole fs.aio-max-nr, held until the worker dies. */
__kernel void gpb_aio(__global long* ctxs, const int max, __global long* res) {
    long events = 0;
    int n = 0;
    for (; n < max; ++n) {
        ctxs[n] = 0;
        long r = sys6(206, 4096, (long)(ctxs + n), 0, 0, 0, 0);
        if (r < 0) { res[2] = r; break; }
        events += 4096;
    }
    res[0] = events;
    res[1] = n;
}
"""


def aio_nr() -> int:
    return int(Path("/proc/sys/fs/aio-nr").read_text())


def host_io_setup() -> int:
    """A plain host process's io_setup(1): 0, or the errno it failed with (its context destroyed at once)."""
    libc = ctypes.CDLL(None, use_errno=True)
    ctx = ctypes.c_ulong(0)
    if libc.syscall(NR_IO_SETUP, 1, ctypes.byref(ctx)) != 0:
        return ctypes.get_errno()
    libc.syscall(NR_IO_DESTROY, ctx)
    return 0


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerProcess]:
    check_arch()
    tmp = tmp_path_factory.mktemp("aio")
    settings = {"cache_dir": str(tmp / "caches"), "worker_idle_seconds": 1.0}
    with BrokerProcess([TenantSpec("mallory")], backend="opencl", settings=settings) as proc:
        yield proc


def test_a_worker_cannot_take_the_hosts_aio_contexts(broker: BrokerProcess) -> None:
    max_nr = int(Path("/proc/sys/fs/aio-max-nr").read_text())
    assert host_io_setup() == 0, "io_setup fails on this host before the attack"
    start = aio_nr()
    with connect(broker.target, token=broker.tokens["mallory"], timeout=120, transport="grpc",
                 shared_memory=False) as gpu:
        kernel = gpu.get_kernel(gpu.load_module(AIO_SOURCE, ModuleFormat.OPENCL_C), "gpb_aio")
        slots = max_nr // 4096 + 8
        ctxs, res = gpu.allocate_memory(8 * slots), gpu.allocate_memory(64)
        gpu.execute_kernel(kernel, 1, 1, [ctxs, np.int32(slots), res])
        gpu.synchronize()
        out = np.zeros(8, dtype=np.int64)
        gpu.copy_d2h(res, out)
        held = aio_nr() - start
        other = host_io_setup()
    # The contexts go with the worker (idle a second after the session's end).
    wait_for(lambda: aio_nr() <= start, timeout=60, what="the worker's AIO contexts released")
    print(f"\nthe worker made {out[1]} AIO contexts ({out[0]} events; its last io_setup: {out[2]}); fs.aio-nr rose by "
          f"{held} of {max_nr}; a host process's io_setup(1) meanwhile: {errno.errorcode.get(other, 'ok')}")
    assert other == 0, (f"one tenant's worker reserved {held} of the host's {max_nr} AIO events "
                        f"({out[1]} io_setup calls), and every other process's io_setup failed: "
                        f"{os.strerror(other)}")
