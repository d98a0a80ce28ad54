"""Memory quotas under racing allocations, and weighted device shares through a real broker."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest

from gpubroker.broker import samples
from gpubroker.broker.launcher import BrokerProcess, TenantSpec
from gpubroker.client import AdminClient, GpuBrokerError, ResourceExhausted, connect

from ..helpers import wait_for


@pytest.fixture
def weighted(backend: str) -> Iterator[BrokerProcess]:
    tenants = [TenantSpec("ops", admin=True), TenantSpec("light", weight=1), TenantSpec("heavy", weight=3),
               TenantSpec("tight", memory_quota=64 << 20)]
    with BrokerProcess(tenants, backend=backend, settings={"quantum_ms": 5.0}) as proc:
        yield proc


def test_racing_allocations_never_exceed_the_quota(weighted: BrokerProcess) -> None:
    chunk = 3 << 20  # 21 of these fit in 64 MiB
    gpus = [connect(weighted.target, token=weighted.tokens["tight"]) for _ in range(4)]
    results: list[object] = []
    barrier = threading.Barrier(64)

    def allocate(i: int) -> None:
        barrier.wait()
        try:
            results.append(gpus[i % 4].allocate_memory(chunk))
        except ResourceExhausted as exc:
            results.append(exc)

    threads = [threading.Thread(target=allocate, args=(i,)) for i in range(64)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    won = [r for r in results if not isinstance(r, GpuBrokerError)]
    refused = [r for r in results if isinstance(r, ResourceExhausted)]
    assert len(won) == (64 << 20) // chunk and len(refused) == 64 - len(won)
    info = gpus[0].device_info()
    assert info.memory_used == len(won) * chunk <= info.memory_quota
    assert "quota 67108864" in refused[0].message and f"requested {chunk}" in refused[0].message
    for g in gpus:
        g.close()
    with connect(weighted.target, token=weighted.tokens["tight"]) as again:  # closed sessions gave it all back
        assert again.device_info().memory_used == 0


def test_device_info_shows_quota_use_and_room(weighted: BrokerProcess) -> None:
    with connect(weighted.target, token=weighted.tokens["tight"]) as gpu:
        gpu.allocate_memory(1 << 20)
        info = gpu.device_info()
        assert (info.memory_quota, info.memory_used) == (64 << 20, 1 << 20)
        assert info.memory_available == min(63 << 20, info.free_memory)


def _calibrated_iters(broker: BrokerProcess, backend: str, seconds: float) -> np.int64:
    """Spin iterations that keep this device busy for about ``seconds`` (devices differ a hundredfold)."""
    with connect(broker.target, token=broker.tokens["ops"]) as gpu:
        kernel = gpu.compile_kernel(samples.source(backend), "spin")
        buf = gpu.allocate_memory(4096)
        iters = 1_000_000
        for _ in range(3):
            t0 = time.perf_counter()
            gpu.execute_kernel(kernel, 1, 1, [buf, np.int64(iters)])
            gpu.synchronize()
            iters = max(10_000, int(iters * seconds / max(time.perf_counter() - t0, 1e-6)))
    return np.int64(iters)


def test_weighted_tenants_share_the_device(weighted: BrokerProcess, backend: str) -> None:
    """Two saturating tenants with weights 1 : 3 get device-time shares near 1/4 and 3/4."""
    iters = _calibrated_iters(weighted, backend, seconds=0.005)  # kernels long enough to saturate the device
    stop = threading.Event()
    errors: list[BaseException] = []

    def saturate(tenant: str) -> None:
        try:
            # Asynchronous commands keep each tenant's work queued, so the device, not the client, is the limit.
            with connect(weighted.target, token=weighted.tokens[tenant], async_commands=True) as gpu:
                kernel = gpu.compile_kernel(samples.source(backend), "spin")
                buf = gpu.allocate_memory(4096)
                while not stop.is_set():
                    for _ in range(8):
                        gpu.execute_kernel(kernel, 1, 1, [buf, iters])
                    gpu.synchronize()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=saturate, args=(t,)) for t in ("light", "heavy")]
    for t in threads:
        t.start()
    with AdminClient(weighted.target, weighted.tokens["ops"]) as admin:
        def device_seconds() -> dict[str, float]:
            return {u.tenant: u.device_seconds for u in admin.usage(window_seconds=120).tenants}

        # Measured from when both contend: whichever tenant's worker and kernels were ready first ran alone until
        # the other's were (a cold compile: a second or more), and that is no share. A window of device time, not
        # wall-clock sleeps.
        wait_for(lambda: all(device_seconds().get(t, 0.0) > 0.05 for t in ("light", "heavy")), 60,
                 "both tenants to run kernels")
        start = device_seconds()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            now = device_seconds()
            if all(now[t] - start[t] > 0.5 for t in ("light", "heavy")):
                break
            time.sleep(0.2)
        stop.set()
        for t in threads:
            t.join()
        assert not errors, errors
        end = device_seconds()
        usage = {u.tenant: u for u in admin.usage(window_seconds=120).tenants}
    light, heavy = end["light"] - start["light"], end["heavy"] - start["heavy"]
    assert 0.15 <= light / (light + heavy) <= 0.35, (light, heavy)  # target 0.25; a loose bound for CI
    assert usage["heavy"].weight == 3.0 and usage["heavy"].wait_p99_ms >= 0.0


def test_admin_cli_shows_usage_and_sessions(weighted: BrokerProcess) -> None:
    import os
    import subprocess
    import sys

    env = {**os.environ, "GPUBROKER_TOKEN": weighted.tokens["ops"]}
    with connect(weighted.target, token=weighted.tokens["heavy"]) as gpu:
        gpu.allocate_memory(12345)
        out = {cmd: subprocess.run([sys.executable, "-m", "gpubroker.broker.cli", "admin", "--target", weighted.target,
                                    cmd], env=env, capture_output=True, text=True, check=True).stdout
               for cmd in ("usage", "sessions")}
    heavy_row = next(line for line in out["usage"].splitlines() if line.startswith("heavy"))
    assert heavy_row.split()[2] == "3" and "12.1KiB" in heavy_row
    assert gpu.session in out["sessions"]
