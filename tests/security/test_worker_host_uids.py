"""What the kernel counts per host user, not per namespace: one worker must not take it from the others.

The kernel counts a few things per *host* user (``user_struct``), whatever the namespace: epoll watches
(``fs.epoll.max_user_watches``), pipe buffers (``fs.pipe-user-pages-soft``), descriptors in flight on Unix sockets
(against RLIMIT_NOFILE), and before Linux 5.14 RLIMIT_NPROC. A root broker ran every tenant's worker as one host
uid (``worker_uid``, nobody), so one tenant's kernel could take them from every other tenant's worker (found by a
fresh attacker):

- **epoll watches**: one kernel made 5.5 million (a few seconds; each instance watching the same descriptors, the
  instances sent in flight to itself and closed), ~1 GiB of kernel memory that no rlimit counts; every other
  worker's epoll_ctl then got ENOSPC, the workers that started meanwhile failed before any tenant code ran, which
  is the device's failure: bob's three new sessions failed and the device went NOT_SERVING. Now the worker's
  seccomp filter refuses epoll instances (it waits with poll(2)), for every broker, root or not.
- **pipe buffers, descriptors in flight**: past the soft limit of pipe buffers, every new pipe of the user gets 2
  pages instead of 16; past RLIMIT_NOFILE descriptors in flight, every sendmsg of a descriptor by the user fails
  (ETOOMANYREFS). Now each worker of a root broker runs as a host uid of its own, from ``worker_uids``, given back
  only once every process of the worker has ended; a range used up refuses a start with RESOURCE_EXHAUSTED,
  charged to no device and no tenant.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from gpubroker.broker.launcher import BrokerProcess, TenantSpec
from gpubroker.client import GpuBrokerError, ModuleFormat, RemoteGpu, ResourceExhausted, connect

from ..helpers import descendants, proc_status, wait_for
from .exploits import SYSCALL_SOURCE, check_arch, pid_state

# A private range of two (so that another broker on this host never shares them): the third worker waits.
FIRST_UID = 0x7FFFF000 + (os.getpid() % 1024) * 2
UIDS = (FIRST_UID, FIRST_UID + 1)
TARGETS = 3600  # eventfds each epoll instance watches (under RLIMIT_NOFILE, 4096, with room for a batch)
BATCH = 200  # epoll instances made, then sent in flight and closed, at a time
SCM_MAX_FD = 253  # descriptors one SCM_RIGHTS message may carry
TIMEOUT = 120

SOURCE = SYSCALL_SOURCE + r"""
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
    int stop = err < 0;  /* (without a socket, the instances are only made: the first batch, as a probe) */
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
        if (r < 0) { for (int i = 0; i < n; ++i) sys6(3, fds[i], 0, 0, 0, 0, 0); break; }
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

/* Make npipes pipes (kept open), then send the read ends in flight to ourselves, 253 a message, sends times (kept
   there): the host user's pipe buffers and descriptors in flight. res: pipes made, the first error, the last
   pipe's size, descriptors sent, the sendmsg error, the socketpair's result.
   scratch: fds[2 x npipes] ints | sv[2] | iov (16) | msg (64) | byte (16) | cmsg (16 + 4 x 253) */
__kernel void gpb_user_counts(__global char* scratch, const int npipes, const int sends, __global long* res) {
    __global int* fds = (__global int*)scratch;
    __global char* p = scratch + (((long)npipes * 8 + 15) & ~15L);
    __global int* sv = (__global int*)p;
    __global long* iov = (__global long*)(p + 16);
    __global long* msg = (__global long*)(p + 32);
    __global char* byte = p + 96;
    __global char* cmsg = p + 112;
    __global int* cfds = (__global int*)(cmsg + 16);
    long made = 0, perr = 0, size = 0, sent = 0, serr = 0;
    for (int i = 0; i < npipes; ++i) {
        long r = sys6(293, (long)(fds + 2 * i), 02000000, 0, 0, 0, 0);  /* pipe2(O_CLOEXEC) */
        if (r < 0) { perr = r; break; }
        made++;
    }
    if (made > 0) size = sys6(72, fds[2 * (made - 1)], 1032, 0, 0, 0, 0);  /* fcntl(F_GETPIPE_SZ) */
    long r = sys6(53, 1, 1, 0, (long)sv, 0, 0);  /* socketpair(AF_UNIX, SOCK_STREAM) */
    for (int s = 0; r >= 0 && made > 0 && s < sends; ++s) {
        int n = 0;
        for (; n < 253 && n < made; ++n) cfds[n] = fds[2 * n];
        *(__global long*)cmsg = 16 + 4 * n;
        *(__global int*)(cmsg + 8) = 1;   /* SOL_SOCKET */
        *(__global int*)(cmsg + 12) = 1;  /* SCM_RIGHTS */
        iov[0] = (long)byte; iov[1] = 1;
        msg[0] = 0; msg[1] = 0; msg[2] = (long)iov; msg[3] = 1; msg[4] = (long)cmsg;
        msg[5] = 16 + ((4 * n + 7) & ~7); msg[6] = 0;
        long x = sys6(46, sv[0], (long)msg, 0, 0, 0, 0);  /* sendmsg */
        if (x < 0) { serr = x; break; }
        sent += n;
    }
    res[0] = made; res[1] = perr; res[2] = size; res[3] = sent; res[4] = serr; res[5] = r;
}
"""


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerProcess]:
    check_arch()
    tmp = tmp_path_factory.mktemp("hostuids")
    settings = {"cache_dir": str(tmp / "caches"), "worker_idle_seconds": 0.5,
                "worker_uids": f"{UIDS[0]}-{UIDS[1]}"}
    with BrokerProcess([TenantSpec("alice"), TenantSpec("bob"), TenantSpec("carol")], backend="opencl",
                       settings=settings) as proc:
        yield proc


def root_only() -> None:
    if os.geteuid() != 0:
        pytest.skip("a broker that is not root runs its workers as its own user")


def workers(broker: BrokerProcess, tenant: str | None = None) -> list[int]:
    """The tenants' worker processes (not their launchers), or one tenant's."""
    assert broker.process is not None
    found = []
    for pid in descendants(broker.process.pid):
        try:
            args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"gpubroker.broker.worker" in args and b"--spec" not in args and (
                tenant is None or tenant.encode() in args):
            found.append(pid)
    return found


def host_uid(pid: int) -> int:
    """The real uid of ``pid`` as the host sees it."""
    return int(proc_status(pid)["Uid"].split()[0])


def no_workers_left(broker: BrokerProcess) -> None:
    """Each test starts with every uid free: the earlier tests' workers end once idle."""
    wait_for(lambda: not workers(broker), TIMEOUT, "the earlier workers to end")


def connect_when_a_uid_is_free(broker: BrokerProcess, tenant: str) -> RemoteGpu:
    """A session of ``tenant``, its worker started. The earlier tests' workers are gone from /proc a moment before
    the front has their uids back (once their launchers' output has closed); a start meanwhile is refused with the
    retryable WorkerUidsExhausted ("retry in a moment"), retried here as a client would."""
    opened: list[RemoteGpu] = []

    def started() -> bool:
        try:
            opened.append(connect(broker.target, token=broker.tokens[tenant], timeout=TIMEOUT))
        except ResourceExhausted as exc:
            if "worker_uids" not in exc.message:
                raise
            return False
        return True

    wait_for(started, TIMEOUT, f"a host uid for {tenant}'s worker")
    return opened[0]


def device_health(broker: BrokerProcess) -> str:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from gpubroker.broker.front._health import device_service
    from gpubroker.client._channel import make_channel

    channel, _ = make_channel(broker.target, broker.tokens["bob"])
    with channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=device_service(0)), timeout=10)
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))


def test_each_worker_runs_as_a_host_uid_of_its_own_until_its_last_process_ends(broker: BrokerProcess) -> None:
    root_only()
    no_workers_left(broker)
    with (connect_when_a_uid_is_free(broker, "alice") as alice,
          connect_when_a_uid_is_free(broker, "bob") as bob):
        alice.free_memory(alice.allocate_memory(4096))
        bob.free_memory(bob.allocate_memory(4096))
        (alices,), (bobs,) = workers(broker, "alice"), workers(broker, "bob")
        owners = {host_uid(alices): alices, host_uid(bobs): bobs}
        # Both uids of the range are taken: a third worker cannot start now, and that is nobody's failure (as
        # often as it takes a device out of service, device_failure_threshold).
        for _ in range(3):
            with (pytest.raises(ResourceExhausted) as refused,
                  connect(broker.target, token=broker.tokens["carol"], timeout=TIMEOUT) as carol):
                carol.device_info()
        health = device_health(broker)
    print(f"\nthe workers' host uids: {owners}; carol's start got: {refused.value}")
    assert set(owners) == set(UIDS), f"the workers run as host uids {set(owners)}, not one each of {UIDS}"
    assert "worker_uids" in str(refused.value)
    assert health == "SERVING", f"a range used up was charged to the device: {health}"

    # Their sessions closed, the workers end once idle. Carol's worker then gets a uid, and only once the worker
    # that had it has ended.
    def carol_starts() -> bool:
        try:
            with connect(broker.target, token=broker.tokens["carol"], timeout=TIMEOUT) as carol:
                carol.device_info()
                (carols,) = workers(broker, "carol")
                uid = host_uid(carols)
        except ResourceExhausted:
            return False
        assert pid_state(owners[uid]) is None, f"carol's worker got uid {uid} while its last worker still ran"
        return True

    wait_for(carol_starts, TIMEOUT, "carol's worker to get a uid given back")


def test_a_worker_cannot_take_another_workers_pipe_buffers_or_descriptors_in_flight(broker: BrokerProcess) -> None:
    root_only()
    soft = int(Path("/proc/sys/fs/pipe-user-pages-soft").read_text())
    pipes = soft // 16 + 64  # 16 pages a pipe, until the user is past the soft limit
    if not 0 < pipes * 2 < 3800:
        pytest.skip(f"fs.pipe-user-pages-soft = {soft}: no soft limit a worker's 4096 descriptors could pass")
    no_workers_left(broker)
    with (connect_when_a_uid_is_free(broker, "alice") as alice,
          connect_when_a_uid_is_free(broker, "bob") as bob):
        results = {}
        for name, gpu, n, sends in (("alice", alice, pipes, 40), ("bob", bob, 1, 1)):
            kernel = gpu.get_kernel(gpu.load_module(SOURCE, ModuleFormat.OPENCL_C), "gpb_user_counts")
            scratch = gpu.allocate_memory(n * 8 + 16 + 112 + 16 + 4 * SCM_MAX_FD + 64)
            res = gpu.allocate_memory(8 * 8)
            gpu.execute_kernel(kernel, 1, 1, [scratch, np.int32(n), np.int32(sends), res])
            gpu.synchronize()
            out = np.empty(8, dtype=np.int64)
            gpu.copy_d2h(res, out)
            results[name] = [int(v) for v in out[:6]]
    print(f"\n(pipes made, error, last pipe's size, descriptors sent in flight, sendmsg's error, socketpair): "
          f"{results}")
    made, _, size, sent, err, sockets = results["alice"]
    # The attack did take its user's quotas: its own last pipe got the 2 pages past the soft limit, and its last
    # sendmsg of descriptors was refused. (On OpenCL a worker makes no socket once its device is open, so it has
    # none of its own to keep descriptors in flight on: then only the pipes are attacked.)
    in_flight = sockets != -errno.EPERM
    assert made == pipes and size == 8192, results["alice"]
    assert not in_flight or (err == -errno.ETOOMANYREFS and sent > 4096), results["alice"]
    _, _, size, sent, err, _ = results["bob"]
    assert size == 65536, f"tenant alice's pipes left tenant bob's worker a pipe of {size} bytes, not 65536"
    assert not in_flight or (sent == 1 and err == 0), (f"tenant alice's descriptors in flight left tenant bob's "
                                                       f"worker unable to pass one ({errno.errorcode.get(-err, err)})")


def test_a_worker_cannot_take_every_workers_epoll_watches(broker: BrokerProcess) -> None:
    """For every broker, root or not: no worker makes an epoll instance (seccomp), so none makes a watch."""
    no_workers_left(broker)
    scratch = TARGETS * 4 + 16 + 128 + 16 + 4 * BATCH + 64
    with connect_when_a_uid_is_free(broker, "alice") as gpu:
        kernel = gpu.get_kernel(gpu.load_module(SOURCE, ModuleFormat.OPENCL_C), "gpb_epoll")
        buf, res = gpu.allocate_memory(scratch), gpu.allocate_memory(8 * 8)
        gpu.execute_kernel(kernel, 1, 1, [buf, np.int32(TARGETS), np.int32(BATCH), res])
        gpu.synchronize()
        out = np.empty(8, dtype=np.int64)
        gpu.copy_d2h(res, out)
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
    watches, epolls, err = int(out[0]), int(out[1]), int(out[2])
    print(f"\nthe kernel made {watches} epoll watches in {epolls} instances (then {errno.errorcode.get(-err, err)}); "
          f"tenant bob's new sessions: {bob}; the device: {health}")
    assert bob == ["ok"] * 3 and health == "SERVING", (f"while tenant alice's worker held {watches} epoll watches, "
                                                       f"tenant bob got {bob}; the device is {health}")
    assert epolls == 0 and err == -errno.EPERM, f"a worker made {epolls} epoll instances ({watches} watches)"
