"""The front's side of the sandbox: what each worker may see, its environment, its cache and its cgroup."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import importlib.util
import json
import logging
import os
import select
import shutil
import socket
import subprocess
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, NamedTuple

from gpubroker.broker.config import parse_uid_range
from gpubroker.broker.sandbox import _landlock, _seccomp
from gpubroker.broker.sandbox._cgroup import WorkerCgroups
from gpubroker.broker.sandbox._launch import EXIT_SETUP_FAILED
from gpubroker.broker.sandbox._spawn import LINKER_MEMORY
from gpubroker.wire.errors import FailedPrecondition, ResourceExhausted, Unavailable

__all__ = ["Launch", "SandboxUnavailable", "WorkerMemory", "WorkerSandbox", "WorkerUids", "WorkerUidsExhausted",
           "automatic_memory_max", "automatic_reserved", "cache_key", "default_cache_dir", "python_argv"]

log = logging.getLogger("gpubroker.sandbox")

# The worker's package, bound read-only wherever it lives (an editable install maps it to the source tree's src/).
PACKAGES = ("gpubroker",)
SYSTEM_RO = ("/usr", "/lib", "/lib64", "/lib32", "/libx32", "/bin", "/sbin", "/etc/ld.so.cache",
             "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/OpenCL", "/sys/devices/system/cpu",
             "/sys/devices/system/node")
# No /dev/zero: its shared writable mapping is shared anonymous memory, which RLIMIT_DATA does not count (the
# filter refuses the anonymous forms by their flags, but cannot tell /dev/zero's descriptor from a segment's memfd).
# Nothing a worker runs opens it (glibc, Python, PoCL and LLVM map anonymous memory instead).
DEVICES = ("/dev/null", "/dev/full", "/dev/random", "/dev/urandom")
CUDA_RO = ("/usr/local/cuda", "/usr/local/nvidia", "/sys", "/etc/nvidia", "/usr/share/nvidia")
CUDA_DEVICES = ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools", "/dev/nvidia-modeset",
                "/dev/nvidia-caps")
# Passed through to the worker when the operator set them; nothing else of the front's environment is.
ENV_KEEP = ("PATH", "LANG", "LC_ALL", "TZ", "PYTHONPATH", "LD_LIBRARY_PATH", "GPUBROKER_LOG_FORMAT",
            "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "CUDA_PATH", "CUDA_HOME")
ENV_PREFIXES = ("POCL_", "CUPY_", "OCL_ICD_")
NOFILE = 4096
# The main stack's most (soft and hard, so the worker cannot raise it): a stack grows on any thread's fault below
# it, counted only as address space (RLIMIT_AS, which CUDA workers do not have), never as data. glibc's default
# for new threads' stacks too (8 MiB: the usual soft limit).
STACK_MAX = 8 << 20
# Under the cache root: one directory per tenant name, in it one per credential (see ``cache_key``). Nothing outside
# it is ever deleted, so a cache_dir that the operator shares with other files loses none of them.
TENANT_CACHES = "tenants"
CACHE_MAX = 256 << 20  # the schema's defaults, for a WorkerSandbox made without a config
TMP_MAX = 64 << 20
# The schema's default worker_uids (0x7FFF0000-0x7FFFFFFE: see its description for why no one else uses them).
WORKER_UIDS = (0x7FFF0000, 0x7FFFFFFE)


def python_argv() -> list[str]:
    """How the front starts a Python module of its own (the launcher, the worker), before the module's name.

    ``-s``: no user site. Its ``.pth`` files run at start, and the worker's HOME is its tenant's cache, which the
    tenant's kernels write: with it, a kernel plants code that the next launcher (on the host, with every
    capability) or worker runs. ``-P``: no script or working directory on the import path. Not ``-I``, whose ``-E``
    would drop the operator's PYTHONPATH, which may be how this gpubroker is found; every other variable a Python
    reads is the operator's or none (``launcher_environment``)."""
    return [sys.executable, "-s", "-P", "-m"]
# worker_memory_max = 0 (the default) is automatic: what the tenant may hold plus what the runtime needs of its own
# (automatic_memory_max). A CUDA worker's own: `import torch` failed under an RLIMIT_DATA of 1 GiB and worked under
# 4 GiB (an H100 host), with about 1.5 GiB of private writable memory after it; CuPy needs less.
CUDA_RUNTIME = 4 << 30
# An OpenCL worker's own: the interpreter, the ICD, PoCL and LLVM, and a PoCL thread per CPU with its stack and
# working memory. PoCL 6 at its first context, private writable memory (VmData): about 50 MiB on two CPUs, 440 MiB
# on sixteen (the H200 host).
OPENCL_RUNTIME = 512 << 20
OPENCL_RUNTIME_PER_CPU = 32 << 20
# Address space an OpenCL worker reserves without using it as memory, which RLIMIT_AS counts all the same: each
# thread's malloc arena (64 MiB), the libraries' mappings. PoCL 6 at its first context (VmSize less VmData):
# about 270 MiB on two CPUs, 1 GiB on sixteen.
OPENCL_RESERVED = 512 << 20
OPENCL_RESERVED_PER_CPU = 96 << 20


class WorkerMemory(NamedTuple):
    """One worker's memory bounds (``WorkerSandbox.worker_memory``)."""

    total: int  # all it may use, its tmpfs included: memory.max in a cgroup (0: no limit)
    shared: int = 0  # of which the side channel's segments (shared mappings: not in RLIMIT_DATA)
    reserved: int = 0  # address space beyond the total that RLIMIT_AS allows for (reserved, never memory)


def automatic_memory_max(backend: str, quota: int, shared: int, cache_max: int, tmp_max: int) -> int:
    """The memory one worker may use when ``worker_memory_max`` is 0: the tenant's device memory quota on the
    worker's device (``quota``: on OpenCL's CPU devices, buffers are host memory), the host memory its sessions
    may share with the worker (``shared``: mapped into the worker, and on a cgroup charged to it where it touches
    the pages first), the runtime's own (CUDA_RUNTIME, or OPENCL_RUNTIME and OPENCL_RUNTIME_PER_CPU), and its
    tmpfs (compile cache, /tmp and /dev/shm); never less than twice the tmpfs, so that they take at most half of
    it, as an explicit worker_memory_max must leave them."""
    # (cuda, or auto: whichever backend a worker finds, the larger; on OpenCL the one linker PoCL may run besides)
    runtime = (OPENCL_RUNTIME + OPENCL_RUNTIME_PER_CPU * _cpus() + LINKER_MEMORY if backend == "opencl"
               else CUDA_RUNTIME)
    tmpfs = cache_max + tmp_max
    return max(quota + shared + runtime + tmpfs, 2 * tmpfs)


def automatic_reserved(backend: str) -> int:
    """The address space an automatic limit allows a worker beyond its memory (RLIMIT_AS, OpenCL only)."""
    return OPENCL_RESERVED + OPENCL_RESERVED_PER_CPU * _cpus() if backend == "opencl" else 0


def _cpus() -> int:
    """The host's CPUs: PoCL runs a thread on each."""
    return os.cpu_count() or 1


class SandboxUnavailable(Exception):
    """The sandbox cannot be built on this host; the message says what failed and how to opt out."""


class WorkerUidsExhausted(ResourceExhausted):
    """Every host uid of ``worker_uids`` belongs to a worker that is running or still exiting: the broker's
    condition for a while (too many workers for its range), neither the tenant's doing nor the device's fault."""


class WorkerUids:
    """The host uids a root broker's workers run as (``worker_uids``), one worker each: the kernel counts some
    things per host user, whatever the namespace (pipe buffers, descriptors in flight, RLIMIT_NPROC before Linux
    5.14), so workers that shared one could take them from each other. A uid is taken at a worker's start and given
    back only once no process of that worker is left (``WorkerSandbox.free_uid``)."""

    def __init__(self, first: int, last: int) -> None:
        self.first, self.last = first, last
        self.size = last - first + 1
        self.taken: set[int] = set()
        # Round robin: a uid given back is the last to be taken again, so whatever the kernel frees after the
        # processes (an in-flight descriptor cycle its garbage collector has yet to reach) is gone by then.
        self._next = 0

    def take(self, tenant: str) -> int:
        if len(self.taken) >= self.size:
            raise WorkerUidsExhausted(
                f"a worker for tenant {tenant!r} cannot start now: each of the {self.size} host uids of [broker] "
                "worker_uids runs another worker (or one that is exiting); retry in a moment, or ask the operator to "
                "widen worker_uids", reason="worker uids", retry_after_seconds=1.0)
        while True:
            uid = self.first + self._next
            self._next = (self._next + 1) % self.size
            if uid not in self.taken:
                self.taken.add(uid)
                return uid

    def give(self, uid: int) -> None:
        self.taken.discard(uid)


def default_cache_dir() -> Path:
    """Where the per-tenant compile caches go when the config names no ``cache_dir``."""
    if os.environ.get("CACHE_DIRECTORY"):  # systemd's CacheDirectory= (deploy/gpubroker.service)
        return Path(os.environ["CACHE_DIRECTORY"].split(":")[0])
    if os.environ.get("STATE_DIRECTORY"):  # systemd's StateDirectory= (the first, if several)
        return Path(os.environ["STATE_DIRECTORY"].split(":")[0]) / "cache"
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]) / "gpubroker"
    return Path.home() / ".cache" / "gpubroker"


def cache_key(token_hash: str) -> str:
    """The name of a tenant's compile cache under its name's directory: derived from its stored token hash (a
    fresh random HMAC key each time a token is minted), so a tenant removed and added again under the same name,
    with the broker up or down meanwhile, never finds its predecessor's cache, and a rotated token (after a
    leak, say) leaves behind what the old token's holder may have planted: that tenant's next worker starts from
    an empty cache. Not secret: a one-way digest of a value that is itself no credential."""
    return hashlib.sha256(token_hash.encode()).hexdigest()[:16]


@dataclass
class Launch:
    """How to start one worker: its argv and environment, the cgroup to release after it exits, and the
    compile cache it writes to."""

    argv: list[str]
    env: dict[str, str]
    cgroup: Path | None = None
    cache: Path | None = None
    memory_max: int = 0  # the memory it may use (worker_memory_max, or the automatic value for its tenant); 0: none
    uid: int | None = None  # the host uid it runs as (worker_uids), its own until ``WorkerSandbox.free_uid``
    # A socketpair on which the launcher sends the worker's pidfd (with ``uid``): the front's end, and the
    # launcher's, which the front passes to it and closes once it is started (``started``).
    pidfd_report: socket.socket | None = None
    launcher_end: socket.socket | None = None

    @property
    def launcher_fds(self) -> list[int]:
        """The descriptors the launcher itself needs besides the worker's (not passed on to the worker)."""
        return [self.launcher_end.fileno()] if self.launcher_end is not None else []

    def started(self) -> None:
        """The launcher was started (or could not be): the front keeps only its own end."""
        if self.launcher_end is not None:
            self.launcher_end.close()


class WorkerSandbox:
    """Builds every worker's launch from the config; ``check()`` proves at start that the sandbox works."""

    def __init__(self, *, enabled: bool, backend: str, cache_dir: str = "", memory_max: int = 0,
                 pids_max: int = 512, cpu_weight: int = 100, use_cgroups: bool = True,
                 cache_max: int = CACHE_MAX, tmp_max: int = TMP_MAX,
                 worker_uids: tuple[int, int] | None = WORKER_UIDS) -> None:
        self.enabled = enabled
        # The host uids (and gids) a root broker's workers run as, one each (WorkerUids): the kernel never holds
        # the host's root to RLIMIT_NPROC, so as root a worker's threads would be bounded by nothing without a pids
        # cgroup, and it counts a few things per host uid. A broker of another user runs its workers as itself
        # (RLIMIT_NPROC holds it). None: as the broker, root included.
        self.uids = WorkerUids(*worker_uids) if os.getuid() == 0 and worker_uids is not None else None
        self.backend = backend
        self.cache_root = Path(cache_dir) if cache_dir else default_cache_dir()
        self.memory_max = memory_max
        self.pids_max = pids_max
        self.cache_max = cache_max
        self.tmp_max = tmp_max
        # On OpenCL the worker's memory includes the one linker PoCL may run at a time (_spawn.py).
        linker = LINKER_MEMORY if backend == "opencl" else 0
        if memory_max and enabled and 2 * (cache_max + tmp_max) + linker > memory_max:
            # Both tmpfs are the worker's memory (its cgroup is charged for their pages; without one, its rlimits
            # leave room for them): they may take at most half of it.
            raise FailedPrecondition(
                f"[broker] worker_memory_max ({memory_max} bytes) includes the worker's compile cache "
                f"(cache_max_bytes, {cache_max}) and its /tmp and /dev/shm (worker_tmp_max_bytes, {tmp_max}), which "
                "may take at most half of it"
                + (f" once the {linker >> 20} MiB of the linker PoCL runs are set apart" if linker else "")
                + ": raise worker_memory_max or lower those")
        self.cgroups: WorkerCgroups | None = None
        self.cgroup_reason = "sandbox off" if not enabled else "cgroups not tried"
        # Landlock's ABI (0: none here): where there is one, each worker may execute only PoCL's linker (OpenCL) or
        # nothing at all (_landlock.py).
        self.landlock = _landlock.abi() if enabled else 0
        # The key of each tenant's cache (``cache_key`` of its token hash); the broker sets it from its config.
        self.tenant_key: Callable[[str], str] = lambda tenant: "default"
        # What a tenant may hold, for the automatic memory limit (worker_memory_max = 0): its memory quota on a
        # device, and the host memory its sessions may map through the side channel. The broker sets both from its
        # config; without one (a probe, a test's sandbox) a worker gets the runtime's share alone.
        self.tenant_quota: Callable[[str, int], int] = lambda tenant, device: 0
        self.tenant_shared: Callable[[str], int] = lambda tenant: 0
        if enabled and use_cgroups:
            self.cgroups, self.cgroup_reason = WorkerCgroups.setup(memory_max, pids_max, cpu_weight)

    @classmethod
    def from_config(cls, cfg: Any, backend: str, use_cgroups: bool = True) -> WorkerSandbox:
        return cls(enabled=cfg.sandbox, backend=backend, cache_dir=cfg.cache_dir, memory_max=cfg.worker_memory_max,
                   pids_max=cfg.worker_pids_max, cpu_weight=cfg.worker_cpu_weight, use_cgroups=use_cgroups,
                   cache_max=cfg.cache_max_bytes, tmp_max=cfg.worker_tmp_max_bytes,
                   worker_uids=parse_uid_range(cfg.worker_uids))

    def worker_memory(self, tenant: str | None, device: int = 0) -> WorkerMemory:
        """The memory the tenant's worker on ``device`` may use: ``worker_memory_max`` when the operator set it
        (all of it for any use), else ``automatic_memory_max`` of the tenant's quotas as the config says now, with
        the shared memory and the reserved address space (``automatic_reserved``) said apart (``tenant`` None: no
        tenant's, a probe). A running worker keeps the limits it started with."""
        if self.memory_max:
            return WorkerMemory(self.memory_max)
        quota = self.tenant_quota(tenant, device) if tenant is not None else 0
        shared = self.tenant_shared(tenant) if tenant is not None else 0
        return WorkerMemory(automatic_memory_max(self.backend, quota, shared, self.cache_max, self.tmp_max), shared,
                            automatic_reserved(self.backend))

    @property
    def description(self) -> str:
        """The layers in force, e.g. ``namespaces+seccomp+cgroup+landlock`` (``OFF`` without a sandbox)."""
        if not self.enabled:
            return "OFF"
        return "namespaces+seccomp+" + ("cgroup" if self.cgroups is not None else "rlimits") + (
            "+landlock" if self.landlock else "")

    @property
    def pids_enforced(self) -> bool:
        """Whether the kernel holds each worker to ``pids_max``: a pids cgroup, or RLIMIT_NPROC on a worker that is
        not the host's root (which the kernel never holds to it). Otherwise only the CPU watch's count does."""
        if not self.enabled:
            return False
        if self.cgroups is not None and "pids" in self.cgroups.controllers:
            return True
        return os.getuid() != 0 or self.uids is not None

    def check_cache_root(self) -> None:
        """Create the caches' root (mode 0700) now, so a root the broker cannot use stops it at start, by name."""
        try:
            self.cache_root.mkdir(mode=0o700, parents=True, exist_ok=True)
            os.chmod(self.cache_root, 0o700)
        except OSError as exc:
            raise FailedPrecondition(f"[broker] cache_dir: cannot use {str(self.cache_root)!r} for the tenants' "
                                     f"compile caches ({exc.strerror}); expected a directory this broker's user "
                                     "may create and own") from None

    @property
    def tenants_root(self) -> Path:
        return self.cache_root / TENANT_CACHES

    def cache_path(self, tenant: str, key: str) -> Path:
        """Where the tenant's compile cache under ``key`` is (see ``cache_key``): ``<cache_dir>/tenants/<tenant>/
        <key>``."""
        return self.tenants_root / tenant / key

    def tenant_cache(self, tenant: str, key: str | None = None) -> Path:
        """The tenant's own compile-cache directory (mode 0700), created on first use (``key``: its
        ``tenant_key``)."""
        path = self.cache_path(tenant, self.tenant_key(tenant) if key is None else key)
        try:
            for directory in (self.cache_root, self.tenants_root, path.parent, path):
                directory.mkdir(mode=0o700, parents=True, exist_ok=True)
                os.chmod(directory, 0o700)
        except OSError as exc:  # (an operator's doing, not the tenant's: say what to fix)
            raise Unavailable(f"cannot prepare tenant {tenant!r}'s compile cache under {str(self.cache_root)!r} "
                              f"({exc.strerror}); the operator must fix [broker] cache_dir") from None
        return path

    def remove_caches(self, paths: Iterable[Path]) -> list[Path]:
        """Delete these tenant caches (each a ``cache_path``: nothing else is ever touched), and a tenant's
        directory that is left empty. Blocking (run it in a thread). Returns what it deleted.

        Only caches this broker knows to be stale are named here (a removed tenant's, a rotated token's): the
        cache root may be shared with other brokers of the same user, whose tenants' caches are theirs."""
        removed: list[Path] = []
        for path in paths:
            if path.parent.parent != self.tenants_root:
                continue
            if path.is_symlink() or path.exists():
                _remove(path)
                removed.append(path)
            with contextlib.suppress(OSError):  # (only if empty: another key of the name may be in use)
                path.parent.rmdir()
        return removed

    @staticmethod
    def launcher_environment() -> dict[str, str]:
        """The launcher's environment: the operator's settings only. It runs on the host with every capability, so
        nothing in it may name a path a tenant can write: no HOME, no XDG_*, no cache (a Python finds code to run
        under HOME: the user site's ``.pth`` files). The worker's own is in its spec; the launcher's child sets it
        at the exec, inside the sandbox."""
        env = {k: v for k, v in os.environ.items() if k in ENV_KEEP or k.startswith(ENV_PREFIXES)}
        env.setdefault("PATH", "/usr/local/bin:/usr/bin:/bin")
        env["PYTHONNOUSERSITE"] = "1"  # (besides -s: any Python started from here skips the user site too)
        return env

    @classmethod
    def zygote_environment(cls) -> dict[str, str]:
        """The workers' zygote's (and so every launcher's it forks): the launcher's, with what the worker's code
        reads as it is imported set as a worker has it (pyopencl reads PYOPENCL_NO_CACHE then; nothing reads a
        tenant's cache paths then, which each worker gets at its start), and the BLAS thread pools held to one
        thread: NumPy's import would otherwise start one thread per core, and a launcher forked from a
        multithreaded process could not unshare its user namespace."""
        return {**cls.launcher_environment(), **_seccomp.LOCK_FREE_ENV, **WORKER_USER_ENV, **ONE_THREAD_ENV}

    def environment(self, cache: Path | None) -> dict[str, str]:
        """The worker's environment: the launcher's, with HOME and every compile cache in the tenant's cache."""
        return {**self.launcher_environment(), **_cache_environment(cache)}

    def spec(self, cache: Path | None, keep_fds: list[int], cgroup: Path | None,
             memory: WorkerMemory | None = None, uid: int | None = None) -> dict[str, Any]:
        """The launcher's instructions: what to bind, what to limit (``memory``: the worker's ``worker_memory``, by
        default that of no tenant; ``uid``: the host uid it runs as, one of ``uids``, or None: as the broker)."""
        memory_max, shared, reserved = memory if memory is not None else self.worker_memory(None)
        ro = [*SYSTEM_RO, *self._python_paths]
        dev = list(DEVICES)
        if self.backend in ("cuda", "auto"):
            ro += [*CUDA_RO, *(p for p in (os.environ.get("CUDA_PATH"), os.environ.get("CUDA_HOME")) if p)]
            dev += [*CUDA_DEVICES, *(f"/dev/{n}" for n in _listdir("/dev") if n[6:].isdigit()
                                      and n.startswith("nvidia"))]
        ro += [p for p in os.environ.get("LD_LIBRARY_PATH", "").split(":") if p.startswith("/")]
        # No file the worker writes (its cache, /tmp, /dev/shm, a memfd the front passed it) grows past the larger
        # of its tmpfs: EFBIG (the worker, a Python, ignores SIGXFSZ).
        rlimits = {"core": 0, "nofile": NOFILE, "fsize": max(self.cache_max, self.tmp_max), "stack": STACK_MAX,
                   # No priority over the host or another worker, whatever the broker inherited (a login's
                   # limits.conf, a unit's LimitRTPRIO=/LimitNICE=): without them no SCHED_FIFO or SCHED_RR, no nice
                   # below 0 for its threads or its autogroup, which need no capability within these limits.
                   "rtprio": 0, "nice": 0}
        pids_cgroup = cgroup is not None and self.cgroups is not None and "pids" in self.cgroups.controllers
        if self.pids_max and not pids_cgroup:
            # Counted per user namespace (Linux >= 5.14): this worker's processes and threads only.
            rlimits["nproc"] = self.pids_max + 1
        spawn = self.backend == "opencl"
        if cgroup is None and memory_max:
            # The tmpfs are counted inside the budget: what they may hold is taken off the mappings' limits, and
            # so is, on OpenCL, the memory of the one linker PoCL may run at a time (_spawn.py: its own rlimits).
            mapped = (memory_max - (self.cache_max if cache is not None else 0) - self.tmp_max
                      - (LINKER_MEMORY if spawn else 0))
            # Private writable memory (heap, stacks, anonymous mappings): not the PROT_NONE ranges CUDA reserves,
            # so it holds on both backends. Nor the side channel's segments (shared mappings): the part of the
            # budget set apart for them is not the private memory's.
            rlimits["data"] = mapped - shared
            if self.backend == "opencl":
                # (CUDA reserves huge virtual ranges: no address-space limit there)
                rlimits["as"] = mapped + reserved
        return {"ro": _existing(ro), "rw": [str(cache)] if cache is not None else [], "dev": _existing(dev),
                # (only what the worker's environment adds to the launcher's: the rest is the operator's, and a
                # command line is anyone's to read)
                "keep_fds": keep_fds, "worker_uid": uid,
                # No new socket once the device is open (not before: CUDA's initialization makes a Unix socket),
                # and no file lock: nothing it runs may need one then (pyopencl's caches would).
                "env": {**_cache_environment(cache), **WORKER_USER_ENV, _seccomp.SEAL_ENV: "1",
                        **_seccomp.LOCK_FREE_ENV,
                        **({_landlock.EXEC_ENV: "linker" if spawn else "none"} if self.landlock else {})},
                "rlimits": rlimits, "seccomp": True, "tmp_size": self.tmp_max,
                # PoCL links each new kernel with the system linker (posix_spawn): no other backend spawns, and
                # there the launcher supervises every exec (_spawn.py).
                "spawn": spawn,
                "cache": {"path": str(cache), "size": self.cache_max} if cache is not None else None,
                "cgroup": str(cgroup) if cgroup is not None else ""}

    def prepare(self, tenant: str, device: int, worker_argv: list[str], keep_fds: list[int]) -> Launch:
        """The launch of one worker: sandboxed, or (sandbox off) the plain worker with its own cache."""
        cache = self.tenant_cache(tenant)
        env = self.environment(cache)
        if not self.enabled:
            return Launch(worker_argv, {**os.environ, **env}, cache=cache)
        memory = self.worker_memory(tenant, device)
        cgroup = None
        if self.cgroups is not None:
            try:
                cgroup = self.cgroups.create(tenant, device, memory.total)
            except OSError as exc:  # (a cgroup that cannot be made costs this worker its cgroup, not its start)
                log.warning("no cgroup for tenant %s's worker on device %d, rlimits only: %s", tenant, device, exc)
        launch = Launch([], self.launcher_environment(), cgroup, cache, memory.total)
        if self.uids is not None:
            # (the last step that may fail: nothing after it leaves the uid taken)
            launch.uid = self.uids.take(tenant)
            try:
                launch.pidfd_report, launch.launcher_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            except OSError:
                self.uids.give(launch.uid)
                raise
        spec = self.spec(cache, keep_fds, cgroup, memory, launch.uid)
        if launch.launcher_end is not None:
            spec["report_fd"] = launch.launcher_end.fileno()
        launch.argv = self.launcher_argv(spec, worker_argv)
        return launch

    def free_uid(self, launch: Launch) -> None:
        """Once the launcher has exited: give the worker's host uid back as soon as no process of the worker is left.

        The launcher sent the worker's pidfd (before it let the worker go on to take the uid). The worker is the
        init of its PID namespace, and the kernel ends it only after every other process there is gone, so the
        pidfd turns readable exactly when the last process of the uid has ended. Without a pidfd, the launcher
        ended before it let the worker go on: no process ever ran as the uid. Waiting needs the running event
        loop (the worker, killed with its launcher, may take a moment to end)."""
        uid, launch.uid = launch.uid, None
        if uid is None or self.uids is None:
            return
        pidfd = _received_pidfd(launch.pidfd_report) if launch.pidfd_report is not None else None
        if pidfd is None:
            self.uids.give(uid)
            return
        if _exited(pidfd):
            os.close(pidfd)
            self.uids.give(uid)
            return
        loop = asyncio.get_running_loop()

        def gone() -> None:
            loop.remove_reader(pidfd)
            os.close(pidfd)
            assert self.uids is not None
            self.uids.give(uid)

        loop.add_reader(pidfd, gone)

    def release(self, launch: Launch) -> bool:
        """After the worker exited: remove its cgroup; whether the OOM killer ended it (blocking)."""
        if launch.cgroup is None or self.cgroups is None:
            return False
        return self.cgroups.release(launch.cgroup)

    @staticmethod
    def launcher_argv(spec: dict[str, Any], worker_argv: list[str]) -> list[str]:
        return [*python_argv(), "gpubroker.broker.sandbox", "--spec", json.dumps(spec), "--", *worker_argv]

    def check(self, timeout: float = 60.0) -> None:
        """Start a sandboxed Python that checks its own confinement; SandboxUnavailable if anything fails.

        With worker cgroups, the probe runs in one; should that be what fails, the workers get rlimits instead.
        """
        if not self.enabled:
            return
        if self.cgroups is not None:
            try:
                self._probe(self.cgroups.create("probe", 0, self.worker_memory(None).total), timeout)
            except (OSError, SandboxUnavailable) as exc:
                log.warning("worker cgroups do not work here (%s); trying rlimits only", exc)
                self.cgroups, self.cgroup_reason = None, f"worker cgroups failed: {exc}"
        if self.cgroups is None:
            self._probe(None, timeout)
        log.info("workers are sandboxed: %s (%s)", self.description,
                 self.cgroup_reason if self.cgroups is not None else f"rlimits only: {self.cgroup_reason}")
        if self.uids is not None:
            log.info("each worker runs as a host uid of its own, from worker_uids %d-%d", self.uids.first,
                     self.uids.last)
        if not self.landlock:
            log.warning("Landlock is not available here (it needs Linux >= 5.19 with the LSM enabled: see "
                        "/sys/kernel/security/lsm): workers may execute any program the sandbox shows%s",
                        "; on OpenCL each process a worker spawns still runs one at a time, within "
                        f"{LINKER_MEMORY >> 20} MiB" if self.backend == "opencl" else "")
        if self.pids_max and not self.pids_enforced:
            log.warning("worker_pids_max = %d is not enforced by the kernel: the broker runs as root, which the "
                        "kernel never holds to RLIMIT_NPROC, there is no pids cgroup, and worker_uids = 0 runs the "
                        "workers as root. The front kills a worker seen with more threads (it looks every 0.5 s: a "
                        "kernel may make thousands before), charged to its tenant", self.pids_max)

    def _probe(self, cgroup: Path | None, timeout: float) -> None:
        # As a worker runs: as a uid of the range (any one, the GPU's nodes must open for all), given back once the
        # launcher has ended of itself (after its child, the init of the probe's namespace); one it was killed
        # with at the timeout is never given back.
        uid = self.uids.take("(the sandbox probe)") if self.uids is not None else None
        try:
            argv = self.launcher_argv(self.spec(None, [], cgroup, uid=uid), [sys.executable, "-I", "-c", _PROBE])
            try:
                proc = subprocess.run(argv, env=self.launcher_environment(), capture_output=True, timeout=timeout,
                                      stdin=subprocess.DEVNULL, check=False)
            except subprocess.TimeoutExpired:
                raise SandboxUnavailable(_refusal(f"the sandbox probe did not finish within {timeout:g} s")) from None
            if uid is not None and self.uids is not None:
                self.uids.give(uid)
        finally:
            if cgroup is not None and self.cgroups is not None:
                self.cgroups.release(cgroup)
        out = proc.stdout.decode(errors="replace").strip()
        if proc.returncode != 0 or out != "ok":
            why = proc.stderr.decode(errors="replace").strip().splitlines()
            reason = why[-1] if why else out or f"the probe exited with status {proc.returncode}"
            if proc.returncode == EXIT_SETUP_FAILED:
                reason = reason.removeprefix("gpubroker sandbox: ")
            raise SandboxUnavailable(_refusal(reason))

    @functools.cached_property
    def _python_paths(self) -> list[str]:
        """The runtime's and the packages' directories: the same for every worker, so found once."""
        paths = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix,
                 os.path.dirname(os.path.realpath(sys.executable))}
        # Every import directory but the script's own (sys.path[0]: the front's working directory or bin/),
        # unless the operator named it in PYTHONPATH.
        named = set(os.environ.get("PYTHONPATH", "").split(":"))
        paths.update(p for i, p in enumerate(sys.path) if p and (i > 0 or p in named))
        for name in PACKAGES:
            spec = importlib.util.find_spec(name)
            if spec is not None and spec.submodule_search_locations:
                paths.update(spec.submodule_search_locations)
        return sorted(p for p in paths if os.path.isabs(p))


# Run inside the sandbox by check(): prints "ok" only when every layer is in force.
_PROBE = """
import os, socket
status = dict(line.split(":", 1) for line in open("/proc/self/status"))
assert status["Seccomp"].strip() == "2", "no seccomp filter"
assert status["NoNewPrivs"].strip() == "1", "no_new_privs is not set"
assert int(status["CapEff"], 16) == 0 and int(status["CapBnd"], 16) == 0, "capabilities remain"
assert os.getpid() == 1, "not in a PID namespace of its own"
try:
    socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    raise AssertionError("an AF_INET socket could be opened")
except PermissionError:
    pass
try:
    os.memfd_create("probe")
    raise AssertionError("memfd_create is allowed")
except PermissionError:
    pass
# The GPU's device nodes, as the worker's user (a root broker's workers run as uids of worker_uids): refused here,
# every worker's start would fail instead, charged to the device.
for name in sorted(os.listdir("/dev")):
    if name in ("nvidiactl", "nvidia-uvm") or (name.startswith("nvidia") and name[6:].isdigit()):
        try:
            os.close(os.open("/dev/" + name, os.O_RDWR))
        except OSError as exc:
            raise AssertionError(f"the worker's user (uid {os.getuid()} in its namespace) cannot open /dev/{name} "
                                 f"({exc.strerror}): give it access (mode 0666, as the driver makes them) or set "
                                 "worker_uids = '0'") from None
print("ok")
"""


def _received_pidfd(report: socket.socket) -> int | None:
    """The pidfd the launcher sent on ``report`` (which is closed), or None if it sent none before it ended."""
    with report:
        report.setblocking(False)
        try:
            _, fds, _, _ = socket.recv_fds(report, 1, 1)
        except (BlockingIOError, OSError):
            return None
    return fds[0] if fds else None


def _exited(pidfd: int) -> bool:
    poll = select.poll()
    poll.register(pidfd, select.POLLIN)
    return bool(poll.poll(0))


def _refusal(reason: str) -> str:
    return (f"cannot sandbox the workers: {reason}. Fix that, or run them unsandboxed (every tenant can then "
            "reach the broker and the other tenants) with `sandbox = false` in [broker] or `gpubroker serve "
            "--no-sandbox`")


# A user name for getpass.getuser(), which asks the password database when these are unset: the worker's uid has
# no entry on most hosts (PyTorch's compile caches ask for it, and raised KeyError in a CUDA worker).
WORKER_USER_ENV: Final = {"USER": "gpubroker-worker", "LOGNAME": "gpubroker-worker"}
# BLAS and OpenMP thread pools of one thread: the zygote's imports start none (workers/_zygote.py). A worker computes
# on its device; its host-side NumPy work is small.
ONE_THREAD_ENV: Final = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def _cache_environment(cache: Path | None) -> dict[str, str]:
    """HOME and every compile cache in the tenant's cache: the worker's alone, never the launcher's."""
    if cache is None:
        return {}
    return {"HOME": str(cache), "XDG_CACHE_HOME": str(cache), "POCL_CACHE_DIR": str(cache / "pocl"),
            "CUPY_CACHE_DIR": str(cache / "cupy"), "CUDA_CACHE_PATH": str(cache / "nv")}


def _existing(paths: list[str]) -> list[str]:
    seen: list[str] = []
    for p in paths:
        if p not in seen and os.path.lexists(p):
            seen.append(p)
    return seen


def _remove(path: Path) -> None:
    """A cache directory and all in it; a symbolic link a tenant left there is removed, never followed."""
    if path.is_symlink() or not path.is_dir():
        with contextlib.suppress(OSError):
            path.unlink()
        return
    failures: list[str] = []
    shutil.rmtree(path, onerror=lambda _f, name, _e: failures.append(name))
    if not failures:
        return
    # The worker runs as this user: a tenant may have taken the permissions off directories of its own cache.
    # Give them back (top down: each directory before its contents are listed) and try once more.
    with contextlib.suppress(OSError):
        os.chmod(path, 0o700)
    for top, dirs, _ in os.walk(path):
        for d in dirs:
            with contextlib.suppress(OSError):
                os.chmod(os.path.join(top, d), 0o700, follow_symlinks=False)
    shutil.rmtree(path, onerror=lambda _f, name, exc: log.warning(
        "could not remove %s of a stale compile cache: %s", name, exc[1]))


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []
