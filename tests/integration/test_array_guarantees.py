"""The broker's guarantees hold for arrays: quotas, fair-scheduling charges, errors, and memory given back.

Arrays of ``gpubroker.client.array`` are device allocations, launches and library operations of the tenant's
session like any other, so these tests drive the namespace through a real broker (queued commands, the
same-host ring) and watch what the broker sees.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Iterator

import numpy as np
import pytest

from gpubroker.broker.launcher import BrokerProcess, TenantSpec
from gpubroker.client import AdminClient, GpuBrokerError, InvalidArgument, RemoteGpu, ResourceExhausted, connect
from gpubroker.client.array import namespace, release_memory

QUOTA = 32 << 20


@pytest.fixture(scope="module")
def arrays_broker(backend: str) -> Iterator[BrokerProcess]:
    tenants = [TenantSpec("ops", admin=True), TenantSpec("tight", memory_quota=QUOTA), TenantSpec("idle")]
    with BrokerProcess(tenants, backend=backend) as proc:
        yield proc


def _open(broker: BrokerProcess, tenant: str) -> RemoteGpu:
    return connect(broker.target, token=broker.tokens[tenant], async_commands=True)


def test_an_array_over_the_quota_is_refused_naming_its_size_and_later_work_runs(arrays_broker: BrokerProcess) -> None:
    with _open(arrays_broker, "tight") as gpu:
        xp = namespace(gpu)
        big = 2 * QUOTA // 4  # float32 elements: twice the quota in bytes
        with pytest.raises(ResourceExhausted) as err:
            np.asarray(xp.ones((big,), dtype=xp.float32))  # queued: raised at the host conversion
        assert str(2 * QUOTA) in err.value.message and f"quota {QUOTA}" in err.value.message
        small = xp.arange(10, dtype=xp.float32)
        assert np.asarray(xp.sum(small * 2)) == 90.0


def test_a_dead_array_gives_its_memory_back(arrays_broker: BrokerProcess) -> None:
    with _open(arrays_broker, "tight") as gpu:
        xp = namespace(gpu)
        before = gpu.device_info().memory_used
        x = xp.ones((1 << 20,), dtype=xp.float32)  # 4 MiB
        float(xp.sum(x))
        assert gpu.device_info().memory_used >= (before or 0) + (4 << 20)
        del x
        gc.collect()
        release_memory(gpu)  # dead buffers: freed (queued), the pool emptied
        gpu.synchronize()
        # The 4 MiB went back; what stays is small: the sum's 0-d result and the kernels' cached shape tables.
        assert gpu.device_info().memory_used <= (before or 0) + (64 << 10)


def test_library_errors_are_the_clients_exceptions(arrays_broker: BrokerProcess) -> None:
    with _open(arrays_broker, "tight") as gpu:
        xp = namespace(gpu)
        with pytest.raises(ValueError):
            xp.linalg.inv(xp.ones((2, 3)))  # refused on the client: not square
        # Past the client's checks, the worker checks again: a library call naming an output too small for its
        # result is InvalidArgument naming the operation, and the session goes on.
        from gpubroker.client import ArrayRef

        a = xp.ones((4, 4))
        out = gpu.allocate_memory(8)
        with pytest.raises(InvalidArgument, match=r"linalg\.inv"):
            gpu.run_library("linalg.inv", [ArrayRef(a._view.buffer, "float64", (4, 4))],
                            [ArrayRef(out, "float64", (4, 4))])
            gpu.synchronize()
        assert float(xp.sum(a)) == 16.0


def test_array_work_is_charged_to_its_tenant(arrays_broker: BrokerProcess) -> None:
    with _open(arrays_broker, "tight") as gpu, AdminClient(arrays_broker.target, arrays_broker.tokens["ops"]) as admin:
        xp = namespace(gpu)
        rng = np.random.default_rng(0)
        a = xp.asarray(rng.standard_normal((256, 256)).astype(np.float32))
        deadline = time.monotonic() + 60
        charged = 0.0
        while time.monotonic() < deadline:
            total = xp.sum(xp.linalg.svdvals(a @ a.T + 1.0))
            for _ in range(10):
                total = total + xp.sum(xp.linalg.svdvals(a @ a.T + 1.0))
            float(total)
            usage = {u.tenant: u for u in admin.usage().tenants}
            charged = usage["tight"].device_seconds
            if charged > 0.05:
                break
        assert charged > 0.05
        assert "idle" not in usage or usage["idle"].device_seconds == 0


def test_arrays_from_two_sessions_do_not_mix(arrays_broker: BrokerProcess) -> None:
    with _open(arrays_broker, "tight") as one, _open(arrays_broker, "idle") as two:
        x, y = namespace(one).ones(3), namespace(two).ones(3)
        with pytest.raises((ValueError, GpuBrokerError)):
            np.asarray(x + y)
