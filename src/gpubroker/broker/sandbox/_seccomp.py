"""The worker's seccomp filter, built with libseccomp (through pyseccomp): everything is allowed except what
reaches other processes, the kernel's attack surface, the network, new processes, or memory that no limit counts;
those fail with EPERM.

The worker is PID 1 of its PID namespace, so "itself" is pid 1. A pid it names is looked up in that namespace,
where no other process is visible; but "my process group" (pid 0 to kill, who 0 to setpriority(PRIO_PGRP) or
ioprio_set(IOPRIO_WHO_PGRP)) and "my uid" are not confined by it: the group is found by its struct pid, across
namespaces. The worker leads a session and group of its own (the launcher's setsid), and the filter refuses
those forms all the same.
"""

from __future__ import annotations

import errno
import fcntl
import os
from typing import Any

__all__ = ["DENIED", "HOST_USER_COUNTS", "HOST_WIDE_COUNTS", "LOCK_FREE_ENV", "NEW_SOCKETS", "PRIORITY_CALLS",
           "PROCESS_CREATION", "RECORD_LOCKS", "SEAL_ENV", "SIGNALS_TO_PID", "UNCOUNTED_MEMORY", "build_filter",
           "seal_after_device_open"]

# Refused outright: other processes' memory, mounts and namespaces, kernel interfaces a worker has no use for.
DENIED = (
    "ptrace", "process_vm_readv", "process_vm_writev", "process_madvise", "kcmp", "pidfd_getfd",
    "pidfd_send_signal", "tkill",
    "mount", "umount2", "pivot_root", "chroot", "move_mount", "open_tree", "fsopen", "fsmount", "fsconfig",
    "fspick", "mount_setattr", "unshare", "setns",
    "bpf", "perf_event_open", "keyctl", "add_key", "request_key", "userfaultfd",
    "io_uring_setup", "io_uring_enter", "io_uring_register",
    "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module", "reboot", "swapon", "swapoff",
    "acct", "quotactl", "name_to_handle_at", "open_by_handle_at", "iopl", "ioperm", "syslog", "vhangup",
    "lookup_dcookie", "fanotify_init", "nfsservctl",
)
# A worker makes threads, never processes: a forked child would escape the worker's time limit and charge (its CPU is
# not the worker's) and the rlimits that bound the worker (each process gets a budget of its own). clone without
# CLONE_THREAD is refused below; the filter is loaded before the launcher's exec of the worker, and exec itself
# makes no process. The one exception, on OpenCL only (``allow_spawn``): PoCL 3.0 links every newly compiled kernel
# with the system linker, which its in-process clang driver starts with posix_spawn, i.e. clone(CLONE_VM |
# CLONE_VFORK): that shape alone passes there (see build_filter).
PROCESS_CREATION = ("fork", "vfork")
CLONE_THREAD = 0x00010000
CLONE_VM = 0x00000100
CLONE_VFORK = 0x00004000
# Memory outside every rlimit (RLIMIT_AS/RLIMIT_DATA count mappings; a memfd or a System V segment holds its pages
# whether mapped or not): memfd_create (the front passes the worker the memfds it shares; the worker makes none),
# memfd_secret, and System V shared memory, message queues and semaphores (the worker's own IPC namespace keeps
# them from other processes, but not from the host's memory).
# And pages pinned in pipes: vmsplice puts a reference to the worker's own page into a pipe, which keeps it past
# munmap (with transparent huge pages, one byte keeps 2 MiB: 1,536 bytes held 3 GiB past a 1 GiB limit); the pipe
# count bounds slots, not what is behind them. splice and tee move such references between pipes and files.
UNCOUNTED_MEMORY = ("memfd_create", "memfd_secret", "shmget", "msgget", "semget", "vmsplice", "splice", "tee")
# Native AIO: every io_setup reserves events against fs.aio-max-nr, one count for the whole host (16 calls took
# all 65,536: every other process's io_setup failed). Neither PoCL nor CUDA's runtime uses it; io_uring is refused
# with the kernel interfaces above.
HOST_WIDE_COUNTS = ("io_setup", "io_submit", "io_cancel", "io_getevents", "io_pgetevents", "io_destroy")
# Counted per user on the host, not per worker: the kernel charges a user namespace's inotify instances and POSIX
# message queues to its creator's uid as well (the broker's user, host-wide: root's, for a root broker), so one
# worker could take every one of them from the host. And epoll: its watches count against
# fs.epoll.max_user_watches of the host user that made the instance (the broker's, for a broker that is not root,
# whose workers all run as its own uid), ~160 bytes of kernel memory each that no rlimit counts; no bound on
# instances would do (one instance may watch each open file under each descriptor number it ever had). So no
# instance: the worker waits with poll(2) (Python's selectors fall back to it), as PoCL and, as far as is known,
# CUDA's own threads do. A compute worker needs none of these.
HOST_USER_COUNTS = ("inotify_init", "inotify_init1", "mq_open", "epoll_create", "epoll_create1")
# Refused once the worker's device is open (``seal_after_device_open``), because the worker's own setup needs them
# and nothing after it does:
# New sockets, of any family: a worker's sockets are all
# made by the front (its channels) or a client (its links' ends) and inherited or received. What a Unix socket
# holds queued (up to 2 x net.core.wmem_max a socket, and the sockets it has in flight) is host memory that
# RLIMIT_AS and RLIMIT_DATA do not count, only a memory cgroup does: socketpairs filled and left unread took 2 GiB
# past a 1 GiB worker_memory_max. A bound on the number of sockets would not do (RLIMIT_NOFILE of them hold
# gigabytes). Until the device is open only AF_UNIX passes (the filter below): CUDA's initialization makes a Unix
# socket (it looks for an MPS server) and fails with cudaErrorOperatingSystem without one.
NEW_SOCKETS = ("socket", "socketpair")
AF_UNIX = 1
# Kernel objects that no rlimit counts (only a memory cgroup) and that nothing bounds per process: Landlock rulesets
# and rules (one per TCP port: 3.5 MiB of slab per ruleset, 4,096 of them per worker) and stacked seccomp filters (a
# page or more of vmalloc each, ~3,600 per thread). The launcher applies its own Landlock ruleset and the worker
# loads its filters before the device opens.
SETUP_ONLY = ("landlock_create_ruleset", "landlock_add_rule", "landlock_restrict_self", "seccomp")
PR_SET_SECCOMP = 22
# POSIX record locks, the third such object: fcntl's F_SETLK and F_SETLKW, and their open-file-description forms.
# Each locked range is a file_lock (192 bytes of slab), unbounded per descriptor (Linux does not enforce
# RLIMIT_LOCKS): 512,000 one-byte ranges held 96 MiB, taken in 3 s. And flock(2) (one lock an open file, as many
# as the descriptors: nothing of the worker's takes one). Refused with ENOLCK, the kernel's own answer when it has
# no lock to give. Nothing the worker runs locks a file once its device is open: PoCL's kernel cache takes no
# lock, and pyopencl's own caches (pytools' sqlite databases: sqlite locks every transaction) are off in a sealed
# worker (LOCK_FREE_ENV; the broker's build skips pyopencl's binary cache anyway, and the per-tenant compile cache
# is PoCL's).
RECORD_LOCKS = (fcntl.F_SETLK, fcntl.F_SETLKW, fcntl.F_OFD_SETLK, fcntl.F_OFD_SETLKW)
LOCK_CALLS = ("flock",)
LOCK_FREE_ENV = {"PYOPENCL_NO_CACHE": "1"}
# Mappings whose pages RLIMIT_DATA does not count (it counts private writable mappings only), refused by mmap's
# flags (argument 3) once the device is open: shared anonymous memory (MAP_SHARED or MAP_SHARED_VALIDATE with
# MAP_ANONYMOUS: shmem no rlimit but RLIMIT_AS counts, and CUDA has none) and grows-down mappings (stacks, counted
# apart from data). A kernel populated 704 MiB of the first past a PoCL worker's bound, where RLIMIT_AS allows
# PoCL's reserved address space, and without limit under a CUDA worker's RLIMIT_DATA alone. The worker's shared
# memory is the front's memfds alone (file mappings, not anonymous); the sandbox has no /dev/zero, whose shared
# mapping is the same memory (_policy.DEVICES), and the main stack is held by a fixed RLIMIT_STACK.
MAP_FLAGS_ARG = 3
MAP_TYPE_ANONYMOUS = 0x23  # MAP_SHARED | MAP_PRIVATE (MAP_SHARED_VALIDATE is both) and MAP_ANONYMOUS
UNCOUNTED_MAPPINGS = (0x21, 0x23)  # MAP_SHARED | MAP_ANONYMOUS, MAP_SHARED_VALIDATE | MAP_ANONYMOUS
MAP_GROWSDOWN = 0x0100
# Descriptors come to a worker from the front alone, on its fd channel (the links it hands over, the memfds it made
# or checked and charged: a segment's, a ring's). A client's would be memory outside every bound: a sparse memfd
# received off a link and fallocated, 2 GiB past a 1 GiB worker_memory_max. Two locks, either enough alone:
# - the front turns SO_PASSRIGHTS off on the worker's end of every link and doorbell (Linux >= 6.16: the client's
#   sendmsg fails), and this filter refuses the setsockopt that would turn it back on (level and name in
#   registers). A socket the worker sent out could be turned back on by whoever got it: the second lock holds then.
# - recvmsg and recvmmsg (the only calls that install a received descriptor, io_uring being refused) pass on the fd
#   channel's number alone: any other argument, upper bits included, is refused. That number keeps naming the
#   channel: no close of it, no dup2/dup3 onto it, no close-on-exec for it (fcntl F_SETFD, ioctl FIOCLEX, dup3's
#   O_CLOEXEC), and close_range fails with ENOSYS (its bounds are unsigned ints, which a 64-bit comparison cannot
#   hold to a range; glibc then closes one by one). A new descriptor only ever takes the lowest free number, never
#   one in use. Kernels before 6.16 have only this lock.
SO_PASSRIGHTS = 83  # (include/uapi/asm-generic/socket.h; Python has no name for it yet)
SOL_SOCKET = 1
RECEIVING_CALLS = ("recvmsg", "recvmmsg")
FIOCLEX = 0x5451
# An int argument (fcntl's cmd, prctl's option) is the low half of its register to the kernel, but all 64 bits to a
# filter: a rule on such an argument compares the low half alone, or 1 << 32 | F_SETLK would pass it.
INT_BITS = 0xFFFFFFFF
# Set (to "1") in a sandboxed worker's environment: it calls seal_after_device_open once its device is open.
SEAL_ENV = "GPUBROKER_WORKER_SEAL"
# Signals aimed at a process (argument 0): only pid 1 (itself) passes; not 0 (its process group), -1 (every
# process it may signal) or a negative group.
SIGNALS_TO_PID = ("kill", "tgkill", "rt_sigqueueinfo", "rt_tgsigqueueinfo", "pidfd_open")
SELF = 1
# Priorities of processes (argument 0, ``which``): only PRIO_PROCESS / IOPRIO_WHO_PROCESS, whose pid is looked up in
# the worker's namespace (0: itself; a thread's tid: that thread); not a process group's or a user's.
PRIORITY_CALLS = {"setpriority": 0, "getpriority": 0, "ioprio_set": 1, "ioprio_get": 1}
# Another process's limits (argument 0, the pid): only 0 (itself, glibc's getrlimit and setrlimit) and 1.
PID_SELF_ONLY = ("prlimit64",)
# Nodes but regular files (mknod's mode carries the file type: argument 1 of mknod, 2 of mknodat): a FIFO lets the
# tenant's own code keep a compile waiting on an ``#include`` of it (whatever runs meanwhile, the compile uses no
# CPU), a socket node is never a socket the worker needs, and device nodes are not the worker's to make (a user
# namespace may still make a whiteout, char 0:0). The worker's files are made with open(O_CREAT); neither PoCL, its
# linker, CUDA's runtime nor Python makes any node. Refused: every file type but 0 and S_IFREG.
MKNOD_MODE_ARG = {"mknod": 1, "mknodat": 2}
S_IFMT = 0o170000
S_IFREG = 0o100000
NODE_TYPES = tuple(kind << 12 for kind in range(1, 16) if kind << 12 != S_IFREG)
CLONE_NEW = (0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000, 0x40000000)
PERSONALITY_QUERY = 0xFFFFFFFF


def build_filter(allow_spawn: bool = False) -> Any:
    """The filter, ready to ``load()`` (after no_new_privs); ImportError/RuntimeError without libseccomp.

    ``allow_spawn``: clone(CLONE_VM | CLONE_VFORK), posix_spawn's, passes too (PoCL's linker); fork, vfork and
    every other clone without CLONE_THREAD are refused all the same.
    """
    seccomp = _import_pyseccomp()
    deny = seccomp.ERRNO(errno.EPERM)
    f = seccomp.SyscallFilter(seccomp.ALLOW)
    # A syscall of another ABI (x86's int 0x80, x32) would dodge the rules below: kill the process instead.
    f.set_attr(seccomp.Attr.ACT_BADARCH, seccomp.KILL_PROCESS)
    for name in (*DENIED, *PROCESS_CREATION, *UNCOUNTED_MEMORY, *HOST_USER_COUNTS, *HOST_WIDE_COUNTS):
        _rule(seccomp, f, deny, name)
    for name in SIGNALS_TO_PID:
        _rule(seccomp, f, deny, name, seccomp.Arg(0, seccomp.NE, SELF))
    for name, process in PRIORITY_CALLS.items():
        _rule(seccomp, f, deny, name, seccomp.Arg(0, seccomp.NE, process))
    for name in PID_SELF_ONLY:
        _rule(seccomp, f, deny, name, seccomp.Arg(0, seccomp.GT, SELF))
    for flag in CLONE_NEW:
        _rule(seccomp, f, deny, "clone", seccomp.Arg(0, seccomp.MASKED_EQ, flag, flag))
    for name, mode in MKNOD_MODE_ARG.items():
        for kind in NODE_TYPES:
            _rule(seccomp, f, deny, name, seccomp.Arg(mode, seccomp.MASKED_EQ, S_IFMT, kind))
    # Threads only (rules on one syscall are alternatives: any one refuses the call).
    if allow_spawn:
        # Without CLONE_THREAD, only with both CLONE_VM and CLONE_VFORK: the three other combinations are refused.
        shape = CLONE_THREAD | CLONE_VM | CLONE_VFORK
        for flags in (0, CLONE_VM, CLONE_VFORK):
            _rule(seccomp, f, deny, "clone", seccomp.Arg(0, seccomp.MASKED_EQ, shape, flags))
    else:
        _rule(seccomp, f, deny, "clone", seccomp.Arg(0, seccomp.MASKED_EQ, CLONE_THREAD, 0))
    # clone3 passes its flags in memory, out of a filter's reach: ENOSYS makes glibc fall back to clone.
    _rule(seccomp, f, seccomp.ERRNO(errno.ENOSYS), "clone3")
    for name in NEW_SOCKETS:
        _rule(seccomp, f, deny, name, seccomp.Arg(0, seccomp.NE, AF_UNIX))
    # Reading the persona is harmless; changing it (ADDR_NO_RANDOMIZE, READ_IMPLIES_EXEC) is not.
    _rule(seccomp, f, deny, "personality", seccomp.Arg(0, seccomp.NE, PERSONALITY_QUERY))
    return f


def seal_after_device_open(channel: int | None = None, backend: str = "opencl") -> None:
    """From now on this process, its threads and whatever it spawns make no socket of any family, no Landlock
    ruleset or seccomp filter (a filter stacked on the launcher's: filters only ever add refusals), take no
    record lock or flock, on OpenCL map no shared anonymous or grows-down memory, and receive descriptors on the front's
    fd channel (``channel``; None: nowhere) alone. Called by a sandboxed worker once its device is open, before
    anything of a tenant's runs; OSError/ImportError/RuntimeError if the filter cannot be loaded."""
    if channel is not None:
        os.set_inheritable(channel, True)  # (an exec keeps it: its number names the channel in the new image too)
    seccomp = _import_pyseccomp()
    f = seccomp.SyscallFilter(seccomp.ALLOW)
    f.set_attr(seccomp.Attr.ACT_BADARCH, seccomp.KILL_PROCESS)
    # Every thread: the device's runtime has started its own already (PoCL's pool runs the kernels), and a filter
    # is loaded into the calling thread only unless synchronised (the load fails if a thread cannot take it).
    f.set_attr(seccomp.Attr.CTL_TSYNC, 1)
    deny = seccomp.ERRNO(errno.EPERM)
    for name in NEW_SOCKETS + SETUP_ONLY:
        _rule(seccomp, f, deny, name)
    _rule(seccomp, f, deny, "prctl", seccomp.Arg(0, seccomp.MASKED_EQ, INT_BITS, PR_SET_SECCOMP))
    no_lock = seccomp.ERRNO(errno.ENOLCK)
    for cmd in RECORD_LOCKS:
        _rule(seccomp, f, no_lock, "fcntl", seccomp.Arg(1, seccomp.MASKED_EQ, INT_BITS, cmd))
    for name in LOCK_CALLS:
        _rule(seccomp, f, no_lock, name)
    # (OpenCL only: CUDA's runtime maps shared anonymous memory of its own, and without it PyTorch's first kernel
    # fails with "out of memory": a CUDA worker's such pages are a known gap, counted only by a memory cgroup.)
    if backend == "opencl":
        for shape in UNCOUNTED_MAPPINGS:
            _rule(seccomp, f, deny, "mmap", seccomp.Arg(MAP_FLAGS_ARG, seccomp.MASKED_EQ, MAP_TYPE_ANONYMOUS, shape))
        _rule(seccomp, f, deny, "mmap", seccomp.Arg(MAP_FLAGS_ARG, seccomp.MASKED_EQ, MAP_GROWSDOWN, MAP_GROWSDOWN))
    _rule(seccomp, f, deny, "setsockopt", seccomp.Arg(1, seccomp.MASKED_EQ, INT_BITS, SOL_SOCKET),
          seccomp.Arg(2, seccomp.MASKED_EQ, INT_BITS, SO_PASSRIGHTS))
    for name in RECEIVING_CALLS:
        if channel is None:
            _rule(seccomp, f, deny, name)
        else:
            _rule(seccomp, f, deny, name, seccomp.Arg(0, seccomp.NE, channel))
    if channel is not None:
        _rule(seccomp, f, deny, "close", seccomp.Arg(0, seccomp.MASKED_EQ, INT_BITS, channel))
        for name in ("dup2", "dup3"):
            _rule(seccomp, f, deny, name, seccomp.Arg(1, seccomp.MASKED_EQ, INT_BITS, channel))
        _rule(seccomp, f, deny, "fcntl", seccomp.Arg(0, seccomp.MASKED_EQ, INT_BITS, channel),
              seccomp.Arg(1, seccomp.MASKED_EQ, INT_BITS, fcntl.F_SETFD))
        _rule(seccomp, f, deny, "ioctl", seccomp.Arg(0, seccomp.MASKED_EQ, INT_BITS, channel),
              seccomp.Arg(1, seccomp.MASKED_EQ, INT_BITS, FIOCLEX))
    _rule(seccomp, f, seccomp.ERRNO(errno.ENOSYS), "close_range")
    f.load()


def _import_pyseccomp() -> Any:
    """pyseccomp, found without ctypes.util.find_library: that runs ``ldconfig -p`` twice (tens of ms on every
    worker start); the sonames are stable ABI names, so try them first."""
    import ctypes
    import ctypes.util

    lookup = ctypes.util.find_library
    known = {"c": "libc.so.6", "seccomp": "libseccomp.so.2"}

    def find_library(name: str) -> str | None:
        soname = known.get(name)
        if soname is not None:
            try:
                ctypes.CDLL(soname)
                return soname
            except OSError:
                pass
        return lookup(name)

    ctypes.util.find_library = find_library
    try:
        import pyseccomp
    finally:
        ctypes.util.find_library = lookup
    return pyseccomp


def _rule(seccomp: Any, f: Any, action: int, name: str, *args: Any) -> None:
    try:
        number = seccomp.resolve_syscall(seccomp.Arch.NATIVE, name)
    except (OSError, ValueError):
        return  # not a syscall of this architecture (iopl on arm64, say)
    if number < 0:
        return
    f.add_rule(action, number, *args)
