"""The broker's health bookkeeping: worker failures within a window, Xid classes, the drain's retry hint."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from grpc_health.v1 import health_pb2

from gpubroker.broker.config import BrokerConfig, load_config
from gpubroker.broker.server._health import BROKER_SERVICE, BrokerHealth, device_service
from gpubroker.client import DeviceInfo, InvalidArgument, Unavailable


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _devices(n: int) -> list[DeviceInfo]:
    # Descriptions only: the bookkeeping under test never touches a device.
    return [DeviceInfo(id=i, name=f"gpu{i}", vendor="v", backend="cuda", total_memory=1 << 30, free_memory=1 << 30,
                       multiprocessor_count=1, clock_mhz=1, l2_cache_bytes=0, unified_memory=False,
                       max_threads_per_block=1024, max_block_dims=(1024, 1024, 64), max_grid_dims=(1, 1, 1))
            for i in range(n)]


def _health(clock: Clock, devices: int = 2, **settings: object) -> BrokerHealth:
    config = BrokerConfig(nvml_xid_events=False, device_failure_threshold=2, device_failure_window_seconds=10.0,
                          drain_grace_seconds=30.0)
    for key, value in settings.items():
        setattr(config, key, value)
    return BrokerHealth(config, _devices(devices), clock=clock)


async def _status(health: BrokerHealth, service: str) -> str:
    reply = await health.servicer.Check(health_pb2.HealthCheckRequest(service=service), None)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def test_failures_within_the_window_take_a_device_out_until_the_window_passes() -> None:
    async def scenario() -> None:
        clock = Clock()
        health = _health(clock)
        await health.start()
        health.worker_start_failed(1, Unavailable("worker failed to start (timed out)"))
        clock.now += 11  # the first failure has left the window before the second comes
        error = Unavailable("worker failed to start (exited with status 1)")
        health.worker_start_failed(1, error)
        health.worker_start_failed(1, error)  # callers sharing one start see one error: counted once
        assert health.problem(1) is None and health.recent_failures(1) == 1
        health.worker_start_failed(1, Unavailable("worker failed to start (exited with status 1)"))
        await health.publish()
        assert "2 worker failures within 10 s" in (health.problem(1) or "")
        assert await _status(health, device_service(1)) == "NOT_SERVING"
        assert await _status(health, device_service(0)) == "SERVING"
        assert await _status(health, "") == "SERVING"  # device 0 still takes sessions
        with pytest.raises(Unavailable, match="device 1 is not serving") as refused:
            health.check_open(1)
        assert refused.value.details["retry_after_seconds"] == 10.0
        health.check_open(0)
        clock.now += 10.5
        await health.publish()
        assert health.problem(1) is None and await _status(health, device_service(1)) == "SERVING"
        await health.stop()

    asyncio.run(scenario())


def test_application_xids_leave_the_device_in_service_and_others_take_it_out() -> None:
    async def scenario() -> None:
        health = _health(Clock(), devices=1)
        await health.start()
        for xid in (13, 31, 43, 45, 68):
            health.gpu_fault(0, xid)
        assert health.problem(0) is None
        health.gpu_fault(0, 79)  # fallen off the bus
        await health.publish()
        assert await _status(health, device_service(0)) == "NOT_SERVING"
        assert await _status(health, BROKER_SERVICE) == "NOT_SERVING"  # no device serves
        with pytest.raises(Unavailable, match="Xid 79") as refused:
            health.check_open(0)
        assert "retry_after_seconds" not in refused.value.details  # it needs a person, not a retry
        await health.stop()

    asyncio.run(scenario())


def test_drain_turns_everything_not_serving_and_hints_when_to_retry() -> None:
    async def scenario() -> None:
        clock = Clock()
        health = _health(clock, devices=1)
        await health.start()
        await health.drain(None)
        with pytest.raises(Unavailable, match="draining") as refused:
            health.check_open(0)
        assert refused.value.details["retry_after_seconds"] == 30.0  # no deadline: the configured grace
        await health.drain(clock.now + 5)
        await health.drain(clock.now + 50)  # a later drain never lengthens the grace
        assert health.drain_deadline == clock.now + 5 and health.retry_after() == 5.0
        for service in ("", BROKER_SERVICE, device_service(0)):
            assert await _status(health, service) == "NOT_SERVING"
        await health.stop()

    asyncio.run(scenario())


def test_worker_exits_count_unless_clean_or_the_tenants_own_fault() -> None:
    class Exited:
        def __init__(self, code: int) -> None:
            self.device, self.death = 0, f"exited with {code}"
            self.process = type("P", (), {"returncode": code})()

    async def scenario() -> None:
        health = _health(Clock(), devices=1)
        await health.start()
        for code in (0, 3):  # a clean stop; a kernel that corrupted its own context (the tenant's fault)
            health.worker_exited(Exited(code))  # type: ignore[arg-type]
        assert health.recent_failures(0) == 0
        health.worker_exited(Exited(-9))  # type: ignore[arg-type]
        assert health.recent_failures(0) == 1
        await health.stop()

    asyncio.run(scenario())


def test_operations_settings_are_read_and_checked(tmp_path: Path) -> None:
    path = tmp_path / "gpubroker.toml"
    path.write_text("[broker]\ndrain_grace_seconds = 5\ndevice_failure_threshold = 0\n"
                    "device_failure_window_seconds = 30\nnvml_xid_events = false\n")
    cfg = load_config(path)
    assert (cfg.drain_grace_seconds, cfg.device_failure_threshold, cfg.device_failure_window_seconds,
            cfg.nvml_xid_events) == (5.0, 0, 30.0, False)
    health = BrokerHealth(cfg, _devices(1))
    for _ in range(5):
        health.worker_start_failed(0, Unavailable("worker failed to start"))  # threshold 0: never out of service
    assert health.problem(0) is None
    for bad in ("drain_grace_seconds = -1", "device_failure_threshold = -2", "device_failure_window_seconds = 0"):
        path.write_text(f"[broker]\n{bad}\n")
        with pytest.raises(InvalidArgument, match=bad.split()[0]):
            load_config(path)
