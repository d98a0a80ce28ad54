"""Per-user kernel counts a worker could take from the broker's own user, host-wide (found by a fresh attacker).

Each worker runs in a user namespace the launcher creates; the kernel counts a user's inotify instances, POSIX
message-queue bytes and queued signals per (namespace, uid) *and* at every ancestor level, under the uid that created
the namespace: the broker's (root here, and on the GPU host), against the host's limits (``fs.inotify.
max_user_instances``, 128 by default) or the creator's rlimits at the namespace's creation (RLIMIT_MSGQUEUE, 800 KiB;
RLIMIT_SIGPENDING, 96k). Unbounded, one tenant's kernel took every inotify instance, message queue byte and queued
signal of the broker's user, for every process of that user on the host (as root: systemd and every daemon). Now
the worker's seccomp filter refuses inotify and POSIX message queues, and the launcher lowers RLIMIT_SIGPENDING and
RLIMIT_MSGQUEUE before it makes the namespace: each test checks the broker's user can still make its own.
"""

from __future__ import annotations

import ctypes
import errno
import os
from collections.abc import Iterator

import pytest

from gpubroker.broker.launcher import BrokerProcess, TenantSpec
from gpubroker.client import ModuleFormat, connect

from ..helpers import wait_for
from . import exploits
from .exploits import ATTACK_SOURCE, O_CREAT, O_RDWR, SYSCALL_SOURCE, Program, check_arch, run

for _name, _nr in (("inotify_init1", 294), ("mq_open", 240), ("mq_unlink", 241)):
    exploits.NR.setdefault(_name, _nr)

ATTEMPTS = 200  # past fs.inotify.max_user_instances' default (128)
QUEUES = 16  # 16 x 80 KiB: past RLIMIT_MSGQUEUE's default (800 KiB)
_libc = ctypes.CDLL(None, use_errno=True)


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerProcess]:
    check_arch()
    tmp = tmp_path_factory.mktemp("ucounts")
    with BrokerProcess([TenantSpec("alice")], backend="opencl", settings={"cache_dir": str(tmp / "caches"),
                                                                               "worker_idle_seconds": 0.5}) as proc:
        yield proc


def host_inotify() -> int:
    """inotify_init1 as the broker's user on the host (this test runs as that user): 0, or the errno."""
    fd = _libc.inotify_init1(os.O_CLOEXEC)
    if fd < 0:
        return ctypes.get_errno()
    os.close(fd)
    return 0


def test_a_worker_cannot_take_the_broker_users_inotify_instances(broker: BrokerProcess) -> None:
    assert host_inotify() == 0, "the host had no inotify instance to spare before the attack"
    with connect(broker.target, token=broker.tokens["alice"], timeout=60) as gpu:
        kernel = gpu.get_kernel(gpu.load_module(ATTACK_SOURCE, ModuleFormat.OPENCL_C), "gpb_attack")
        program = Program()
        made = [program.call(program.attempt(f"inotify {i}", must_fail=False), "inotify_init1", os.O_CLOEXEC)
                for i in range(ATTEMPTS)]
        attempts = run(gpu, kernel, program)
        fds = [a.ret for a in attempts if a.ret >= 0]
        refused = {errno.errorcode.get(-a.ret, str(a.ret)) for a in attempts if a.ret < 0}
        host = host_inotify()  # while the worker holds them
        # Give them back at once (the host's other root processes need them).
        if fds:
            cleanup = Program()
            for fd in fds:
                cleanup.call(cleanup.attempt("close", must_fail=False), "close", fd)
            run(gpu, kernel, cleanup)
        del made
    print(f"\nthe worker made {len(fds)} inotify instances ({refused or 'none refused'}); the broker's user on the "
          f"host then got {errno.errorcode.get(host, 'an instance') if host else 'an instance'}")
    assert host == 0, (f"a tenant's kernel made {len(fds)} inotify instances, and the broker's user (uid "
                       f"{os.geteuid()}) could then make none on the whole host ({errno.errorcode.get(host)})")


def host_mqueue() -> int:
    """mq_open of a default-sized queue as the broker's user on the host: 0, or the errno."""
    rt = ctypes.CDLL("librt.so.1", use_errno=True)
    name = f"/gpb-attack3-{os.getpid()}".encode()

    class Attr(ctypes.Structure):
        _fields_ = [("flags", ctypes.c_long), ("maxmsg", ctypes.c_long), ("msgsize", ctypes.c_long),
                    ("curmsgs", ctypes.c_long), ("pad", ctypes.c_long * 4)]

    attr = Attr(0, 10, 8192, 0)  # (the defaults: what a program that passes no attributes gets)
    fd = rt.mq_open(name, os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o600, ctypes.byref(attr))
    if fd < 0:
        return ctypes.get_errno()
    os.close(fd)
    rt.mq_unlink(name)
    return 0


def test_a_worker_cannot_take_the_broker_users_message_queue_bytes(broker: BrokerProcess) -> None:
    assert host_mqueue() == 0, "the host could not make a message queue before the attack"
    with connect(broker.target, token=broker.tokens["alice"], timeout=60) as gpu:
        kernel = gpu.get_kernel(gpu.load_module(ATTACK_SOURCE, ModuleFormat.OPENCL_C), "gpb_attack")
        program = Program()
        for i in range(QUEUES):
            a = program.attempt(f"mq {i}", must_fail=False)
            # (the system call takes the name without its leading slash; attr NULL: the namespace's defaults,
            # 10 messages of 8 KiB)
            program.call(a, "mq_open", program.cstr(f"gpb-{i}"), O_CREAT | O_RDWR, 0o600, 0)
        attempts = run(gpu, kernel, program)
        made = [a.ret for a in attempts if a.ret >= 0]
        host = host_mqueue()
        cleanup = Program()
        for i in range(QUEUES):
            cleanup.call(cleanup.attempt("unlink", must_fail=False), "mq_unlink", cleanup.cstr(f"gpb-{i}"))
        for fd in made:
            cleanup.call(cleanup.attempt("close", must_fail=False), "close", fd)
        run(gpu, kernel, cleanup)
    print(f"\nthe worker made {len(made)} message queues; the broker's user on the host then got "
          f"{errno.errorcode.get(host, 'a queue') if host else 'a queue'}")
    assert host == 0, (f"a tenant's kernel made {len(made)} message queues, and the broker's user (uid "
                       f"{os.geteuid()}) could then make none on the whole host ({errno.errorcode.get(host)})")


SIGQUEUE_SOURCE = SYSCALL_SOURCE + r"""
/* Block a real-time signal on this thread and queue it to this thread until the kernel refuses (pid 1: itself). */
__kernel void gpb_sigqueue(__global long* scratch, const long most, __global long* res) {
    long sig = 40;
    scratch[0] = 1L << (sig - 1);                                   /* the mask */
    long r = sys6(14, 0, (long)scratch, 0, 8, 0, 0);                /* rt_sigprocmask(SIG_BLOCK) */
    long tid = sys6(186, 0, 0, 0, 0, 0, 0);                         /* gettid */
    __global int* info = (__global int*)(scratch + 2);              /* siginfo: signo, errno, code = SI_QUEUE */
    for (int i = 0; i < 32; ++i) info[i] = 0;
    info[0] = (int)sig; info[2] = -1;
    long n = 0, err = 0;
    while (n < most) {
        long q = sys6(297, 1, tid, sig, (long)info, 0, 0);          /* rt_tgsigqueueinfo(itself, this thread) */
        if (q < 0) { err = q; break; }
        n++;
    }
    res[0] = n; res[1] = err; res[2] = r;
}
"""


def host_sigqueue() -> int:
    """sigqueue of a blocked real-time signal to a fresh process of the broker's user: 0, or the errno."""
    import subprocess

    code = ("import ctypes, os, signal\n"
            "signal.pthread_sigmask(signal.SIG_BLOCK, [41])\n"
            "libc = ctypes.CDLL(None, use_errno=True)\n"
            "class V(ctypes.Union): _fields_ = [('i', ctypes.c_int), ('p', ctypes.c_void_p)]\n"
            "r = libc.sigqueue(os.getpid(), 41, V(0))\n"
            "print(0 if r == 0 else ctypes.get_errno())\n")
    import sys

    return int(subprocess.run([sys.executable, "-I", "-S", "-c", code], capture_output=True, text=True,
                              timeout=30).stdout.strip())


def test_a_worker_cannot_take_the_broker_users_pending_signals(broker: BrokerProcess) -> None:
    import numpy as np

    assert host_sigqueue() == 0
    # (a worker of its own: its blocked, pending signals go with it when it exits)
    with connect(broker.target, token=broker.tokens["alice"], timeout=60) as gpu:
        kernel = gpu.get_kernel(gpu.load_module(SIGQUEUE_SOURCE, ModuleFormat.OPENCL_C), "gpb_sigqueue")
        scratch, res = gpu.allocate_memory(4096), gpu.allocate_memory(64)
        gpu.execute_kernel(kernel, 1, 1, [scratch, np.int64(1 << 20), res])
        gpu.synchronize()
        out = np.empty(8, dtype=np.int64)
        gpu.copy_d2h(res, out)
        host = host_sigqueue()
    # The session closes and the worker idles out (worker_idle_seconds), its pending signals with it.
    wait_for(lambda: host_sigqueue() == 0, 60, "the attacker's worker to exit and its signals to go")
    print(f"\nthe worker queued {out[0]} signals ({errno.errorcode.get(-int(out[1]), out[1])}); a process of the "
          f"broker's user then got {errno.errorcode.get(host, 'its signal queued') if host else 'its signal queued'}")
    assert host == 0, (f"a tenant's kernel queued {out[0]} real-time signals to itself, and no process of the "
                       f"broker's user (uid {os.geteuid()}) could then queue one on the whole host "
                       f"({errno.errorcode.get(host)})")
