"""A worker's host memory past its bound through mappings RLIMIT_DATA does not count (issue 21, round 6), on PoCL
without a cgroup.

Found by the attacker: without a memory cgroup a worker's memory is held by RLIMIT_DATA, which counts private
writable mappings only, and on OpenCL by RLIMIT_AS, which allows the address space PoCL reserves on top
(``automatic_reserved``: 512 MiB + 96 MiB a CPU) as if it could never be memory. A kernel's
``mmap(MAP_SHARED | MAP_ANONYMOUS | MAP_POPULATE)`` (shared anonymous memory: not private, so not data), a
``MAP_GROWSDOWN`` mapping (a stack, which the kernel counts apart from data), a writable ``MAP_SHARED`` mapping of
``/dev/zero`` (the same shared anonymous memory) and the main stack grown past an ``RLIMIT_STACK`` the worker
raises itself (its hard limit was unlimited) each populate real pages that RLIMIT_DATA leaves out. Measured on this
2-CPU machine with every default: a worker whose memory bound is 1,088 MiB (less its tmpfs and linker) held
695 MiB private and 704 MiB shared, 1,399 MiB resident, 311 MiB past it (on a 16-CPU host the slack is about
1 GiB). On CUDA, which has no RLIMIT_AS, nothing bounded them at all (a process under a 64 MiB RLIMIT_DATA
populated 512 MiB of each).

Now the filter refuses shared anonymous and grows-down mappings, the sandbox has no ``/dev/zero``, and the
worker's ``RLIMIT_STACK`` is fixed at 8 MiB: what a kernel populates stays within the worker's private memory
(RLIMIT_DATA) and the front's segments.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpubroker.broker.config import BrokerConfig
from gpubroker.broker.launcher import BrokerProcess, TenantSpec
from gpubroker.broker.sandbox import automatic_memory_max
from gpubroker.broker.sandbox._spawn import LINKER_MEMORY
from gpubroker.client import ModuleFormat, connect

from ..conftest import worker_pids
from . import exploits
from ._probes import assert_shared_memory_works
from .exploits import AT_FDCWD, ATTACK_SOURCE, O_RDWR, Attempt, Program, Result, check_arch, run

MiB = 1 << 20
QUOTA = 256 * MiB  # alice's memory quota; her shared memory defaults to it
CHUNK = 64 * MiB
PROT_READ_WRITE = 3
MAP_SHARED, MAP_PRIVATE, MAP_ANONYMOUS, MAP_GROWSDOWN, MAP_POPULATE = 0x01, 0x02, 0x20, 0x100, 0x8000
RLIMIT_STACK = 3
RLIM_INFINITY = (1 << 64) - 1
for _name, _nr in (("mmap", 9), ("munmap", 11), ("setrlimit", 160)):
    exploits.NR.setdefault(_name, _nr)

PATHS = {"private": MAP_PRIVATE | MAP_ANONYMOUS, "shared anonymous": MAP_SHARED | MAP_ANONYMOUS,
         "grows-down": MAP_PRIVATE | MAP_ANONYMOUS | MAP_GROWSDOWN, "/dev/zero shared": MAP_SHARED}


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerProcess]:
    check_arch()
    tmp = tmp_path_factory.mktemp("shared-mappings")
    # Every setting at its default but where the caches go: the automatic bound of test_default_worker_memory.py.
    with BrokerProcess([TenantSpec("alice", memory_quota=QUOTA)], backend="opencl",
                       settings={"cache_dir": str(tmp / "caches")}) as proc:
        yield proc


def _resident(pid: int) -> int:
    """The worker's own resident memory: anonymous and shared-memory pages (not its libraries' page cache)."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    return sum(int(fields[key].split()[0]) for key in ("RssAnon", "RssShmem")) * 1024


def _map_chunk(program: Program, label: str, flags: int) -> Attempt:
    """One populated CHUNK of the path's mapping, kept (no munmap): the next one adds to it."""
    a = program.attempt(label)
    if flags == MAP_SHARED:  # /dev/zero, opened writable (a shared writable mapping needs that)
        fd = program.call(a, "openat", AT_FDCWD, program.cstr("/dev/zero"), O_RDWR)
        program.call(a, "mmap", 0, CHUNK, PROT_READ_WRITE, MAP_SHARED | MAP_POPULATE, Result(fd.index), 0)
        program.call(a, "close", Result(fd.index), cleanup=True)
    else:
        program.call(a, "mmap", 0, CHUNK, PROT_READ_WRITE, flags | MAP_POPULATE, -1, 0)
    return a


def test_a_kernel_populates_no_memory_outside_the_workers_private_limit(broker: BrokerProcess) -> None:
    with contextlib.closing(connect(broker.target, token=broker.tokens["alice"], timeout=60)) as gpu:
        kernel = gpu.get_kernel(gpu.load_module(ATTACK_SOURCE, ModuleFormat.OPENCL_C), "gpb_attack")
        probe = Program()
        probe.getpid("getpid")
        run(gpu, kernel, probe)
        (pid,) = worker_pids(broker, "alice")
        defaults = BrokerConfig()
        # What the worker may hold besides its tmpfs (empty here) and the linker (not running): its private memory
        # and the segments its sessions may share (none here), its quota and the runtime's share.
        bound = (automatic_memory_max("opencl", QUOTA, QUOTA, defaults.cache_max_bytes, defaults.worker_tmp_max_bytes)
                 - defaults.cache_max_bytes - defaults.worker_tmp_max_bytes - LINKER_MEMORY)

        # The stack: a raised RLIMIT_STACK lets any thread grow the main stack downwards, counted only as address
        # space (none on CUDA).
        program = Program()
        stack = program.attempt("setrlimit(RLIMIT_STACK, unlimited)")
        program.call(stack, "setrlimit", RLIMIT_STACK, program.put(RLIM_INFINITY.to_bytes(8, "little") * 2))
        run(gpu, kernel, program)
        print(f"\n  {stack}")

        # Fill each path in turn (private first, to its limit) until it is refused, keeping every chunk.
        held: dict[str, int] = {}
        refusals: dict[str, Attempt] = {}
        kept: list[int] = []  # the chunks' addresses
        for label, flags in PATHS.items():
            held[label] = 0
            for _ in range(64):
                program = Program()
                a = _map_chunk(program, label, flags)
                run(gpu, kernel, program)
                if not a.succeeded:
                    refusals[label] = a
                    break
                held[label] += CHUNK
                kept.append(a.results[-2] if flags == MAP_SHARED else a.results[-1])
        resident = _resident(pid)
        for label in PATHS:
            print(f"  {label:17} {held[label] >> 20:5} MiB populated; then {refusals.get(label, 'never refused')}")
        print(f"  resident {resident >> 20} MiB against a bound of {bound >> 20} MiB")
        assert resident <= bound, (
            f"the worker holds {resident >> 20} MiB, {(resident - bound) >> 20} MiB past its bound of "
            f"{bound >> 20} MiB: {', '.join(f'{k} {v >> 20} MiB' for k, v in held.items())}")
        for label in ("shared anonymous", "grows-down", "/dev/zero shared"):
            assert held[label] == 0, f"{label}: {held[label] >> 20} MiB populated outside RLIMIT_DATA"
        assert not stack.succeeded, f"the worker raised its own RLIMIT_STACK: {stack}"

        # The worker serves on: shared memory through the front's segments still works once the kernel gives its
        # chunks back (with its private memory full, PoCL's own allocations fail: the copy crashed the worker here,
        # pyopencl 2026.1.4, a crash of the tenant's own worker charged to it; not what this test is about).
        assert worker_pids(broker, "alice") == [pid], "the worker was replaced"
        program = Program()
        for address in kept:
            program.call(program.attempt("munmap", must_fail=False), "munmap", address, CHUNK)
        run(gpu, kernel, program)
        assert_shared_memory_works(gpu, 16 * MiB)
