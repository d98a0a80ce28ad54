"""The Prometheus endpoint and JSON logs of a real broker."""

from __future__ import annotations

import json
import os
import signal
import urllib.request
from collections.abc import Iterator

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from gpubroker.broker import samples
from gpubroker.broker.launcher import BrokerProcess, TenantSpec
from gpubroker.client import NotFound, RemoteGpu, ResourceExhausted, connect
from tests.conftest import worker_pids
from tests.helpers import wait_for

QUOTA = 256 << 20
_HTTP = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # a local endpoint: never via a proxy


@pytest.fixture
def metered(backend: str) -> Iterator[BrokerProcess]:
    tenants = [TenantSpec("alice", memory_quota=QUOTA), TenantSpec("bob")]
    with BrokerProcess(tenants, backend=backend, settings={"metrics_listen": "127.0.0.1:0"}) as proc:
        yield proc


def scrape(broker: BrokerProcess) -> list[Sample]:
    with _HTTP.open(broker.metrics_url, timeout=30) as response:
        assert response.status == 200
        text = response.read().decode()
    return [s for family in text_string_to_metric_families(text) for s in family.samples]


def value(found: list[Sample], name: str, **labels: str) -> float:
    """The one sample of ``name`` whose labels include ``labels``."""
    matches = [s.value for s in found if s.name == name and labels.items() <= s.labels.items()]
    assert len(matches) == 1, f"{len(matches)} samples of {name} with {labels}"
    return matches[0]


def tenant(found: list[Sample], name: str, who: str = "alice") -> float:
    return value(found, name, tenant=who, device="0")


def work(gpu: RemoteGpu, kernel: object, buf: object, n: int) -> None:
    for _ in range(4):
        gpu.execute_kernel(kernel, grid=(n + 255) // 256 * 256, block=256, args=[buf, np.float32(1.0), np.int32(n)])
    gpu.synchronize()


def test_scrape_follows_a_working_tenant_and_its_session_end(metered: BrokerProcess) -> None:
    before = scrape(metered)
    assert tenant(before, "gpubroker_memory_used_bytes") == 0
    assert tenant(before, "gpubroker_memory_quota_bytes") == QUOTA
    assert tenant(before, "gpubroker_sessions") == 0
    assert tenant(before, "gpubroker_device_seconds_total") == 0

    with pytest.raises(NotFound):
        connect(metered.target, token=metered.tokens["alice"], device=99)
    n = 1 << 18
    with connect(metered.target, token=metered.tokens["alice"]) as gpu:
        buf = gpu.allocate_memory(n * 4)
        extra = gpu.allocate_memory(3 << 20)
        with pytest.raises(ResourceExhausted):
            gpu.allocate_memory(QUOTA)
        gpu.copy_h2d(np.ones(n, np.float32), buf)
        kernel = gpu.compile_kernel(samples.source(gpu.device_info().backend), "scale_inplace")
        during = scrape(metered)
        assert tenant(during, "gpubroker_memory_used_bytes") == n * 4 + (3 << 20)
        assert tenant(during, "gpubroker_sessions") == 1
        assert tenant(during, "gpubroker_worker_up") == 1
        assert tenant(during, "gpubroker_memory_used_bytes", "bob") == 0

        # A lone tenant's device time is charged at the scheduler's accounting fence, about once a second.
        def charged() -> bool:
            work(gpu, kernel, buf, n)
            return tenant(scrape(metered), "gpubroker_device_seconds_total") > 0

        wait_for(charged, 60, "alice's device time to be charged")
        busy = scrape(metered)
        assert tenant(busy, "gpubroker_device_share") == 1.0  # nobody else used the device
        assert tenant(busy, "gpubroker_device_seconds_total", "bob") == 0
        # A histogram of every wait: each device call counted once, in +Inf and in every bucket at or above it.
        waits = value(busy, "gpubroker_scheduler_wait_seconds_count", tenant="alice", device="0")
        assert waits > 0
        assert value(busy, "gpubroker_scheduler_wait_seconds_bucket", tenant="alice", device="0", le="+Inf") == waits
        assert value(busy, "gpubroker_scheduler_wait_seconds_sum", tenant="alice", device="0") >= 0
        gpu.free_memory(extra)
        assert tenant(scrape(metered), "gpubroker_memory_used_bytes") == n * 4
        charged_total = tenant(scrape(metered), "gpubroker_device_seconds_total")

    after = scrape(metered)
    assert tenant(after, "gpubroker_memory_used_bytes") == 0
    assert tenant(after, "gpubroker_sessions") == 0
    assert tenant(after, "gpubroker_queue_depth") == 0
    # A counter: it keeps what was charged once the tenant stops working (and then stops rising).
    assert tenant(after, "gpubroker_device_seconds_total") >= charged_total > 0
    assert value(after, "gpubroker_rpc_duration_seconds_count", method="OpenSession", code="OK") == 1
    assert value(after, "gpubroker_rpc_duration_seconds_count", method="OpenSession", code="NOT_FOUND") == 1
    assert value(after, "gpubroker_rpc_duration_seconds_bucket", method="CloseSession", code="OK", le="+Inf") == 1
    assert value(after, "gpubroker_rpc_duration_seconds_sum", method="OpenSession", code="OK") > 0


def test_a_killed_worker_counts_as_a_restart(metered: BrokerProcess) -> None:
    with connect(metered.target, token=metered.tokens["bob"]) as gpu:
        gpu.allocate_memory(1 << 20)
        assert tenant(scrape(metered), "gpubroker_worker_restarts_total", "bob") == 0
        (pid,) = worker_pids(metered, "bob")
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: tenant(scrape(metered), "gpubroker_worker_restarts_total", "bob") == 1, 30,
                 "the worker's death to be counted")
        found = scrape(metered)
        assert tenant(found, "gpubroker_worker_up", "bob") == 0
        assert tenant(found, "gpubroker_memory_used_bytes", "bob") == 0  # its memory died with it
        assert tenant(found, "gpubroker_worker_restarts_total") == 0  # alice's worker is untouched


def test_json_logs_carry_tenant_session_and_method(backend: str) -> None:
    with BrokerProcess([TenantSpec("alice")], backend=backend, settings={"log_format": "json"}) as proc:
        with connect(proc.target, token=proc.tokens["alice"]) as gpu:
            session = gpu.session
            gpu.allocate_memory(1 << 20)

        def records() -> list[dict[str, str]]:
            lines = proc.log_tail(1_000_000).splitlines()
            return [json.loads(line) for line in lines if line.startswith("{")]

        wait_for(lambda: any("closed" in r["message"] for r in records()), 20, "the session's close to be logged")
        found = records()
        assert all({"time", "level", "logger", "message"} <= r.keys() for r in found)
        opened = next(r for r in found if f"session {session} opened" in r["message"])
        assert (opened["tenant"], opened["method"], opened["logger"]) == ("alice", "OpenSession", "gpubroker.sessions")
        closed = next(r for r in found if f"session {session} of tenant alice closed" in r["message"])
        assert (closed["tenant"], closed["session"], closed["method"]) == ("alice", session, "CloseSession")
        assert any(r["logger"] == "gpubroker.server" and r["message"].startswith("serving on") for r in found)
        # The broker's own lines are all JSON (only its workers' and the device runtime's may not be).
        assert " gpubroker.server INFO " not in proc.log_tail(1_000_000)
