"""One worker's queued signals cannot take every other worker's (issue 21, round 5): they could, and their
``timer_create`` and real-time signals failed with EAGAIN while it lived.

The hole: the kernel counts queued signals (and POSIX timers, each of which holds a queued signal) per user *and up
the chain of user namespaces*: a worker's count is charged to its own uid in its namespace and, again, to the uid
that created that namespace, against the ``RLIMIT_SIGPENDING`` that creator had when it created it
(``inc_rlimit_get_ucounts``). The launcher creates every worker's user namespace as the broker's own uid (root here;
``worker_uids`` changes the uid *inside*, not the creator) after lowering its ``RLIMIT_SIGPENDING`` to 256
(``sandbox/_launch.py``, ``SIGPENDING_MAX``: meant to keep one worker from taking root's signals from the host's
other root processes). So every worker's namespace checks the *same* count, the broker's uid's, against 256: one
worker that queues 256 signals to itself (a blocked real-time signal, ``rt_tgsigqueueinfo`` to its own thread:
allowed, it names pid 1) or makes 256 POSIX timers leaves none to any other worker. A failure put on another tenant,
through a kernel count that ``worker_uids`` was meant to make per worker.

Measured (2-core VM, kernel 6.18, root broker with the default worker_uids, PoCL, defaults): alice's kernel queued 4
signals and made 4 timers; mallory's kernel then queued 247 (EAGAIN at the 248th: the broker uid's count reached
256); alice's next kernel queued 0 signals and made 0 timers (EAGAIN), until mallory's worker exited.

The fix: the namespace's count is given room for every worker's own (the launcher's RLIMIT_SIGPENDING at the
namespace's creation, ``SIGPENDING_NAMESPACE``, 64 Ki), and each worker's own RLIMIT_SIGPENDING is 64 (set inside,
after the unshare; it cannot raise it): one worker queues at most 64, and the others keep theirs.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from gpubroker.broker.launcher import BrokerProcess, TenantSpec
from gpubroker.client import ModuleFormat, RemoteGpu, connect

from .exploits import SYSCALL_SOURCE, check_arch

SIGNALS_SOURCE = SYSCALL_SOURCE + r"""
/* Block `sig` in this thread and queue up to `n` of it to this thread; then make up to `n` POSIX timers. */
__kernel void gpb_signals(__global long* buf, const int n, const int sig, __global long* res) {
    buf[0] = 1L << (sig - 1);
    sys6(14, 0, (long)buf, 0, 8, 0, 0);                               /* rt_sigprocmask(SIG_BLOCK, {sig}) */
    long tid = sys6(186, 0, 0, 0, 0, 0, 0);                           /* gettid */
    __global int* info = (__global int*)(buf + 8);
    for (int i = 0; i < 32; ++i) info[i] = 0;
    info[0] = sig;
    info[2] = -1;                                                     /* si_code = SI_QUEUE */
    int queued = 0, timers = 0;
    for (; queued < n; ++queued) {
        long r = sys6(297, 1, tid, sig, (long)info, 0, 0);            /* rt_tgsigqueueinfo(itself, its thread) */
        if (r < 0) { res[1] = r; break; }
    }
    __global int* event = (__global int*)(buf + 32);
    for (int i = 0; i < 16; ++i) event[i] = 0;
    event[2] = sig;
    event[3] = 1;                                                     /* SIGEV_NONE */
    for (; timers < n; ++timers) {
        long r = sys6(222, 1, (long)event, (long)(buf + 64), 0, 0, 0);  /* timer_create(CLOCK_MONOTONIC) */
        if (r < 0) { res[3] = r; break; }
    }
    res[0] = queued;
    res[2] = timers;
}
"""


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerProcess]:
    check_arch()
    tmp = tmp_path_factory.mktemp("sigpending")
    settings = {"cache_dir": str(tmp / "caches"), "worker_idle_seconds": 1.0}
    with BrokerProcess([TenantSpec("mallory"), TenantSpec("alice")], backend="opencl", settings=settings) as proc:
        yield proc


def signals(gpu: RemoteGpu, n: int, sig: int) -> tuple[int, int]:
    """Run the kernel in ``gpu``'s worker: (signals queued, timers made)."""
    kernel = gpu.get_kernel(gpu.load_module(SIGNALS_SOURCE, ModuleFormat.OPENCL_C), "gpb_signals")
    buf, res = gpu.allocate_memory(4096), gpu.allocate_memory(64)
    gpu.execute_kernel(kernel, 1, 1, [buf, np.int32(n), np.int32(sig), res])
    gpu.synchronize()
    out = np.zeros(8, dtype=np.int64)
    gpu.copy_d2h(res, out)
    gpu.free_memory(buf)
    gpu.free_memory(res)
    return int(out[0]), int(out[2])


def test_one_workers_queued_signals_leave_other_workers_theirs(broker: BrokerProcess) -> None:
    def session(name: str) -> RemoteGpu:
        return connect(broker.target, token=broker.tokens[name], timeout=120, transport="grpc", shared_memory=False)

    with session("alice") as alice, session("mallory") as mallory:
        before = signals(alice, 4, 35)
        assert before == (4, 4), f"alice's worker could not queue 4 signals and make 4 timers to begin with: {before}"
        taken = signals(mallory, 1024, 34)
        after = signals(alice, 4, 36)
    print(f"\nalice alone: {before}; mallory then queued {taken[0]} signals and made {taken[1]} timers; "
          f"alice after: {after} (signals queued, timers made)")
    assert after == (4, 4), (f"mallory's worker queued {taken[0]} signals to itself and alice's worker could then "
                             f"queue {after[0]} of 4 signals and make {after[1]} of 4 POSIX timers (EAGAIN): "
                             "every worker's namespace charges the broker uid's one count")
