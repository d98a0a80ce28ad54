"""A worker's host memory is bounded by default, by its tenant's quota (issue 21, round 2), on PoCL without a cgroup.

Found by the attacker: ``worker_memory_max`` defaulted to 0, "no limit": with no cgroup (this machine, the GPU host)
the worker got no ``RLIMIT_DATA`` or ``RLIMIT_AS`` either, so a tenant's kernel mapped and touched as much host
memory as the host had, whatever its ``memory`` quota said (a kernel populated 1 GiB against a 256 MiB quota). On a
host shared by tenants one of them could push the host into the OOM killer, which picks by size: a victim's worker
or the front. Now 0 means automatic: the tenant's quota on the device, its shared memory, the runtime's own share
and the tmpfs (sandbox/_policy.py ``automatic_memory_max``); an explicit value still wins (test_worker_resources.py).

The kernel is exploits.py's system-call interpreter: it maps anonymous memory with MAP_POPULATE (the pages are
really there), private and shared, past the worker's limits, then unmaps it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpubroker.broker.config import BrokerConfig
from gpubroker.broker.launcher import BrokerProcess, TenantSpec
from gpubroker.broker.sandbox import automatic_memory_max, automatic_reserved
from gpubroker.broker.sandbox._spawn import LINKER_MEMORY
from gpubroker.client import ModuleFormat, connect

from ..conftest import worker_pids
from ._probes import assert_shared_memory_works
from .exploits import ATTACK_SOURCE, NR, Attempt, Program, Result, check_arch, run

MiB = 1 << 20
QUOTA = 256 * MiB  # alice's memory quota; her shared memory defaults to it
CAROL_QUOTA, CAROL_SHARED = 512 * MiB, 64 * MiB
PROT_READ_WRITE = 3
MAP_PRIVATE, MAP_SHARED, MAP_ANONYMOUS, MAP_POPULATE = 0x02, 0x01, 0x20, 0x8000
ATTACK = 1024 * MiB  # the attacker's mapping, at least; more where the limit is higher (many CPUs)
UNLIMITED = -1


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerProcess]:
    check_arch()
    tmp = tmp_path_factory.mktemp("memory")
    # Every setting at its default but where the caches go.
    tenants = [TenantSpec("alice", memory_quota=QUOTA),
               TenantSpec("carol", memory_quota=CAROL_QUOTA, shared_memory=CAROL_SHARED)]
    with BrokerProcess(tenants, backend="opencl", settings={"cache_dir": str(tmp / "caches")}) as broker:
        yield broker


def _limits(pid: int) -> dict[str, int]:
    """The worker's data and address-space limits (soft), in bytes (UNLIMITED: none)."""
    found = {}
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        for name, key in (("Max data size", "data"), ("Max address space", "as")):
            if line.startswith(name):
                value = line[len(name):].split()[0]
                found[key] = UNLIMITED if value == "unlimited" else int(value)
    return found


def _map(program: Program, label: str, size: int, flags: int) -> Attempt:
    a = program.attempt(label)
    mapped = program.call(a, "mmap", 0, size, PROT_READ_WRITE, flags | MAP_ANONYMOUS | MAP_POPULATE, -1, 0)
    program.call(a, "munmap", Result(mapped.index), size, cleanup=True)
    return a


def _past(limit: int) -> int:
    """A mapping past ``limit`` (at least the attacker's 1 GiB; that much where there is no limit)."""
    return ATTACK if limit == UNLIMITED else max(ATTACK, limit + 256 * MiB)


def test_a_default_worker_cannot_take_host_memory_far_past_its_quota(broker: BrokerProcess) -> None:
    NR.setdefault("mmap", 9)
    NR.setdefault("munmap", 11)
    with contextlib.closing(connect(broker.target, token=broker.tokens["alice"], timeout=60)) as gpu:
        kernel = gpu.get_kernel(gpu.load_module(ATTACK_SOURCE, ModuleFormat.OPENCL_C), "gpb_attack")
        probe = Program()
        probe.getpid("getpid")
        run(gpu, kernel, probe)  # (the worker is up)
        (pid,) = worker_pids(broker, "alice")
        limits = _limits(pid)
        program = Program()
        private, shared = _past(limits["data"]), _past(limits["as"])
        attempts = [_map(program, f"mmap {private >> 20} MiB private, populated (quota {QUOTA >> 20} MiB)", private,
                         MAP_PRIVATE),
                    _map(program, f"mmap {shared >> 20} MiB shared, populated (quota {QUOTA >> 20} MiB)", shared,
                         MAP_SHARED)]
        run(gpu, kernel, program)
        print("\n" + "\n".join(f"  {a}" for a in attempts))
        for attempt in attempts:
            assert not attempt.succeeded, (
                f"with the default config a kernel populated {attempt.label}: worker_memory_max = 0 bounds nothing")
            # ENOMEM: refused by the limit; EPERM: a shared anonymous mapping, refused by the filter whatever its
            # size (test_worker_shared_mappings.py); the worker unharmed either way
            assert attempt.ret in (-12, -1), attempt
        # The worker serves on: memory within the quota, and shared memory, work.
        assert_shared_memory_works(gpu, QUOTA // 2)
        assert worker_pids(broker, "alice") == [pid], "the worker was replaced"


def test_the_default_limits_follow_each_tenants_quotas(broker: BrokerProcess) -> None:
    limits = {}
    for name in ("alice", "carol"):
        with contextlib.closing(connect(broker.target, token=broker.tokens[name], timeout=60)) as gpu:
            gpu.allocate_memory(16)
            (pid,) = worker_pids(broker, name)
            limits[name] = _limits(pid)
    defaults = BrokerConfig()
    tmpfs = defaults.cache_max_bytes + defaults.worker_tmp_max_bytes
    # Private writable memory: the quota and the runtime's share (the tmpfs, and the one linker PoCL may run, are
    # counted apart); the address space besides: the shared memory the tenant's sessions may map into the worker,
    # and what PoCL reserves.
    for name, quota, shared in (("alice", QUOTA, QUOTA), ("carol", CAROL_QUOTA, CAROL_SHARED)):
        memory = automatic_memory_max("opencl", quota, shared, defaults.cache_max_bytes,
                                      defaults.worker_tmp_max_bytes)
        assert limits[name] == {"data": memory - tmpfs - shared - LINKER_MEMORY,
                                "as": memory - tmpfs + automatic_reserved("opencl") - LINKER_MEMORY}, (name, limits)
    assert limits["carol"]["data"] - limits["alice"]["data"] == CAROL_QUOTA - QUOTA, limits


def test_the_automatic_limit_leaves_the_tmpfs_at_most_half() -> None:
    # As an explicit worker_memory_max must (the sandbox refuses one that does not): the tmpfs are the worker's
    # memory too, and must leave the rest at least as much.
    for cache, tmp in ((256 * MiB, 64 * MiB), (8 << 30, 1 << 30)):
        for backend in ("opencl", "cuda"):
            for quota in (1, QUOTA, 80 << 30):
                memory = automatic_memory_max(backend, quota, 0, cache, tmp)
                assert 2 * (cache + tmp) <= memory, (backend, quota, cache, tmp, memory)
                assert memory >= quota + cache + tmp
