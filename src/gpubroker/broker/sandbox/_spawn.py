"""Exec supervision (OpenCL): a worker's spawned processes run one at a time, each within ``LINKER_MEMORY``.

On OpenCL the worker's seccomp filter lets posix_spawn's clone(CLONE_VM | CLONE_VFORK) through: PoCL starts the
system linker with it for each newly compiled kernel. Such a child shares the worker's memory until it execs; the
exec gives it an address space of its own and, without a cgroup, limits of its own (RLIMIT_DATA and RLIMIT_AS
count per process), so N children could hold N times the worker's budget. Landlock (``_landlock.py``) lets them
exec only the linker and its interpreter, but that interpreter runs any ELF it is given, and the linker honours
LD_PRELOAD: what such a process may hold needs a bound of its own.

So every execve and execveat in the worker's process tree, and every clone of posix_spawn's shape, stops in the
kernel (a second seccomp filter of the launcher's child returns SECCOMP_RET_USER_NOTIF for them; the launcher,
outside the sandbox, holds its listener) until the launcher answers:

- the worker's own start (the launcher's child exec'ing the worker) passes, once; the worker never execs again
  (forked by the zygote, the child runs the worker without an exec: then none passes at all);
- posix_spawn's clone passes from the worker only: a spawned process makes none, so no CLONE_VM child of its
  keeps its address space alive once it has exited (a child of the worker's shares the worker's, and its limits);
- any other process's exec waits while the image of an earlier one is alive, then passes with RLIMIT_DATA and
  RLIMIT_AS lowered to ``LINKER_MEMORY``: set by the launcher while the caller is stopped, so the new image starts
  under them, and without capabilities it cannot raise them again.

The worker's own limits leave ``LINKER_MEMORY`` out of its budget (``_policy.py``), so the whole tree stays within
``worker_memory_max`` by the kernel. A process the kernel stops here waits for nothing but the earlier one: a kernel
that holds its spawned process forever blocks only its own tenant's later links, and its time limit and CPU watch
still apply. The decisions use only who calls (the notification's pid, checked against the notification's
validity around each step), never the call's pointer arguments, which the caller could change once checked; which
file may run is Landlock's, in the kernel.
"""

from __future__ import annotations

import collections
import ctypes
import errno
import os
import resource
import select
import socket

__all__ = ["LINKER_MEMORY", "ExecSupervisor", "install_listener", "receive_listener", "send_listener"]

# RLIMIT_DATA and RLIMIT_AS of a spawned process: GNU ld linking a PoCL kernel peaks near 11 MiB of address space
# (40 kernels of 200 unrolled lines each, PoCL 3.0); ten times that and more.
LINKER_MEMORY = 128 << 20

# Per architecture: the audit arch, execve, execveat, clone and seccomp's own number.
_ARCH = {"x86_64": (0xC000003E, 59, 322, 56, 317), "aarch64": (0xC00000B7, 221, 281, 220, 277)}
CLONE_VM = 0x00000100
CLONE_VFORK = 0x00004000
CLONE_THREAD = 0x00010000
SECCOMP_SET_MODE_FILTER = 1
SECCOMP_FILTER_FLAG_NEW_LISTENER = 1 << 3
SECCOMP_RET_ALLOW = 0x7FFF0000
SECCOMP_RET_USER_NOTIF = 0x7FC00000
SECCOMP_USER_NOTIF_FLAG_CONTINUE = 1
# _IOWR('!', 0, struct seccomp_notif), _IOWR('!', 1, struct seccomp_notif_resp), _IOW('!', 2, __u64)
SECCOMP_IOCTL_NOTIF_RECV = 0xC0502100
SECCOMP_IOCTL_NOTIF_SEND = 0xC0182101
SECCOMP_IOCTL_NOTIF_ID_VALID = 0x40082102
BPF_LD_W_ABS = 0x20
BPF_JEQ_K = 0x15
BPF_AND_K = 0x54
BPF_RET_K = 0x06

_libc = ctypes.CDLL(None, use_errno=True)


class _SockFilter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_uint16), ("filter", ctypes.POINTER(_SockFilter))]


class _SeccompData(ctypes.Structure):
    _fields_ = [("nr", ctypes.c_int32), ("arch", ctypes.c_uint32), ("instruction_pointer", ctypes.c_uint64),
                ("args", ctypes.c_uint64 * 6)]


class _Notif(ctypes.Structure):
    _fields_ = [("id", ctypes.c_uint64), ("pid", ctypes.c_uint32), ("flags", ctypes.c_uint32),
                ("data", _SeccompData)]


class _NotifResp(ctypes.Structure):
    _fields_ = [("id", ctypes.c_uint64), ("val", ctypes.c_int64), ("error", ctypes.c_int32),
                ("flags", ctypes.c_uint32)]


def install_listener() -> int:
    """In the launcher's child, after the main filter and no_new_privs: stop every execve and execveat, and every
    clone of posix_spawn's shape, for the listener this returns (close-on-exec). OSError where the kernel cannot
    (Linux < 5.5)."""
    arch = _ARCH.get(os.uname().machine)
    if arch is None:
        raise OSError(errno.ENOSYS, f"exec supervision: unsupported architecture {os.uname().machine}")
    audit_arch, execve, execveat, clone, seccomp = arch
    allow, notify = 9, 10  # (the two returns below; a jump's offset counts from the next instruction)
    program = [
        (BPF_LD_W_ABS, 0, 0, 4),  # 0: the architecture (another ABI, x32 or int 0x80, is the main filter's to kill)
        (BPF_JEQ_K, 0, allow - 2, audit_arch),
        (BPF_LD_W_ABS, 0, 0, 0),  # 2: the syscall number
        (BPF_JEQ_K, notify - 4, 0, execve),
        (BPF_JEQ_K, notify - 5, 0, execveat),
        (BPF_JEQ_K, 0, allow - 6, clone),
        (BPF_LD_W_ABS, 0, 0, 16),  # 6: clone's flags (the low word of args[0], little-endian)
        (BPF_AND_K, 0, 0, CLONE_THREAD | CLONE_VM | CLONE_VFORK),
        (BPF_JEQ_K, notify - 9, 0, CLONE_VM | CLONE_VFORK),  # (threads pass unseen)
        (BPF_RET_K, 0, 0, SECCOMP_RET_ALLOW),
        (BPF_RET_K, 0, 0, SECCOMP_RET_USER_NOTIF),
    ]
    instructions = (_SockFilter * len(program))(*(_SockFilter(*i) for i in program))
    prog = _SockFprog(len(program), instructions)
    fd = int(_libc.syscall(ctypes.c_long(seccomp), ctypes.c_uint(SECCOMP_SET_MODE_FILTER),
                           ctypes.c_uint(SECCOMP_FILTER_FLAG_NEW_LISTENER), ctypes.byref(prog)))
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"load the exec supervision filter: {os.strerror(err)} (needs Linux >= 5.5)")
    return fd


def send_listener(channel: socket.socket, listener: int) -> None:
    socket.send_fds(channel, [b"L"], [listener])


def receive_listener(channel: socket.socket) -> int | None:
    """The listener the child sent, or None if it ended before (its setup failed: its status says why)."""
    try:
        _, fds, _, _ = socket.recv_fds(channel, 1, 1)
    except OSError:
        return None
    return fds[0] if fds else None


class ExecSupervisor:
    """The launcher's side: answers the worker tree's execs until the worker exits (``wait``)."""

    def __init__(self, worker: int, listener: int, proc: int, memory: int = LINKER_MEMORY,
                 started: bool = False) -> None:
        self.worker = worker
        self.listener = listener
        # The host's /proc, opened before the fork: the child's pivot_root moved this process's root too (one mount
        # namespace), and the /proc there is the worker's PID namespace's, numbered as notifications are not.
        self.proc = proc
        self.memory = memory
        self.clone = _ARCH[os.uname().machine][3]
        self.started = started  # the worker's own exec has passed (or, run in the launcher's child, needs none)
        self.running: tuple[int, int] | None = None  # (pid, pidfd) of the spawned image alive now
        self.waiting: collections.deque[tuple[int, int]] = collections.deque()  # (notification id, pid)
        self._poll = select.poll()

    def wait(self) -> int:
        """Serve until the worker exits; its wait status."""
        worker_fd = os.pidfd_open(self.worker)
        self._poll.register(worker_fd, select.POLLIN)
        self._poll.register(self.listener, select.POLLIN)
        try:
            while True:
                for fd, events in self._poll.poll():
                    if fd == worker_fd:
                        return os.waitpid(self.worker, 0)[1]
                    if fd == self.listener:
                        if events & select.POLLIN:
                            self._receive()
                        elif events & (select.POLLHUP | select.POLLERR | select.POLLNVAL):
                            self._poll.unregister(fd)  # (no process is left under the filter)
                    elif self.running is not None and fd == self.running[1]:
                        self._poll.unregister(fd)
                        os.close(fd)
                        self.running = None
                        self._admit()
        finally:
            os.close(worker_fd)
            if self.running is not None:
                os.close(self.running[1])

    def _receive(self) -> None:
        request = _Notif()
        if _libc.ioctl(ctypes.c_int(self.listener), ctypes.c_ulong(SECCOMP_IOCTL_NOTIF_RECV),
                       ctypes.byref(request)) < 0:
            return  # (ENOENT: the caller died before it was read)
        tgid = self._tgid(request.pid)
        if request.data.nr == self.clone:
            self._respond(request.id, 0 if tgid == self.worker and self.started else errno.EPERM)
        elif tgid == self.worker and not self.started:
            self.started = True
            self._respond(request.id, 0)
        elif tgid is None or tgid == self.worker:
            self._respond(request.id, errno.EPERM)  # the worker itself execs nothing once it runs
        elif self.running is not None and tgid == self.running[0]:
            self._respond(request.id, 0 if self._limit(tgid) else errno.EPERM)  # (exec again: limits kept)
        else:
            self.waiting.append((request.id, tgid))
            self._admit()

    def _admit(self) -> None:
        while self.running is None and self.waiting:
            request, pid = self.waiting.popleft()
            if not self._valid(request):
                continue
            try:
                pidfd = os.pidfd_open(pid)
            except OSError:
                self._respond(request, errno.EPERM)
                continue
            # Valid again after the limits: the caller, stopped in its exec, was still this pid when they were set.
            if not (self._limit(pid) and self._valid(request)):
                os.close(pidfd)
                self._respond(request, errno.EPERM)
                continue
            self.running = (pid, pidfd)
            self._poll.register(pidfd, select.POLLIN)
            self._respond(request, 0)

    def _limit(self, pid: int) -> bool:
        try:
            for kind in (resource.RLIMIT_DATA, resource.RLIMIT_AS):
                _, hard = resource.prlimit(pid, kind)
                value = self.memory if hard == resource.RLIM_INFINITY else min(self.memory, hard)
                resource.prlimit(pid, kind, (value, value))
        except OSError:
            return False
        return True

    def _valid(self, request: int) -> bool:
        ident = ctypes.c_uint64(request)
        return bool(_libc.ioctl(ctypes.c_int(self.listener), ctypes.c_ulong(SECCOMP_IOCTL_NOTIF_ID_VALID),
                                ctypes.byref(ident)) == 0)

    def _respond(self, request: int, error: int) -> None:
        """Let the call continue (``error`` 0) or fail it with ``error``; a caller that died meanwhile is ignored."""
        flags = SECCOMP_USER_NOTIF_FLAG_CONTINUE if error == 0 else 0
        response = _NotifResp(request, 0, -error, flags)
        _libc.ioctl(ctypes.c_int(self.listener), ctypes.c_ulong(SECCOMP_IOCTL_NOTIF_SEND), ctypes.byref(response))

    def _tgid(self, tid: int) -> int | None:
        """The process of thread ``tid`` (None: gone)."""
        try:
            with open(os.open(f"{tid}/status", os.O_RDONLY | os.O_CLOEXEC, dir_fd=self.proc), "rb") as f:
                for line in f:
                    if line.startswith(b"Tgid:"):
                        return int(line.split()[1])
        except (OSError, ValueError):
            pass
        return None
