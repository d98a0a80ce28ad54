"""Soak: tenants cycling whole sessions at once leave nothing behind (``gpubroker bench soak`` runs the long one)."""

from __future__ import annotations

import json

import pytest
from gpubroker_bench.soak import SOAK_SETTINGS, run_soak

from gpubroker.broker.launcher import BrokerProcess, TenantSpec

TENANTS = ["t0", "t1", "t2"]


def test_a_hundred_session_cycles_over_three_tenants_return_everything_to_baseline(backend: str) -> None:
    """Descriptors, shared segments, device memory and sessions exactly; RSS within allocator noise."""
    specs = [TenantSpec(t, memory_quota=1 << 30) for t in TENANTS] + [TenantSpec("root", admin=True)]
    with BrokerProcess(specs, backend=backend, settings=SOAK_SETTINGS) as broker:
        result = run_soak(broker, TENANTS, cycles=34, warmup=3)
    assert result["errors"] == 0, result["first_errors"]
    figures = json.dumps({"baseline": result["baseline"], "final": result["final"]}, indent=1)
    assert all(result["back_to_baseline"].values()), f"{result['back_to_baseline']}\n{figures}"


def test_a_tenant_failing_its_warm_up_stops_the_soak_saying_why(backend: str) -> None:
    """Not a wait for a warm-up that never comes (the parent once waited 600 s for a child that had died)."""
    specs = [TenantSpec("t0"), TenantSpec("root", admin=True)]
    with BrokerProcess(specs, backend=backend, settings=SOAK_SETTINGS) as broker:
        broker.tokens = {**broker.tokens, "t0": broker.tokens["t0"][:-4] + "xxxx"}  # a wrong secret
        with pytest.raises(RuntimeError, match="failed its warm-up: Unauthenticated"):
            run_soak(broker, ["t0"], cycles=1, warmup=1)
