"""Kernel memory a tenant's kernel could hold outside every limit of its worker: Landlock rules, seccomp filters and
POSIX record locks (issue 21, round 9).

The worker's seccomp filter refuses epoll, inotify, memfd, System V IPC, vmsplice and the rest because what they hold
is kernel memory that neither RLIMIT_AS nor RLIMIT_DATA counts (without a delegated memory cgroup, as here, the
worker's rlimits are its only memory bound). Two more such objects passed the filter, each with no count at all:

- Landlock rulesets (``landlock_create_ruleset`` / ``landlock_add_rule``: nothing needs privileges for them). A
  ruleset that handles LANDLOCK_ACCESS_NET_BIND_TCP takes one rule per TCP port: 65,536 rules of ``kmalloc-cg-64``
  (3.5 MiB of unreclaimable slab) per descriptor, in about 0.1 s; 4,096 descriptors hold ~14 GiB. Measured before
  the fix: 28 rulesets (1,835,008 rules) held 121 MiB.
- seccomp filters (``seccomp(SECCOMP_SET_MODE_FILTER)``: the worker runs with no_new_privs, all an unprivileged filter
  needs). Each thread may stack ~3,600 one-instruction filters, ~28 MiB of vmalloc and slab per thread in 0.4 s;
  with ``worker_pids_max`` = 512 threads, ~14 GiB. Measured before the fix: 7,228 filters on two threads, 44 MiB.
  ``prctl(1 << 32 | PR_SET_SECCOMP)`` stacked them past the first fix (its rule compared all 64 bits of an int).
- POSIX record locks (``fcntl(F_SETLK)`` with F_RDLCK on disjoint one-byte ranges of files in the worker's own
  /tmp): one ``file_lock_cache`` object (192 bytes) per range, unbounded per descriptor (Linux does not enforce
  RLIMIT_LOCKS). Measured before the fix: 512,000 locks held 96 MiB, taken in about 3 s.

The fix: once the device is open the worker's last filter (``seal_after_device_open``) refuses landlock_* and
seccomp(2) and prctl(PR_SET_SECCOMP) with EPERM: the launcher applied its Landlock ruleset and the worker loaded its
filters before; and fcntl's lock commands (F_SETLK, F_SETLKW, F_OFD_SETLK, F_OFD_SETLKW) and flock(2) with ENOLCK.
Nothing of the worker locks a file after that: PoCL's cache does not, and pyopencl's sqlite caches are off in a
sealed worker (PYOPENCL_NO_CACHE).
"""

from __future__ import annotations

import errno
import fcntl
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from gpubroker.broker.launcher import BrokerProcess, TenantSpec
from gpubroker.client import Module, ModuleFormat, RemoteGpu, connect

from .exploits import SYSCALL_SOURCE, check_arch

ALLOWED = 32 << 20  # what a worker's kernel objects outside its limits may take of the host's kernel memory
RULESETS = 28  # x 65,536 port rules x 64 B: ~112 MiB
PR_SET_SECCOMP = 22
LOCK_FILES, LOCKS_PER_FILE = 1600, 320  # 512,000 locks x 192 B: ~94 MiB

SOURCE = SYSCALL_SOURCE + r"""
/* Rulesets that handle bind(2) on TCP, each with a rule for every port. */
__kernel void gpb_landlock(__global long* scratch, const long rulesets, __global long* res) {
    scratch[0] = 0; scratch[1] = 1;                    /* landlock_ruleset_attr: fs 0, net BIND_TCP */
    long made = 0, rules = 0, err = 0;
    for (long r = 0; r < rulesets && !err; ++r) {
        long fd = sys6(444, (long)scratch, 16, 0, 0, 0, 0);          /* landlock_create_ruleset */
        if (fd < 0) { err = fd; break; }
        res[8 + made++] = fd;
        for (long port = 0; port < 65536; ++port) {
            scratch[4] = 1; scratch[5] = port;                       /* landlock_net_port_attr */
            long rc = sys6(445, fd, 2, (long)(scratch + 4), 0, 0, 0); /* landlock_add_rule(NET_PORT) */
            if (rc < 0) { err = rc; break; }
            rules++;
        }
    }
    res[0] = made; res[1] = rules; res[2] = err;
}

/* Files of its own /tmp, each read-locked with fcntl(cmd) in many disjoint one-byte ranges (descending: no merge);
   then flock on the first. */
__kernel void gpb_locks(__global long* scratch, const long files, const long per_file, const long cmd,
                        __global long* res) {
    __global char* name = (__global char*)(scratch + 64);
    long made = 0, locks = 0, err = 0, first = -1;
    for (long f = 0; f < files && !err; ++f) {
        /* "/tmp/gpblk-NNNNN" */
        const char stem[] = "/tmp/gpblk-";
        int n = 0;
        for (; stem[n]; ++n) name[n] = stem[n];
        long v = f;
        for (int d = 4; d >= 0; --d) { name[n + d] = '0' + (char)(v % 10); v /= 10; }
        name[n + 5] = 0;
        long fd = sys6(257, -100, (long)name, 0102 | 02000000, 0600, 0, 0);  /* openat(O_RDWR|O_CREAT|O_CLOEXEC) */
        if (fd < 0) { err = fd; break; }
        if (first < 0) first = fd;
        res[8 + made++] = fd;
        __global short* fl = (__global short*)scratch;             /* struct flock */
        for (long i = per_file; i > 0; --i) {
            fl[0] = 0; fl[1] = 0;                                   /* l_type F_RDLCK, l_whence SEEK_SET */
            scratch[1] = 2 * i; scratch[2] = 1; scratch[3] = 0;     /* l_start, l_len, l_pid */
            long rc = sys6(72, fd, cmd, (long)scratch, 0, 0, 0);    /* fcntl(cmd: F_SETLK, ...) */
            if (rc < 0) { err = rc; break; }
            locks++;
        }
    }
    res[0] = made; res[1] = locks; res[2] = err; res[3] = first;
    res[4] = first < 0 ? 0 : sys6(73, first, 1, 0, 0, 0, 0);        /* flock(LOCK_SH) */
}

/* prctl(option, SECCOMP_MODE_FILTER, one "allow" instruction): option PR_SET_SECCOMP, with or without high bits. */
__kernel void gpb_prctl_seccomp(__global long* scratch, const long option, __global long* res) {
    __global uint* insn = (__global uint*)(scratch + 8);
    insn[0] = 0x06; insn[1] = 0x7fff0000;                   /* BPF_RET | BPF_K, SECCOMP_RET_ALLOW */
    scratch[16] = 1; scratch[17] = (long)insn;              /* sock_fprog: len 1, filter */
    res[0] = sys6(157, option, 2, (long)(scratch + 16), 0, 0, 0);
}

/* Each work-item (a PoCL thread of its own) stacks one-instruction "allow" seccomp filters on its own thread until
   the kernel refuses (the chain's instruction budget: a few thousand filters, each at least a page of vmalloc). */
__kernel void gpb_seccomp(__global long* scratch, __global long* res) {
    __global uint* insn = (__global uint*)(scratch + 8);
    insn[0] = 0x06; insn[1] = 0x7fff0000;                   /* BPF_RET | BPF_K, SECCOMP_RET_ALLOW */
    __global long* prog = scratch + 16 + 2 * get_global_id(0);
    prog[0] = 1; prog[1] = (long)insn;                      /* sock_fprog: len 1, filter */
    long n = 0, err = 0;
    for (;;) {
        long rc = sys6(317, 1, 0, (long)prog, 0, 0, 0);      /* seccomp(SECCOMP_SET_MODE_FILTER) */
        if (rc < 0) { err = rc; break; }
        n++;
    }
    res[2 * get_global_id(0)] = n; res[2 * get_global_id(0) + 1] = err;
}

/* Close the n descriptors listed from res[8] on (never one of the worker's own). */
__kernel void gpb_close(__global const long* res, const long n) {
    for (long i = 0; i < n; ++i) sys6(3, res[8 + i], 0, 0, 0, 0, 0);
}
"""


def meminfo(*keys: str) -> int:
    """The sum of these /proc/meminfo fields, in bytes."""
    fields = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
    return sum(int(fields[k].split()[0]) * 1024 for k in keys)


def unreclaimable_slab() -> int:
    """The host's SUnreclaim (bytes): kernel memory no reclaim gives back."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("SUnreclaim:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no SUnreclaim in /proc/meminfo")


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerProcess]:
    check_arch()
    tmp = tmp_path_factory.mktemp("kobjects")
    with BrokerProcess([TenantSpec("mallory")], backend="opencl",
                       settings={"cache_dir": str(tmp / "caches")}) as proc:
        yield proc


def test_landlock_rules_are_bounded(broker: BrokerProcess) -> None:
    with connect(broker.target, token=broker.tokens["mallory"], timeout=120) as gpu:
        module = gpu.load_module(SOURCE, ModuleFormat.OPENCL_C)
        attack, close = gpu.get_kernel(module, "gpb_landlock"), gpu.get_kernel(module, "gpb_close")
        scratch, res = gpu.allocate_memory(4096), gpu.allocate_memory(8 * (8 + RULESETS))
        before = unreclaimable_slab()
        gpu.execute_kernel(attack, 1, 1, [scratch, np.int64(RULESETS), res])
        gpu.synchronize()
        held = unreclaimable_slab() - before  # (the worker still holds every ruleset's descriptor)
        out = np.empty(8 + RULESETS, dtype=np.int64)
        gpu.copy_d2h(res, out)
        made, rules, err = int(out[0]), int(out[1]), int(out[2])
        if made:
            gpu.execute_kernel(close, 1, 1, [res, np.int64(made)])
            gpu.synchronize()
    print(f"\nthe worker made {made} Landlock rulesets with {rules} rules (last error {err}); the host's "
          f"unreclaimable slab grew by {held >> 20} MiB meanwhile")
    assert made == 0 and err == -1, f"landlock_create_ruleset in a worker answered {err}, not EPERM"
    assert held < ALLOWED, (f"a tenant's kernel held {held >> 20} MiB of host kernel memory in {rules} Landlock rules "
                            f"({made} rulesets) that no limit of its worker counts")


def take_locks(gpu: RemoteGpu, module: Module, files: int, per_file: int, cmd: int) -> tuple[int, int, int, int, int]:
    """Run gpb_locks, close its files (and so drop every lock); (files, locks, last error, flock's result, the
    growth of the host's unreclaimable slab while the locks were held)."""
    attack, close = gpu.get_kernel(module, "gpb_locks"), gpu.get_kernel(module, "gpb_close")
    scratch, res = gpu.allocate_memory(4096), gpu.allocate_memory(8 * (8 + files))
    before = unreclaimable_slab()
    gpu.execute_kernel(attack, 1, 1, [scratch, np.int64(files), np.int64(per_file), np.int64(cmd), res])
    gpu.synchronize()
    held = unreclaimable_slab() - before
    out = np.empty(8, dtype=np.int64)
    gpu.copy_d2h(res, out)
    made, locks, err, flock = int(out[0]), int(out[1]), int(out[2]), int(out[4])
    if made:
        gpu.execute_kernel(close, 1, 1, [res, np.int64(made)])
        gpu.synchronize()
    gpu.free_memory(scratch)
    gpu.free_memory(res)
    return made, locks, err, flock, held


def test_posix_record_locks_are_bounded(broker: BrokerProcess) -> None:
    with connect(broker.target, token=broker.tokens["mallory"], timeout=120) as gpu:
        module = gpu.load_module(SOURCE, ModuleFormat.OPENCL_C)
        files, locks, err, flock, held = take_locks(gpu, module, LOCK_FILES, LOCKS_PER_FILE, fcntl.F_SETLK)
    print(f"\nthe worker took {locks} record locks on {files} files (last error {err}, flock {flock}); the host's "
          f"unreclaimable slab grew by {held >> 20} MiB meanwhile")
    assert locks == 0 and err == -errno.ENOLCK, f"fcntl(F_SETLK) in a worker answered {err}, not ENOLCK"
    assert held < ALLOWED, (f"a tenant's kernel held {held >> 20} MiB of host kernel memory in {locks} POSIX record "
                            "locks that no limit of its worker counts")


def test_every_lock_command_is_refused(broker: BrokerProcess) -> None:
    # (fcntl's cmd is an int: the kernel reads the low half of its register, which the filter must match alone)
    commands = [fcntl.F_SETLK, fcntl.F_SETLKW, fcntl.F_OFD_SETLK, fcntl.F_OFD_SETLKW]
    answers = {}
    with connect(broker.target, token=broker.tokens["mallory"], timeout=120) as gpu:
        module = gpu.load_module(SOURCE, ModuleFormat.OPENCL_C)
        for cmd in [*commands, *(1 << 32 | c for c in commands)]:
            files, locks, err, flock, _ = take_locks(gpu, module, 1, 4, cmd)
            answers[hex(cmd)] = (files, locks, err, flock)
    print(f"\n(files, locks, fcntl's last error, flock's) by command: {answers}")
    taken = {cmd: a for cmd, a in answers.items() if a[0] != 1 or a[1:] != (0, -errno.ENOLCK, -errno.ENOLCK)}
    assert not taken, f"a worker's kernel took file locks (files, locks, fcntl's error, flock's): {taken}"


def test_seccomp_filters_through_prctl_are_refused(broker: BrokerProcess) -> None:
    with connect(broker.target, token=broker.tokens["mallory"], timeout=120) as gpu:
        attack = gpu.get_kernel(gpu.load_module(SOURCE, ModuleFormat.OPENCL_C), "gpb_prctl_seccomp")
        scratch, res = gpu.allocate_memory(4096), gpu.allocate_memory(8)
        answers = {}
        for option in (PR_SET_SECCOMP, 1 << 32 | PR_SET_SECCOMP):
            gpu.execute_kernel(attack, 1, 1, [scratch, np.int64(option), res])
            gpu.synchronize()
            out = np.empty(1, dtype=np.int64)
            gpu.copy_d2h(res, out)
            answers[hex(option)] = int(out[0])
    print(f"\nprctl(option, SECCOMP_MODE_FILTER) answered {answers}")
    assert all(rc == -errno.EPERM for rc in answers.values()), f"prctl stacked a seccomp filter: {answers}"


def test_seccomp_filters_are_bounded(broker: BrokerProcess) -> None:
    # (last in the module: the attacker's PoCL threads keep thousands of filters, which slow its every system call)
    with connect(broker.target, token=broker.tokens["mallory"], timeout=120) as gpu:
        attack = gpu.get_kernel(gpu.load_module(SOURCE, ModuleFormat.OPENCL_C), "gpb_seccomp")
        scratch, res = gpu.allocate_memory(4096), gpu.allocate_memory(64)
        before = meminfo("VmallocUsed", "SUnreclaim")
        gpu.execute_kernel(attack, 2, 1, [scratch, res])
        gpu.synchronize()
        held = meminfo("VmallocUsed", "SUnreclaim") - before
        out = np.empty(8, dtype=np.int64)
        gpu.copy_d2h(res, out)
    filters = int(out[0] + out[2])
    print(f"\nthe worker's kernel stacked {filters} seccomp filters on two threads ({out[0]}, {out[2]}; errors "
          f"{out[1]}, {out[3]}); the host's vmalloc and unreclaimable slab grew by {held >> 20} MiB meanwhile")
    assert filters == 0 and out[1] == out[3] == -1, f"seccomp(2) in a worker answered {out[1]}, {out[3]}, not EPERM"
    assert held < ALLOWED, (f"a tenant's kernel held {held >> 20} MiB of host kernel memory in {filters} seccomp "
                            "filters that no limit of its worker counts")
