"""Landlock (ABI 2, Linux >= 5.19): which files a worker may execute, checked by the kernel at every exec.

A worker execs nothing of its own once it runs. On OpenCL, PoCL's in-process clang driver starts the system linker
(``ld``, found on PATH) with posix_spawn for each newly compiled kernel, so there a spawned process must be able to
exec that linker, and the ELF interpreter it names (the kernel opens the interpreter for execution too). The worker
restricts itself to exactly those files, first thing at its start (``confine_exec``; nothing at all on other
backends): a kernel's child can no longer exec the worker's Python, or any other program the sandbox shows.

Landlock bounds which files start, not what runs: the interpreter (``ld.so``) runs any ELF named as its argument,
and the linker loads plugins and honours LD_PRELOAD. What a spawned process may *hold* is bounded by the
launcher's exec supervision (``_spawn.py``), whichever program it is.

Only the standard library and ctypes: the three system calls have no glibc wrapper.
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import struct

__all__ = ["EXEC_ENV", "abi", "confine_exec", "elf_interpreter", "linker_files"]

# The worker's environment names what it may execute: "linker" (OpenCL) or "none". Set by the front only where
# Landlock works (``abi() > 0``); the worker, sandboxed, then must apply it or not start.
EXEC_ENV = "GPUBROKER_WORKER_EXEC"
# The names clang's driver looks up for its default linker ("<triple>-ld" first, then "ld").
LINKER_NAMES = ("ld", f"{os.uname().machine}-linux-gnu-ld")

SYS_LANDLOCK_CREATE_RULESET = 444  # the same numbers on every architecture
SYS_LANDLOCK_ADD_RULE = 445
SYS_LANDLOCK_RESTRICT_SELF = 446
LANDLOCK_CREATE_RULESET_VERSION = 1
LANDLOCK_RULE_PATH_BENEATH = 1
LANDLOCK_ACCESS_FS_EXECUTE = 1 << 0
# ABI 2 (Linux 5.19): under any ruleset that does not handle (and grant) it, a rename or link into another directory
# is refused, and PoCL renames each linked kernel into its cache directory. Granted everywhere below; ABI 1, which
# refuses such renames whatever the ruleset, is not used.
LANDLOCK_ACCESS_FS_REFER = 1 << 13
MIN_ABI = 2
# ABI 6 (Linux 6.12): a domain may not connect to abstract Unix sockets, nor signal processes, outside itself. The
# network and PID namespaces already keep both from the host; these hold should those be beaten.
LANDLOCK_SCOPE_ABSTRACT_UNIX_SOCKET = 1 << 0
LANDLOCK_SCOPE_SIGNAL = 1 << 1
SCOPES_ABI = 6
# ABI 7 (Linux 6.15): no audit record for this process's own denials, which a tenant could otherwise repeat to flood
# the host's audit log (records of its spawned processes are off by default).
LANDLOCK_RESTRICT_SELF_LOG_SAME_EXEC_OFF = 1 << 0
LOG_FLAGS_ABI = 7
PT_INTERP = 3

_libc = ctypes.CDLL(None, use_errno=True)


class _RulesetAttr(ctypes.Structure):
    # Fields of later ABIs are zero for an older kernel, which accepts a larger struct whose extra bytes are zero.
    _fields_ = [("handled_access_fs", ctypes.c_uint64), ("handled_access_net", ctypes.c_uint64),
                ("scoped", ctypes.c_uint64)]


class _PathBeneathAttr(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def abi() -> int:
    """Landlock's ABI version here; 0 where the kernel lacks it (or has only ABI 1, see LANDLOCK_ACCESS_FS_REFER)
    or the LSM is not enabled."""
    version = int(_libc.syscall(ctypes.c_long(SYS_LANDLOCK_CREATE_RULESET), None, ctypes.c_size_t(0),
                                ctypes.c_uint32(LANDLOCK_CREATE_RULESET_VERSION)))
    return version if version >= MIN_ABI else 0


def elf_interpreter(path: str) -> str | None:
    """The program interpreter (PT_INTERP) an ELF executable names, or None (static, not ELF, unreadable)."""
    try:
        with open(path, "rb") as f:
            head = f.read(64)
            if len(head) < 52 or head[:4] != b"\x7fELF" or head[4] not in (1, 2) or head[5] not in (1, 2):
                return None
            wide, order = head[4] == 2, "<" if head[5] == 1 else ">"
            word = order + ("Q" if wide else "I")

            def field(fmt: str, data: bytes, offset: int) -> int:
                return int(struct.unpack_from(fmt, data, offset)[0])

            # (ELF64: e_phoff at 32, e_phentsize and e_phnum at 54; ELF32: 28 and 42)
            phoff = field(word, head, 32 if wide else 28)
            entsize, count = (field(order + "H", head, o) for o in ((54, 56) if wide else (42, 44)))
            for i in range(min(count, 128)):
                f.seek(phoff + i * entsize)
                header = f.read(entsize)
                if len(header) < (56 if wide else 32) or field(order + "I", header, 0) != PT_INTERP:
                    continue
                # (p_offset and p_filesz: at 8 and 32 in ELF64, 4 and 16 in ELF32)
                offset, size = (field(word, header, o) for o in ((8, 32) if wide else (4, 16)))
                f.seek(offset)
                return f.read(min(size, 4096)).split(b"\0", 1)[0].decode(errors="replace") or None
    except (OSError, struct.error):
        return None
    return None


def linker_files(path: str | None = None) -> list[str]:
    """The files PoCL's linker needs to execute: each linker name found on PATH and the interpreter each names
    (real paths, no duplicates; none where PATH has no linker, and PoCL cannot link there either)."""
    files: list[str] = []
    for name in LINKER_NAMES:
        found = shutil.which(name, path=path)
        if found is None:
            continue
        for candidate in (found, elf_interpreter(found)):
            if candidate is not None and os.path.realpath(candidate) not in files:
                files.append(os.path.realpath(candidate))
    return files


def confine_exec(files: list[str], version: int | None = None) -> int:
    """Restrict this process and every process it starts to executing only ``files`` (none: nothing at all), and on
    ABI 6 and later scope abstract Unix sockets and signals to them. Needs no_new_privs (the sandbox set it).
    Returns the ABI used; OSError when Landlock is missing or refuses."""
    version = abi() if version is None else version
    if version < MIN_ABI:
        raise OSError(errno.EOPNOTSUPP, "Landlock is not available (Linux < 5.19, or the LSM is not enabled)")
    scoped = LANDLOCK_SCOPE_ABSTRACT_UNIX_SOCKET | LANDLOCK_SCOPE_SIGNAL if version >= SCOPES_ABI else 0
    attr = _RulesetAttr(LANDLOCK_ACCESS_FS_EXECUTE | LANDLOCK_ACCESS_FS_REFER, 0, scoped)
    ruleset = _syscall(SYS_LANDLOCK_CREATE_RULESET, "create a Landlock ruleset", ctypes.byref(attr),
                       ctypes.c_size_t(ctypes.sizeof(attr)), ctypes.c_uint32(0))
    try:
        for path, access in (("/", LANDLOCK_ACCESS_FS_REFER), *((f, LANDLOCK_ACCESS_FS_EXECUTE) for f in files)):
            try:
                fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            except OSError as exc:
                raise OSError(exc.errno, f"open {path} for a Landlock rule: {exc.strerror}") from None
            try:
                rule = _PathBeneathAttr(access, fd)
                _syscall(SYS_LANDLOCK_ADD_RULE, f"add the Landlock rule for {path}", ctypes.c_int(ruleset),
                         ctypes.c_int(LANDLOCK_RULE_PATH_BENEATH), ctypes.byref(rule), ctypes.c_uint32(0))
            finally:
                os.close(fd)
        flags = LANDLOCK_RESTRICT_SELF_LOG_SAME_EXEC_OFF if version >= LOG_FLAGS_ABI else 0
        _syscall(SYS_LANDLOCK_RESTRICT_SELF, "enforce the Landlock ruleset", ctypes.c_int(ruleset),
                 ctypes.c_uint32(flags))
    finally:
        os.close(ruleset)
    return version


def _syscall(number: int, what: str, *args: object) -> int:
    result = int(_libc.syscall(ctypes.c_long(number), *args))
    if result < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return result
