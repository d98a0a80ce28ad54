"""The sandbox launcher: runs as ``python -m gpubroker.broker.sandbox --spec JSON -- WORKER ARGV``, or forked by
the workers' zygote (``broker/zygote``), which has the worker's code loaded already.

It is a single-threaded interpreter (a fresh one the front spawns with vfork+exec, or a fork of the single-threaded
zygote), so it may ``unshare`` the user namespace, which a multithreaded process may not. Here only the standard
library, ctypes and pyseccomp are imported: run as a module, the launcher is on every worker's start path.

Parent (outside the new PID namespace): unshare, write the id maps, fork, wait, mirror the child's exit.
Child (PID 1 of the new PID namespace): build the new root, pivot into it, limit, drop, filter, then exec the
worker, or (forked by the zygote: ``start``) run it in this very process: the same sandbox, every layer in place
before the worker's first line, without a second interpreter's start and imports. Its command line is then set to
the worker's (``set_command_line``), as an exec would have.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import resource
import signal
import socket
import stat
import sys
from collections.abc import Callable
from typing import Any, NoReturn

from gpubroker.broker.sandbox._cache import CacheView, inodes_for

__all__ = ["EXIT_SETUP_FAILED", "WorkerStart", "launch", "main", "set_command_line"]

# Runs the worker in the launcher's child, once its sandbox is built (instead of exec'ing ``argv``): the worker's
# argv and its environment. It never returns.
WorkerStart = Callable[[list[str], dict[str, str]], NoReturn]

EXIT_SETUP_FAILED = 125  # the sandbox could not be built; the message is on stderr
# Queued signals (POSIX timers hold one each). The kernel counts them per uid in the worker's user namespace, checked
# against the worker's own RLIMIT_SIGPENDING (SIGPENDING_MAX: a Python worker uses a handful), and again for the uid
# that created the namespace (the broker's, for every worker alike), checked against the limit that creator had at
# the namespace's creation (SIGPENDING_NAMESPACE). That second count is shared by every worker: were its limit the
# worker's own, one worker queuing as many left every other none (247 queued by one: the others' timers and
# signals failed). So the namespace's is far above the sum of the workers' own (1,024 workers of 64 each).
SIGPENDING_MAX = 64
SIGPENDING_NAMESPACE = 1024 * SIGPENDING_MAX
# The worker's uid and gid inside its user namespace when it runs as a host user of its own (``worker_uid``, one of
# the front's worker_uids): 0 there stays the launcher's (its setup creates files in the new root, which needs its id
# mapped).
WORKER_ID = 1

CLONE_NEWNS = 0x00020000
CLONE_NEWCGROUP = 0x02000000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000

MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_REMOUNT = 32
MS_BIND = 4096
MS_REC = 16384
MS_PRIVATE = 1 << 18
MNT_DETACH = 2

MOUNT_ATTR_RDONLY = 0x1
MOUNT_ATTR_NOSUID = 0x2
MOUNT_ATTR_NODEV = 0x4
MOUNT_ATTR_NOEXEC = 0x8
AT_RECURSIVE = 0x8000

PR_SET_PDEATHSIG = 1
PR_SET_DUMPABLE = 4
PR_SET_MM = 35
PR_SET_MM_MAP = 14
PR_CAPBSET_DROP = 24
PR_SET_SECUREBITS = 28
PR_SET_NO_NEW_PRIVS = 38
PR_CAP_AMBIENT = 47
PR_CAP_AMBIENT_CLEAR_ALL = 4
# SECBIT_NOROOT, NO_SETUID_FIXUP, KEEP_CAPS_LOCKED, NO_CAP_AMBIENT_RAISE and each one's lock: an exec as the
# namespace's root then gains no capabilities, and nothing can undo that.
SECUREBITS = 0x01 | 0x02 | 0x04 | 0x08 | 0x20 | 0x40 | 0x80

PROC_READ_ONLY = ("sys", "sysrq-trigger", "irq", "bus", "fs", "acpi", "scsi", "kcore", "keys", "timer_list")

# Syscall numbers glibc has no wrapper for (mount_setattr shares its number on every architecture).
_SYSCALLS = {"x86_64": {"pivot_root": 155, "brk": 12}, "aarch64": {"pivot_root": 41, "brk": 214}}
SYS_MOUNT_SETATTR = 442

_libc = ctypes.CDLL(None, use_errno=True)


class SetupError(Exception):
    """A step of the sandbox failed; the message names it."""


def _check(result: int, what: str) -> int:
    if result < 0:
        err = ctypes.get_errno()
        raise SetupError(f"{what}: {os.strerror(err)} (errno {errno.errorcode.get(err, err)})")
    return result


def _b(path: str | None) -> bytes | None:
    return None if path is None else os.fsencode(path)


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    _check(_libc.mount(_b(source), _b(target), _b(fstype), ctypes.c_ulong(flags), _b(data)),
           f"mount {source or fstype or ''} on {target}")


class _MountAttr(ctypes.Structure):
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64),
                ("propagation", ctypes.c_uint64), ("userns_fd", ctypes.c_uint64)]


def _restrict(target: str, attrs: int) -> None:
    """Add mount attributes (read-only, nosuid, ...) to ``target`` and every mount below it."""
    attr = _MountAttr(attrs, 0, 0, 0)
    _check(_libc.syscall(ctypes.c_long(SYS_MOUNT_SETATTR), ctypes.c_int(-100), _b(target),
                         ctypes.c_uint(AT_RECURSIVE), ctypes.byref(attr), ctypes.c_size_t(ctypes.sizeof(attr))),
           f"mount_setattr {target}")


def _prctl(option: int, arg: int, what: str) -> None:
    _check(_libc.prctl(ctypes.c_int(option), ctypes.c_ulong(arg), ctypes.c_ulong(0), ctypes.c_ulong(0),
                       ctypes.c_ulong(0)), what)


def _write(path: str, text: str) -> None:
    try:
        fd = os.open(path, os.O_WRONLY)
        try:
            os.write(fd, text.encode())
        finally:
            os.close(fd)
    except OSError as exc:
        raise SetupError(f"write {text.strip()!r} to {path}: {exc.strerror}") from None


class _MmMap(ctypes.Structure):
    _fields_ = [*((name, ctypes.c_uint64) for name in (
        "start_code", "end_code", "start_data", "end_data", "start_brk", "brk", "start_stack", "arg_start", "arg_end",
        "env_start", "env_end")),
        ("auxv", ctypes.c_void_p), ("auxv_size", ctypes.c_uint32), ("exe_fd", ctypes.c_uint32)]


_process_strings: list[ctypes.Array[ctypes.c_char]] = []  # (what /proc/self/cmdline and environ show: kept alive)


def set_command_line(argv: list[str], env: dict[str, str] | None = None) -> None:
    """Make /proc/self/cmdline (what ps and the front's process scans read) show ``argv``, and /proc/self/environ
    ``env``: a process forked from the zygote shows what an exec of ``argv`` with ``env`` would have. PR_SET_MM_MAP
    with the process's own map and those strings moved to buffers of ours: the kernel checks the map, and needs no
    capability unless the executable changes. OSError where the kernel cannot (the launch then fails, and the
    front starts the worker exec'd)."""
    with open("/proc/self/stat", "rb") as f:
        fields = f.read().rsplit(b")", 1)[1].split()

    def field(n: int) -> int:  # (proc(5) numbers the fields from 1; ``state``, the first after the name, is 3)
        return int(fields[n - 3])

    def strings(values: list[str]) -> ctypes.Array[ctypes.c_char]:
        text = b"".join(os.fsencode(value) + b"\0" for value in values)
        return ctypes.create_string_buffer(text, len(text))

    args = strings(argv)
    arg_start = ctypes.addressof(args)
    env_start, env_end = field(50), field(51)
    kept = [args]
    if env is not None:
        environ = strings([f"{key}={value}" for key, value in env.items()])
        env_start = ctypes.addressof(environ)
        env_end = env_start + len(environ)
        kept.append(environ)
    mm = _MmMap(field(26), field(27), field(45), field(46), field(47), 0, field(28), arg_start, arg_start + len(args),
                env_start, env_end, None, 0, 0xFFFFFFFF)
    # The map sets the heap's end (brk) too, and it must be the kernel's exactly: were it another, malloc's next
    # growth or trim would go by the wrong end and corrupt the heap. So everything is built first, and the end is
    # read (brk(0) returns it) just before the call, with nothing in between that could move it.
    number = _SYSCALLS.get(os.uname().machine, {}).get("brk")
    if number is None:
        raise OSError(errno.ENOSYS, f"set the command line: unsupported architecture {os.uname().machine}")
    args_of_call = (ctypes.c_int(PR_SET_MM), ctypes.c_ulong(PR_SET_MM_MAP), ctypes.byref(mm),
                    ctypes.c_ulong(ctypes.sizeof(mm)), ctypes.c_ulong(0))
    brk, syscall, prctl = ctypes.c_long(number), _libc["syscall"], _libc.prctl  # (a function object of its own)
    syscall.restype = ctypes.c_long
    mm.brk = syscall(brk, ctypes.c_long(0))
    if prctl(*args_of_call) < 0:  # (EINVAL: a kernel built without CONFIG_CHECKPOINT_RESTORE)
        err = ctypes.get_errno()
        raise OSError(err, f"set the command line (PR_SET_MM_MAP): {os.strerror(err)}")
    _process_strings[:] = kept


# ---- the new root ----

def _mirror(new_root: str, old_root: str, path: str) -> str:
    """Create ``path``'s directories (and symlinks, as on the host) under ``new_root``; the real host path."""
    real = "/"
    for part in [p for p in path.split("/") if p]:
        host = os.path.join(real, part)
        inside = new_root + host
        if os.path.islink(old_root + host):
            target = os.readlink(old_root + host)
            if not os.path.lexists(inside):
                os.symlink(target, inside)
            real = os.path.normpath(os.path.join(real, target))  # (an absolute target replaces ``real``)
            # The link's target must exist in the new root as well.
            _mirror(new_root, old_root, real)
        else:
            real = host
            if not os.path.lexists(inside) and os.path.isdir(old_root + host):
                os.mkdir(inside, 0o755)
    return real


def _bind(new_root: str, old_root: str, path: str, attrs: int) -> None:
    real = _mirror(new_root, old_root, os.path.dirname(path.rstrip("/")) or "/")
    name = os.path.basename(path.rstrip("/"))
    host = os.path.join(real, name)
    if os.path.islink(old_root + host):
        real = _mirror(new_root, old_root, host)
        host = real
    source, target = old_root + host, new_root + host
    if not os.path.exists(source):
        return  # (optional paths: the caller lists what may exist; what does not, is not there)
    if os.path.isdir(source):
        os.makedirs(target, 0o755, exist_ok=True)
    elif not os.path.exists(target):
        os.close(os.open(target, os.O_CREAT | os.O_WRONLY, 0o644))
    _mount(source, target, None, MS_BIND | MS_REC)
    _restrict(target, attrs)


def _build_root(spec: dict[str, Any]) -> None:
    """A tmpfs root holding only the allowlisted paths, then pivot_root into it."""
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    # As bubblewrap does: a scratch tmpfs becomes the root, so the whole old tree (its /tmp too) is at /oldroot
    # while the new root is put together at /newroot.
    base = "/tmp"
    _mount("tmpfs", base, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=1m")
    os.mkdir(base + "/newroot")
    os.mkdir(base + "/oldroot")
    _pivot_root(base, base + "/oldroot")
    os.chdir("/")
    new, old = "/newroot", "/oldroot"
    _mount("tmpfs", new, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755")
    for d in ("tmp", "dev", "proc", "etc"):
        os.mkdir(f"{new}/{d}", 0o755)
    _mount("tmpfs", f"{new}/dev", "tmpfs", MS_NOSUID | MS_NOEXEC, "mode=0755,size=64k")
    os.mkdir(f"{new}/dev/shm")
    # /tmp and /dev/shm are two directories of one tmpfs (outside the new root), so one size bounds both.
    size = int(spec.get("tmp_size", 64 << 20))
    os.mkdir("/scratch")
    _mount("tmpfs", "/scratch", "tmpfs", MS_NOSUID | MS_NODEV, f"mode=0755,size={size},nr_inodes={inodes_for(size)}")
    for name, target, attrs in (("tmp", f"{new}/tmp", MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV),
                                ("shm", f"{new}/dev/shm", MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV | MOUNT_ATTR_NOEXEC)):
        os.mkdir(f"/scratch/{name}")
        os.chmod(f"/scratch/{name}", 0o1777)
        _mount(f"/scratch/{name}", target, None, MS_BIND)
        _restrict(target, attrs)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                         ("stderr", "/proc/self/fd/2")):
        os.symlink(target, f"{new}/dev/{name}")
    # Parents before children: a bind inside an earlier one lands on top of it.
    binds = [(p, MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV) for p in spec["ro"]]
    binds += [(p, MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV) for p in spec["rw"]]
    binds += [(p, MOUNT_ATTR_NOSUID | MOUNT_ATTR_NOEXEC) for p in spec["dev"]]
    for path, attrs in sorted(binds, key=lambda b: (b[0].rstrip("/").count("/"), b[0])):
        _bind(new, old, path, attrs)
    try:
        # This PID namespace's own /proc: the worker sees itself and nothing else.
        _mount("proc", f"{new}/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    except SetupError as exc:
        raise SetupError(f"{exc}: a fresh /proc cannot be mounted here (in a container, the runtime's masked "
                         "/proc paths forbid it: run the pod with securityContext.procMount: Unmasked)") from None
    # The kernel lets the host's uid 0 write sysctls and sysrq-trigger by file mode alone, capabilities or not:
    # with the broker running as root, the worker is that uid. Read-only, as container runtimes make them.
    for name in PROC_READ_ONLY:
        path = f"{new}/proc/{name}"
        if os.path.lexists(path):
            _mount(path, path, None, MS_BIND | MS_REC)
            _restrict(path, MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV | MOUNT_ATTR_NOEXEC)
    os.chdir(new)
    _pivot_root(".", ".")  # the old root now sits on top of the new one; detach it
    _check(_libc.umount2(b".", ctypes.c_int(MNT_DETACH)), "detach the old root")
    os.chdir("/")
    _mount(None, "/", None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)


def _pivot_root(new_root: str, put_old: str) -> None:
    number = _SYSCALLS.get(os.uname().machine, {}).get("pivot_root")
    if number is None:
        raise SetupError(f"pivot_root: unsupported architecture {os.uname().machine}")
    _check(_libc.syscall(ctypes.c_long(number), _b(new_root), _b(put_old)), f"pivot_root {new_root}")


def _cache_view(cache: dict[str, Any], owner: bool = False) -> CacheView:
    """Mount the tenant's cache tmpfs over its host directory (in this mount namespace: the worker's bind of that
    path is then the tmpfs) and seed it; the launcher saves it back after the worker exits (_cache.py)."""
    path, size = cache["path"], int(cache["size"])
    dir_flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        host_fd = os.open(path, dir_flags)  # before the tmpfs hides it
    except OSError as exc:
        raise SetupError(f"open the compile cache {path}: {exc.strerror}") from None
    try:
        _mount(None, "/", None, MS_REC | MS_PRIVATE)  # (nothing mounted here reaches the host's namespace)
        _mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV, f"mode=0700,size={size},nr_inodes={inodes_for(size)}")
        view = CacheView(host_fd, os.open(path, dir_flags), size)
    except BaseException:
        os.close(host_fd)
        raise
    try:
        view.seed()
    except OSError as exc:  # (a cache that cannot be read costs this worker its cached kernels, not its start)
        os.write(2, f"gpubroker sandbox: could not read the compile cache {path}: {exc}\n".encode())
    if owner:
        try:
            view.give_to(WORKER_ID, WORKER_ID)
        except OSError as exc:
            view.close()
            raise SetupError(f"give the compile cache to the worker's user: {exc.strerror}") from None
    return view


def _save_cache(view: CacheView | None) -> None:
    if view is None:
        return
    try:
        view.save()
    except OSError as exc:
        os.write(2, f"gpubroker sandbox: could not save the compile cache: {exc}\n".encode())
    view.close()


# ---- privileges ----

class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def _drop_capabilities(switch_user: bool = False) -> None:
    _prctl(PR_SET_SECUREBITS, SECUREBITS, "set securebits")
    cap = 0
    while _libc.prctl(ctypes.c_int(PR_CAPBSET_DROP), ctypes.c_ulong(cap), ctypes.c_ulong(0), ctypes.c_ulong(0),
                      ctypes.c_ulong(0)) == 0:
        cap += 1  # until EINVAL: past the kernel's last capability
    _prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, "clear ambient capabilities")
    if switch_user:
        try:
            _become_worker_user()
        except OSError as exc:
            raise SetupError(f"switch to the worker's user: {exc.strerror}") from None
    header = _CapHeader(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3: two 32-bit words
    data = (_CapData * 2)()
    _check(_libc.capset(ctypes.byref(header), data), "capset")


def _become_worker_user() -> None:
    """Switch to the namespace's ``WORKER_ID`` (a host uid other than root: see ``_map_ids_from_outside``), with no
    supplementary groups. Needs CAP_SETUID and CAP_SETGID, which the securebits keep across the switch (the caller
    drops them right after)."""
    os.setgroups([])
    os.setresgid(WORKER_ID, WORKER_ID, WORKER_ID)
    os.setresuid(WORKER_ID, WORKER_ID, WORKER_ID)
    # A change of credentials clears the parent-death signal: set it again, or the worker would outlive the
    # launcher the front kills. (Should the launcher die in between, the worker finds its channel to the front
    # closed and leaves.)
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL, "set the parent-death signal again")


def _map_ids_from_outside(host_id: int) -> tuple[int, int]:
    """Fork a helper that stays in the host's user namespace and, once this process has unshared its own, maps
    there the namespace's 0 to this process's ids (root: the launcher's setup, as before) and ``WORKER_ID`` to
    ``host_id``: only a process with CAP_SETUID in the parent namespace may map more than its own id, which this
    one has lost by unsharing. Returns (helper pid, the pipe's end to write once unshared)."""
    ready, go = os.pipe()
    launcher = os.getpid()  # (not the helper's getppid(): were the launcher gone, that would be another process)
    helper = os.fork()
    if helper != 0:
        os.close(ready)
        return helper, go
    code = 0
    try:
        os.close(go)
        if os.read(ready, 1) == b"":  # (the launcher failed before its unshare, or died)
            os._exit(1)
        for name, own in (("uid_map", os.getuid()), ("gid_map", os.getgid())):
            _write(f"/proc/{launcher}/{name}", f"0 {own} 1\n{WORKER_ID} {host_id} 1\n")
    except (SetupError, OSError) as exc:
        os.write(2, f"gpubroker sandbox: map the worker's user namespace: {exc}\n".encode())
        code = 1
    os._exit(code)


def _limit(spec: dict[str, Any]) -> None:
    resource.setrlimit(resource.RLIMIT_SIGPENDING, (SIGPENDING_MAX, SIGPENDING_MAX))  # (lower than the launcher's)
    limits = {"core": resource.RLIMIT_CORE, "nofile": resource.RLIMIT_NOFILE, "as": resource.RLIMIT_AS,
              "nproc": resource.RLIMIT_NPROC, "fsize": resource.RLIMIT_FSIZE, "data": resource.RLIMIT_DATA,
              "stack": resource.RLIMIT_STACK, "rtprio": resource.RLIMIT_RTPRIO, "nice": resource.RLIMIT_NICE}
    for name, value in spec.get("rlimits", {}).items():
        kind = limits[name]
        _, hard = resource.getrlimit(kind)
        value = value if hard == resource.RLIM_INFINITY else min(value, hard)
        resource.setrlimit(kind, (value, value))


def _close_fds(keep: list[int]) -> None:
    low = 3
    for fd in sorted(set(keep)):
        if fd >= low:
            os.closerange(low, fd)
            low = fd + 1
    os.closerange(low, 1 << 20)


# ---- the two processes ----

def _child(spec: dict[str, Any], argv: list[str], seccomp_filter: Any, go: int,
           channel: socket.socket | None, start: WorkerStart | None) -> None:
    env = _worker_environment(spec)
    try:
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL, "set the parent-death signal")
        # Nothing until the launcher says go: it first hands the front this process's pidfd, by which the front
        # knows when the last process of the worker's uid has ended. End-of-file instead: the launcher is gone (a
        # launcher that died before the parent-death signal was set would otherwise leave this one running).
        if os.read(go, 1) != b"x":
            os._exit(EXIT_SETUP_FAILED)
        os.close(go)
        # A session and process group of its own: "my group" (kill(0, ...), setpriority(PRIO_PGRP, 0, ...)) is
        # resolved by the group's struct pid, across PID namespaces, so in the launcher's group the worker would
        # reach the launcher (and, without the front's new session, the front and every other worker).
        os.setsid()
        # Cosmetic (the UTS namespace is the isolation), and systemd's ProtectHostname= filters it: best effort.
        _libc.sethostname(b"gpubroker-worker", ctypes.c_size_t(16))
        _build_root(spec)
        _limit(spec)
        _close_fds([*spec.get("keep_fds", []), *([channel.fileno()] if channel is not None else [])])
        _drop_capabilities(switch_user=spec.get("worker_uid") is not None)
        _prctl(PR_SET_NO_NEW_PRIVS, 1, "set no_new_privs")
        _prctl(PR_SET_DUMPABLE, 0, "clear dumpable")
        if start is not None:  # (before the filter, which may refuse prctl's memory map calls)
            set_command_line(argv, env)
        if seccomp_filter is not None:
            try:
                seccomp_filter.load()
            except OSError as exc:
                raise SetupError(f"load the seccomp filter: {exc}") from None
        if channel is not None:
            # Last: from here every exec (the worker's own, next) and spawn stops until the launcher answers.
            from gpubroker.broker.sandbox._spawn import install_listener, send_listener

            listener = install_listener()
            send_listener(channel, listener)
            os.close(listener)
            channel.close()
    except (SetupError, OSError) as exc:
        os.write(2, f"gpubroker sandbox: cannot build the worker's sandbox: {exc}\n".encode())
        os._exit(EXIT_SETUP_FAILED)
    if start is not None:
        start(argv, env)
    try:
        os.execve(argv[0], argv, env)
    except OSError as exc:
        os.write(2, f"gpubroker sandbox: cannot start {argv[0]}: {exc.strerror}\n".encode())
    os._exit(127)


def _worker_environment(spec: dict[str, Any]) -> dict[str, str]:
    """The worker's own environment (HOME and the caches in the tenant's cache), added only inside the sandbox: the
    launcher itself never has it."""
    return {**os.environ, **{str(k): str(v) for k, v in spec.get("env", {}).items()}}


def _report_pidfd(report_fd: int, pid: int) -> None:
    """Send the front a pidfd of the worker (``pid``, this launcher's child, not yet reapable: it waits for its go)
    on the socket it passed for that, which then closes. The front gives the worker's uid back once it turns
    readable (sandbox/_policy.py, ``WorkerSandbox.free_uid``): a killed launcher says nothing of its worker, which
    the kernel ends a moment later."""
    pidfd = os.pidfd_open(pid)
    try:
        with socket.socket(fileno=report_fd) as report:
            socket.send_fds(report, [b"p"], [pidfd])
    finally:
        os.close(pidfd)


def _mirror_exit(status: int) -> None:
    """Leave as the child did: the same exit code, or death by the same signal (the front reads either)."""
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        try:
            signal.signal(sig, signal.SIG_DFL)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, [sig])
        except (OSError, ValueError):
            pass  # SIGKILL and SIGSTOP cannot be caught, nor need to be
        os.kill(os.getpid(), sig)
        os._exit(128 + sig)  # a signal whose default is not to terminate
    os._exit(os.waitstatus_to_exitcode(status))


def main(argv: list[str] | None = None, start: WorkerStart | None = None) -> int:
    """``--spec JSON -- PROGRAM [ARGS...]``: run PROGRAM in a worker sandbox (``start``: run it in the sandbox's
    process instead of exec'ing it, forked by the zygote); the worker's exit status, mirrored."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) < 4 or args[0] != "--spec" or args[2] != "--":
        print("usage: python -m gpubroker.broker.sandbox --spec JSON -- PROGRAM [ARGS...]", file=sys.stderr)
        return 2
    return launch(json.loads(args[1]), args[3:], start)


def launch(spec: dict[str, Any], worker_argv: list[str], start: WorkerStart | None = None) -> int:
    """Build the sandbox ``spec`` describes and run ``worker_argv`` in it (exec'd, or ``start``ed)."""
    try:
        # The launcher dies with the front (the worker then dies with the launcher).
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL, "set the parent-death signal")
        for fd in (1, 2):
            # The worker writes on these: never the front's log file itself (it could reopen it for reading
            # through /proc/self/fd, and write on it raw), only the pipes the front reads it through.
            if stat.S_ISREG(os.fstat(fd).st_mode):
                raise SetupError(f"the worker's {('stdout', 'stderr')[fd - 1]} is a file: give it a pipe")
        seccomp_filter = None
        if spec.get("seccomp", True):
            from gpubroker.broker.sandbox._seccomp import build_filter

            # (before the new root hides libseccomp's files)
            seccomp_filter = build_filter(allow_spawn=bool(spec.get("spawn", False)))
        if spec.get("cgroup"):
            _write(os.path.join(spec["cgroup"], "cgroup.procs"), "0\n")
        # Before the user namespace is made: the kernel charges its queued signals and message-queue bytes to the
        # creator's uid too (host-wide), against the limits the creator had at its creation: none for message
        # queues; for signals, room for every worker's own SIGPENDING_MAX (set in the child, after the unshare).
        for kind, value in ((resource.RLIMIT_SIGPENDING, SIGPENDING_NAMESPACE), (resource.RLIMIT_MSGQUEUE, 0)):
            _, hard = resource.getrlimit(kind)
            value = value if hard == resource.RLIM_INFINITY else min(value, hard)
            resource.setrlimit(kind, (value, value))
        uid, gid = os.getuid(), os.getgid()
        worker_uid = spec.get("worker_uid")
        helper = _map_ids_from_outside(int(worker_uid)) if worker_uid is not None else None
        flags = CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWNET | CLONE_NEWUTS
        try:
            _check(_libc.unshare(ctypes.c_int(flags | CLONE_NEWCGROUP)), "unshare the worker's namespaces")
        except SetupError:
            if helper is not None:  # (it reads end-of-file and leaves)
                os.close(helper[1])
                os.waitpid(helper[0], 0)
            raise
        if helper is None:
            _write("/proc/self/setgroups", "deny\n")
            _write("/proc/self/uid_map", f"{uid} {uid} 1\n")
            _write("/proc/self/gid_map", f"{gid} {gid} 1\n")
        else:
            # A root broker's worker runs as another host user (``worker_uid``): the kernel never holds the host's
            # root to RLIMIT_NPROC, so only then does worker_pids_max bound its threads without a pids cgroup.
            pid, go = helper
            os.write(go, b"x")
            os.close(go)
            _, status = os.waitpid(pid, 0)
            if status != 0:
                raise SetupError("the worker's user namespace could not be mapped (see above)")
        # Only now: a process that is not dumpable has its /proc/self files owned by root, so a broker that runs
        # as a user of its own could not have written its id maps above.
        _prctl(PR_SET_DUMPABLE, 0, "clear dumpable")
        cache = _cache_view(spec["cache"], owner=worker_uid is not None) if spec.get("cache") else None
    except (SetupError, ImportError, RuntimeError, OSError) as exc:
        print(f"gpubroker sandbox: cannot build the worker's sandbox: {exc}", file=sys.stderr, flush=True)
        return EXIT_SETUP_FAILED
    sys.stdout.flush()
    sys.stderr.flush()
    # The worker's stdout and stderr are the launcher's own: pipes of the front's, one pair per worker, which the
    # front reads, rate-limits, escapes and logs as the tenant's (workers/_output.py). Nothing is relayed here:
    # a copy through this process would cost a second copy of every byte, and the front drains them anyway.
    go, say_go = os.pipe()
    # On OpenCL (a worker that may spawn PoCL's linker), the child hands over the listener of its exec supervision.
    channel, proc = None, -1
    if spec.get("spawn"):
        from gpubroker.broker.sandbox import _spawn  # noqa: F401  (loaded here: the child imports nothing once in its new root)

        channel = socket.socketpair()
        proc = os.open("/proc", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)  # (the host's: see ExecSupervisor)
    pid = os.fork()
    if pid == 0:
        os.close(say_go)
        _child(spec, worker_argv, seccomp_filter, go, channel[1] if channel is not None else None, start)
    os.close(go)
    if spec.get("report_fd") is not None:
        try:
            _report_pidfd(int(spec["report_fd"]), pid)
        except OSError as exc:  # (the child has not gone on: it ends at the end-of-file of its go)
            print(f"gpubroker sandbox: cannot hand the front the worker's pidfd: {exc}", file=sys.stderr, flush=True)
            os.close(say_go)
            os.waitpid(pid, 0)
            return EXIT_SETUP_FAILED
    os.write(say_go, b"x")
    os.close(say_go)
    listener = None
    if channel is not None:
        from gpubroker.broker.sandbox._spawn import receive_listener

        channel[1].close()
        listener = receive_listener(channel[0])  # (None: the child failed first, and says why)
        channel[0].close()
    # Only the worker holds its channels: the front's closing them must reach it as end-of-file.
    _close_fds([*([cache.host_fd, cache.view_fd] if cache is not None else []),
                *([listener, proc] if listener is not None else [])])
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        # The front ends workers by closing their channels or by SIGKILL; a signal sent to the whole process
        # group (a terminal's ^C, systemd's stop) must not end them before the front has drained.
        signal.signal(sig, signal.SIG_IGN)
    try:
        if listener is not None:
            from gpubroker.broker.sandbox._spawn import ExecSupervisor

            # (a worker run in its process makes no exec of its own start: none passes)
            status = ExecSupervisor(pid, listener, proc, started=start is not None).wait()
        else:
            _, status = os.waitpid(pid, 0)
    except ChildProcessError:
        return EXIT_SETUP_FAILED
    # The worker and everything in its PID namespace are gone: nothing writes the cache while it is copied.
    _save_cache(cache)
    _mirror_exit(status)
    return 0
