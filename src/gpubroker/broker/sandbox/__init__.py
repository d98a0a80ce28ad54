"""The worker sandbox: every tenant's worker runs confined, on every backend, unless ``sandbox = false``.

Threat model: a tenant runs arbitrary native code inside its own worker (by design on PoCL, whose OpenCL C
accepts inline asm and integer-to-pointer casts; assume it on CUDA too). Each layer below assumes the ones before
it have been beaten, and says what it stops.

- **Launcher** (``python -s -P -m gpubroker.broker.sandbox``, spawned by the front with vfork+exec in a session of
  its own, or forked by the workers' zygote, ``broker/zygote``, which has the worker's code loaded already): a
  single-threaded process that unshares the namespaces, forks the worker as PID 1 of the new PID namespace and
  waits, mirroring the worker's exit (same status, or death by the same signal) so the front's crash accounting is
  unchanged. Forked by the zygote, its child runs the worker in its own process once every layer below is in place,
  rather than exec'ing a new interpreter. Both die with their parent (``PR_SET_PDEATHSIG``). It runs on the host
  with the broker's capabilities, so nothing it reads may be the tenant's: its environment is the operator's alone
  (no HOME, no cache: a Python runs the ``.pth`` files under ``$HOME/.local``; ``-s`` skips them besides), and the
  worker's environment is set only at the worker's exec, inside the sandbox. The worker starts with ``-s -P`` too
  and leads a session of its own (``setsid``): "its process group" is never the front's or another worker's.
- **User namespace** (the broker's uid mapped to itself, setgroups denied): the worker holds capabilities only
  over its own namespaces, and drops even those (below). A root broker's worker runs as a host uid of its own
  from ``worker_uids`` (a helper the launcher forks before it unshares writes the map ``0 0`` for the setup,
  ``1 <uid>`` for the worker, which switches to 1 before it drops its capabilities): the kernel never holds the
  host's root to RLIMIT_NPROC, so only as another user is a worker held to ``worker_pids_max`` without a pids
  cgroup; and it counts pipe buffers and descriptors in flight per host uid, so a uid shared by two workers would
  let one take them from the other. The front takes the uid at the start and gives it back once the worker's
  pidfd, which the launcher hands it before it lets the worker go on, says that the worker (its PID namespace's
  init, which the kernel ends only after every other process there) has ended.
- **PID namespace + a fresh /proc**: no other process is visible: not the front (whose memory holds every
  tenant's token), not another tenant's worker (``/proc/<pid>/mem``), not their environments.
- **Mount namespace, pivot_root into a tmpfs root**: the worker sees only, read-only, the Python runtime, its
  import paths, the gpubroker packages, ``/usr``, ``/lib*``, ``/etc/ld.so.cache`` and CPU topology in ``/sys``;
  ``/dev/null|zero|full|random|urandom``; on CUDA the NVIDIA device nodes, ``/usr/local/{cuda,nvidia}`` and
  ``/sys``; ``/tmp`` and ``/dev/shm``, two directories of one private tmpfs of ``worker_tmp_max_bytes``; and
  read-write only its tenant's own compile cache (``<cache_dir>/tenants/<tenant>/<key>``, mode 0700, the key
  derived from its token: a tenant removed and added again under its name never finds its predecessor's cache,
  which the broker deletes at the removal, as it does a rotated token's once no worker uses it), itself a tmpfs of
  ``cache_max_bytes`` that the launcher seeds from the disk and saves back, bounded, after the worker exits
  (``_cache.py``): the worker never writes the host's disk. The broker's config, TLS keys, state, sockets,
  ``/etc/passwd`` and other
  tenants' caches do not exist there, so neither a kernel nor an ``#include "/path"`` in kernel source (PoCL,
  NVRTC: the compilers run in the worker) can read them.
- **Network, IPC and UTS namespaces**: no network interface but a down loopback, no System V IPC or abstract
  Unix sockets shared with the host (so the broker's sockets cannot be reached either).
- **Privileges**: every capability dropped (bounding, inheritable, ambient, permitted, effective) with the
  securebits locked (an exec as the namespace's root regains none), ``no_new_privs``, not dumpable.
- **seccomp** (libseccomp through pyseccomp; EPERM): ptrace, ``process_vm_*``, signals to any process but itself
  (pid 1: not 0, its group, nor -1), priorities of a process group or a user (only PRIO_PROCESS), another pid's
  rlimits,
  mount and pivot_root and the new mount API, namespace changes (unshare, setns, clone with CLONE_NEW*; clone3
  gets ENOSYS so glibc falls back to clone), bpf, keyctl, perf_event_open, userfaultfd, io_uring, module and
  kexec calls, personality changes, mknod of any node but a regular file (a FIFO could keep a compile waiting
  on the tenant's own code), sockets but AF_UNIX, and once the device is open, new sockets of any family,
  Landlock rulesets, seccomp filters, on OpenCL shared anonymous and grows-down mappings, and record locks and flock
  (ENOLCK; ``seal_after_device_open``). Other
  syscall ABIs (x86 ``int 0x80``) kill it.
  No new processes: fork, vfork and clone without CLONE_THREAD (only threads; on OpenCL also posix_spawn's
  clone(CLONE_VM | CLONE_VFORK), with which PoCL 3.0 starts the system linker for each new kernel). No memory
  outside the limits below: memfd_create, memfd_secret, System V shared memory, message queues and semaphores.
  Nothing counted per host user rather than per worker: inotify, POSIX message queues, epoll instances (the
  worker waits with poll(2)).
- **Exec supervision** (OpenCL, ``_spawn.py``): a second filter stops every exec and posix_spawn-shaped clone of the
  worker's tree until the launcher answers: the worker alone spawns, a spawned process runs only once the previous
  one has exited, under RLIMIT_DATA and RLIMIT_AS of ``LINKER_MEMORY`` (taken out of the worker's own), so its
  fresh address space cannot multiply the worker's memory.
- **Landlock** (``_landlock.py``, Linux >= 5.19; without it the broker warns and the status lacks ``+landlock``):
  the worker and all it starts may execute only PoCL's linker and its interpreter (OpenCL) or nothing (CUDA).
- **Resource limits**: a cgroup v2 per worker (``memory.max`` = ``worker_memory_max``, ``pids.max``,
  ``cpu.weight``) where the broker has a delegated cgroup to itself (systemd ``Delegate=yes``), which is charged
  for its tmpfs pages too; otherwise rlimits: processes and threads per user namespace (``RLIMIT_NPROC``, which
  binds a root broker's workers only as uids of ``worker_uids``, the default), ``RLIMIT_DATA`` (private writable
  memory, both backends: CUDA's PROT_NONE reservations do not count) and on OpenCL ``RLIMIT_AS``, each the
  worker's memory less the tmpfs sizes, so the tmpfs are counted inside it. The worker's memory is
  ``worker_memory_max`` where the operator set it, else (0, the default) its tenant's: the memory quota on its
  device plus its shared memory (which RLIMIT_DATA leaves out: shared mappings are not private memory) plus the
  runtime's own and the tmpfs (``automatic_memory_max``); RLIMIT_AS allows besides what PoCL reserves.
  Always: no core dumps, bounded descriptors, ``RLIMIT_FSIZE`` (the larger tmpfs size: EFBIG past it, which also
  bounds a memfd the front passed), ``RLIMIT_STACK`` of 8 MiB, soft and hard (a stack grows outside RLIMIT_DATA).
  Shared anonymous and grows-down mappings, which RLIMIT_DATA does not count either, are refused by the filter
  once the device is open on OpenCL (CUDA's runtime maps the first itself), and there is no ``/dev/zero`` to map
  shared. A worker the OOM killer ends is its tenant's failure.
- **Environment and descriptors**: only PATH, locale, PYTHONPATH, LD_LIBRARY_PATH, the log format, CUDA's device
  selection and the operator's ``POCL_*``/``CUPY_*`` settings pass; HOME and every compile cache point into the
  tenant's cache. The worker inherits only stdio and its two channels to the front.

The front itself is not dumpable either (``PR_SET_DUMPABLE 0`` at ``serve``), so even a same-uid process outside
the sandbox cannot ptrace it or read its memory. With ``sandbox = false`` (``--no-sandbox``) none of this applies
(each tenant still gets its own cache directory) and the broker logs a warning at every start. ``gpubroker
status`` and ``gpubroker devices`` show the layers in force, e.g. ``namespaces+seccomp+cgroup``.

Check on a host: ``grep -E 'Seccomp|NoNewPrivs|CapEff' /proc/<worker pid>/status`` (2, 1, 0) and
``ls -l /proc/<worker pid>/ns`` against the broker's; the worker is the child of the
``gpubroker.broker.sandbox`` launcher that is the broker's child.
"""

from __future__ import annotations

from typing import Any

__all__ = ["EXEC_ENV", "EXIT_SETUP_FAILED", "SEAL_ENV", "Launch", "SandboxUnavailable", "WorkerCgroups",
           "WorkerSandbox", "WorkerUidsExhausted", "automatic_memory_max", "automatic_reserved", "cache_key",
           "confine_exec", "default_cache_dir", "linker_files", "python_argv", "run_launcher", "seal_after_device_open",
           "set_command_line", "set_dumpable"]


def set_dumpable(dumpable: bool) -> None:
    """``PR_SET_DUMPABLE`` on this process: off, no same-uid process may ptrace it or read its /proc files."""
    from gpubroker.broker.sandbox._launch import PR_SET_DUMPABLE, _libc

    _libc.prctl(PR_SET_DUMPABLE, int(dumpable), 0, 0, 0)


def __getattr__(name: str) -> Any:
    # Imported on first use: the launcher (``python -m gpubroker.broker.sandbox``) loads this package on every
    # worker start and needs none of the front's side.
    if name in ("Launch", "SandboxUnavailable", "WorkerSandbox", "WorkerUidsExhausted", "automatic_memory_max",
                "automatic_reserved", "cache_key", "default_cache_dir", "python_argv"):
        from gpubroker.broker.sandbox import _policy

        return getattr(_policy, name)
    if name == "EXIT_SETUP_FAILED":
        from gpubroker.broker.sandbox._launch import EXIT_SETUP_FAILED

        return EXIT_SETUP_FAILED
    if name in ("run_launcher", "set_command_line"):  # the zygote's forked launchers (broker/zygote)
        from gpubroker.broker.sandbox import _launch

        return _launch.main if name == "run_launcher" else _launch.set_command_line
    if name in ("EXEC_ENV", "confine_exec", "linker_files"):  # the worker confines what it may execute
        from gpubroker.broker.sandbox import _landlock

        return getattr(_landlock, name)
    if name in ("SEAL_ENV", "seal_after_device_open"):  # the worker, once its device is open
        from gpubroker.broker.sandbox import _seccomp

        return getattr(_seccomp, name)
    if name == "WorkerCgroups":
        from gpubroker.broker.sandbox._cgroup import WorkerCgroups

        return WorkerCgroups
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
