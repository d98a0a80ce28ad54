"""The broker's health bookkeeping: worker failures within a window, Xid classes, the drain's retry hint."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import pytest
from grpc_health.v1 import health_pb2

from gpubroker.broker.config import BrokerConfig, load_config
from gpubroker.broker.front._health import BROKER_SERVICE, BrokerHealth, device_service
from gpubroker.broker.front.workers import WorkerClient, WorkerPool
from gpubroker.client import DeadlineExceeded, DeviceInfo, InvalidArgument, Unavailable


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
        assert await health.undrain() is True  # the drain ends: each status its own again
        health.check_open(0)
        assert health.drain_deadline is None
        for service in ("", BROKER_SERVICE, device_service(0)):
            assert await _status(health, service) == "SERVING"
        assert await health.undrain() is False
        await health.stop()

    asyncio.run(scenario())


class _Exit:
    """The end of a worker process, as the front sees it: an exit status (no process is started here)."""

    def __init__(self, code: int) -> None:
        self.returncode, self.pid = code, 4242

    def poll(self) -> int:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        return self.returncode

    def kill(self) -> None:
        pass


def _ended(pool: WorkerPool, code: int, *, tenant_code: bool = False, stopping: bool = False,
           fault: bool = False) -> WorkerClient:
    worker = WorkerClient("t", 0, "opencl", on_exit=pool._forget)
    worker.process = _Exit(code)  # type: ignore[assignment]
    worker.tenant_code_ran, worker._stopping = tenant_code, stopping
    if fault:
        worker.fault = DeadlineExceeded("device work held the device past max_kernel_seconds = 1 s")
    return worker


def test_worker_deaths_are_charged_to_their_cause_once() -> None:
    async def scenario() -> None:
        clock = Clock()
        health = _health(clock, devices=1, device_failure_threshold=100)
        await health.start()
        pool = WorkerPool("opencl", 1.0, 60.0, crash_budget=3, crash_window=10.0, on_failure=health.worker_exited,
                          clock=clock)
        cases = [  # (exit, tenant code ran, stopped by the front, killed for the tenant) -> blame
            ((-11, True, False, False), "tenant"),  # a wild pointer in its kernel
            ((3, False, False, False), "tenant"),  # a fatal device error its kernel caused
            ((-9, False, False, True), "tenant"),  # killed for the kernel time limit
            ((-11, False, False, False), "device"),  # died before any tenant code
            ((-9, True, True, False), None),  # the front stopped it (reaped, tenant removed) and had to kill it
            ((0, True, False, False), "tenant"),  # exited on its own after running tenant code
            ((0, False, False, False), None),
        ]
        for (code, ran, stopping, fault), blame in cases:
            worker = _ended(pool, code, tenant_code=ran, stopping=stopping, fault=fault)
            # The reader's end and a failed write report one death together: it must count once.
            await asyncio.gather(worker._died(), worker._died())
            assert worker.blame == blame, (code, ran, stopping, fault)
        assert health.recent_failures(0) == 1  # only the death before any tenant code
        assert pool.crashes.total["t"] == 4 and pool.restarts == 5
        with pytest.raises(Unavailable, match="crashed its workers 3 times within 10 s") as refused:
            pool.crashes.check("t")
        assert refused.value.details["retry_after_seconds"] == 10.0
        clock.now += 10.5
        pool.crashes.check("t")  # the window passed: served again
        await health.stop()

    asyncio.run(scenario())


def test_a_stop_signal_during_a_drain_is_nobodys_failure() -> None:
    async def scenario() -> None:
        clock = Clock()
        health = _health(clock, devices=1, device_failure_threshold=100)
        await health.start()
        pool = WorkerPool("opencl", 1.0, 60.0, crash_budget=3, crash_window=10.0, on_failure=health.worker_exited,
                          clock=clock)
        first = _ended(pool, -signal.SIGTERM, tenant_code=True)
        await first._died()
        pool.draining = True  # the front's own SIGTERM handler ran just after it read the worker's end
        second = _ended(pool, -signal.SIGTERM)
        await second._died()
        await asyncio.sleep(0.7)
        assert first.blame is None and second.blame is None
        assert health.recent_failures(0) == 0 and pool.crashes.recent("t") == 0 and pool.restarts == 0
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
