"""The worker's seccomp filter, built with libseccomp (through pyseccomp): everything is allowed except what
reaches other processes, the kernel's attack surface, or the network; those fail with EPERM.

The worker is PID 1 of its PID namespace, so "itself" is pid 1 (0 means its own process group, which holds
only itself and its descendants there).
"""

from __future__ import annotations

import errno
from typing import Any

__all__ = ["DENIED", "build_filter"]

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
# Signals aimed at a process (argument 0): only pid 0 (its group) and 1 (itself) pass.
SIGNALS_TO_PID = ("kill", "tgkill", "rt_sigqueueinfo", "rt_tgsigqueueinfo", "pidfd_open")
CLONE_NEW = (0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000, 0x40000000)
AF_UNIX = 1
PERSONALITY_QUERY = 0xFFFFFFFF


def build_filter() -> Any:
    """The filter, ready to ``load()`` (after no_new_privs); ImportError/RuntimeError without libseccomp."""
    seccomp = _import_pyseccomp()
    deny = seccomp.ERRNO(errno.EPERM)
    f = seccomp.SyscallFilter(seccomp.ALLOW)
    # A syscall of another ABI (x86's int 0x80, x32) would dodge the rules below: kill the process instead.
    f.set_attr(seccomp.Attr.ACT_BADARCH, seccomp.KILL_PROCESS)
    for name in DENIED:
        _rule(seccomp, f, deny, name)
    for name in SIGNALS_TO_PID:
        _rule(seccomp, f, deny, name, seccomp.Arg(0, seccomp.GT, 1))
    for flag in CLONE_NEW:
        _rule(seccomp, f, deny, "clone", seccomp.Arg(0, seccomp.MASKED_EQ, flag, flag))
    # clone3 passes its flags in memory, out of a filter's reach: ENOSYS makes glibc fall back to clone.
    _rule(seccomp, f, seccomp.ERRNO(errno.ENOSYS), "clone3")
    for name in ("socket", "socketpair"):
        _rule(seccomp, f, deny, name, seccomp.Arg(0, seccomp.NE, AF_UNIX))
    # Reading the persona is harmless; changing it (ADDR_NO_RANDOMIZE, READ_IMPLIES_EXEC) is not.
    _rule(seccomp, f, deny, "personality", seccomp.Arg(0, seccomp.NE, PERSONALITY_QUERY))
    return f


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
