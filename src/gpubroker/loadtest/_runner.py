"""Run a load test: a broker (embedded or given), one process per tenant, and the parent sampling it all."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import queue as queue_mod
import time
from array import array
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, TextIO

import numpy as np

from gpubroker.broker import samples
from gpubroker.client import GpuBrokerError, TlsOptions
from gpubroker.loadtest._config import LoadTestConfig, assign_workloads, load_tokens
from gpubroker.loadtest._progress import Progress
from gpubroker.loadtest._tenant import TenantJob, TenantSample, run_tenant
from gpubroker.loadtest._workloads import WorkloadSpec

__all__ = ["RawRun", "TenantState", "run_loadtest"]

STOP_GRACE_S = 30.0  # past the duration, how long tenants get to finish their last operation before being stopped
KILL_GRACE_S = 10.0  # after being told to stop, before their processes are terminated


@dataclass
class TenantState:
    tenant: str
    workload: str
    ops: int = 0
    bytes: int = 0
    errors: int = 0
    latencies: array[float] = field(default_factory=lambda: array("d"))  # 8 bytes per op, not a float object's 32
    messages: list[str] = field(default_factory=list)
    ready: bool = False
    done: bool = False
    seconds: float = 0.0  # how long its loop ran

    def add(self, sample: TenantSample) -> None:
        self.ops += sample.ops
        self.bytes += sample.bytes
        self.errors += sample.errors
        self.latencies.extend(sample.latencies)
        self.messages.extend(sample.messages)

    def fail(self, message: str) -> None:
        self.errors += 1
        self.messages.append(message)
        self.done = True


@dataclass
class RawRun:
    """What a run observed, for the report: per-tenant totals, the usage baseline and the time series."""

    config: LoadTestConfig
    target: str
    embedded: bool
    backend: str
    device_name: str
    started: str
    calibration: dict[str, Any]
    tenants: dict[str, TenantState]
    timeline: list[dict[str, Any]] = field(default_factory=list)
    usage_start: dict[str, float] | None = None
    usage_end: dict[str, Any] | None = None  # tenant -> TenantUsage row at the end
    fair_scheduling: bool | None = None
    quantum_ms: float | None = None
    elapsed: float = 0.0


def _probe_and_calibrate(target: str, token: str, device: int, long_ms: float | None,
                         tls: TlsOptions | None) -> tuple[str, str, dict[str, Any]]:
    """The broker's backend and device name, and spin iterations taking about ``long_ms`` there (with the result)."""
    from gpubroker.client import connect

    with connect(target, token=token, device=device, tls=tls) as gpu:
        info = gpu.device_info()
        if long_ms is None:
            return info.backend, info.name, {}
        src = samples.source(info.backend)
        spin, empty = gpu.compile_kernel(src, "spin"), gpu.compile_kernel(src, "empty_kernel")
        buf, back = gpu.allocate_memory(4), np.empty(1, dtype=np.float32)

        def timed(kernel: Any, args: list[object]) -> float:
            t0 = time.perf_counter()
            gpu.execute_kernel(kernel, 1, 1, args)
            gpu.synchronize()
            return time.perf_counter() - t0

        overhead = min(timed(empty, []) for _ in range(5))  # the round trip, not the kernel
        iters, took = 100_000, 0.0
        for _ in range(6):
            took = max(1e-6, min(timed(spin, [buf, np.int64(iters)]) for _ in range(2)) - overhead)
            iters = int(min(max(iters * (long_ms / 1e3) / took, 1_000), 2**40))
        gpu.memset(buf, 0)
        timed(spin, [buf, np.int64(iters)])
        gpu.copy_d2h(buf, back)
        return info.backend, info.name, {"long_iters": iters, "long_expected": float(back[0]),
                                         "long_ms_target": long_ms, "long_ms_measured": took * 1e3}


class _Usage:
    """The Admin Usage RPC, reduced to device seconds per tenant on one device; None when unavailable."""

    def __init__(self, target: str, token: str | None, device: int, tls: TlsOptions | None) -> None:
        self.device = device
        self.client: Any = None
        if token:
            from gpubroker.client import AdminClient

            self.client = AdminClient(target, token, timeout=10.0, tls=tls)
        self.last: Any = None

    def read(self) -> dict[str, float] | None:
        if self.client is None:
            return None
        try:
            self.last = self.client.usage()
        except GpuBrokerError:
            return None
        return {u.tenant: u.device_seconds for u in self.last.tenants if u.device == self.device}

    def close(self) -> None:
        if self.client is not None:
            self.client.close()


def _drain(q: Any, states: dict[str, TenantState], until: float) -> None:
    """Handle the tenants' messages until ``until`` (monotonic), or just what is queued if that has passed."""
    while True:
        try:
            msg = q.get(timeout=max(0.0, until - time.monotonic())) if until > time.monotonic() else q.get_nowait()
        except queue_mod.Empty:
            return
        kind, tenant = msg[0], msg[1]
        state = states[tenant]
        if kind == "ready":
            state.ready = True
        elif kind == "sample":
            state.add(msg[2])
        elif kind == "done":
            state.done, state.seconds = True, float(msg[2])
            if all(s.done for s in states.values()):
                return


def _reap(q: Any, procs: dict[str, Any], states: dict[str, TenantState]) -> None:
    """A process that died without saying it was done counts an error (its queued messages are read first)."""
    dead = [t for t, p in procs.items() if not states[t].done and not p.is_alive()]
    if dead:
        _drain(q, states, 0.0)
    for t in dead:
        if not states[t].done:
            states[t].fail(f"tenant process exited with code {procs[t].exitcode} before reporting")


def _run_tenants(config: LoadTestConfig, run: RawRun, tokens: dict[str, str], usage: _Usage,
                 progress: Progress) -> None:
    ctx = mp.get_context("spawn")  # a fresh interpreter per tenant: no inherited grpc state, no shared GIL
    q, go, stop = ctx.Queue(), ctx.Event(), ctx.Event()
    states = run.tenants
    spec_args = {k: run.calibration[k] for k in ("long_iters", "long_expected") if k in run.calibration}
    procs = {}
    for tenant, state in states.items():
        job = TenantJob(tenant, tokens[tenant], run.target, config.device,
                        WorkloadSpec(state.workload, copy_bytes=config.copy_bytes, **spec_args),
                        config.duration, config.max_ops, setup_timeout=config.setup_timeout, tls=config.tls)
        procs[tenant] = ctx.Process(target=run_tenant, args=(job, q, go, stop), name=f"loadtest-{tenant}",
                                    daemon=True)
    try:
        for p in procs.values():
            p.start()
        progress.message(f"starting {len(procs)} tenant processes (connect, compile)")
        deadline = time.monotonic() + config.setup_timeout
        while not all(s.ready or s.done for s in states.values()):
            _drain(q, states, time.monotonic() + 0.2)
            _reap(q, procs, states)
            if time.monotonic() > deadline:
                for t, s in states.items():
                    if not (s.ready or s.done):
                        procs[t].terminate()
                        s.fail(f"not set up within {config.setup_timeout:g} s")
        progress.message(f"{sum(s.ready for s in states.values())}/{len(states)} tenants ready; running "
                         f"for {config.duration:g} s")
        run.usage_start = usage.read()
        go.set()
        t0 = time.monotonic()
        run.timeline.append(_point(0.0, states, run.usage_start, run.usage_start))
        tick, stop_at, kill_at = t0, t0 + config.duration + STOP_GRACE_S, float("inf")
        while not all(s.done for s in states.values()):
            tick = max(tick + config.sample_interval, time.monotonic() + 0.05)  # a slow Usage call: no catch-up burst
            _drain(q, states, tick)
            _reap(q, procs, states)
            now = time.monotonic()
            _append(run.timeline, _point(now - t0, states, run.usage_start, usage.read()), config.sample_interval)
            _show(progress, now - t0, states)
            if now > stop_at and not stop.is_set():
                stop.set()
                kill_at = now + KILL_GRACE_S
            if now > kill_at:
                for t, p in procs.items():
                    if not states[t].done:
                        p.terminate()
                        states[t].fail(f"did not stop within {STOP_GRACE_S + KILL_GRACE_S:g} s of the end")
        run.elapsed = time.monotonic() - t0
        final = usage.read()
        _append(run.timeline, _point(run.elapsed, states, run.usage_start, final), config.sample_interval)
        _show(progress, run.elapsed, states)
        progress.finish()
        if usage.last is not None:
            run.usage_end = {u.tenant: u for u in usage.last.tenants if u.device == config.device}
            run.fair_scheduling, run.quantum_ms = usage.last.fair_scheduling, usage.last.quantum_ms
    finally:
        stop.set()
        go.set()  # tenants still waiting to start see the stop and leave
        deadline = time.monotonic() + KILL_GRACE_S
        for p in procs.values():
            p.join(timeout=max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.terminate()
                p.join()
        q.close()
        q.cancel_join_thread()
        progress.finish()


def _point(t: float, states: dict[str, TenantState], base: dict[str, float] | None,
           now: dict[str, float] | None) -> dict[str, Any]:
    point: dict[str, Any] = {"t": round(t, 4), "tenants": {}}
    for name, s in states.items():
        dev = None if now is None or base is None else now.get(name, 0.0) - base.get(name, 0.0)
        point["tenants"][name] = {"ops": s.ops, "bytes": s.bytes, "errors": s.errors, "device_seconds": dev}
    return point


def _append(timeline: list[dict[str, Any]], point: dict[str, Any], interval: float) -> None:
    """Add a point; one that comes within half an interval of the last replaces it (rates over slivers are noise)."""
    if len(timeline) > 1 and point["t"] - timeline[-1]["t"] < interval / 2:
        timeline[-1] = point
    else:
        timeline.append(point)


def _show(progress: Progress, elapsed: float, states: dict[str, TenantState]) -> None:
    progress.update(elapsed, sum(s.ops for s in states.values()), sum(s.bytes for s in states.values()) / 1e9,
                    sum(s.errors for s in states.values()))


def run_loadtest(config: LoadTestConfig, stream: TextIO | None = None) -> RawRun:
    """Run the load described by ``config``; progress goes to ``stream`` (default stderr)."""
    config.check()
    workloads = assign_workloads(config.mix, config.tenants)
    progress = Progress(config.duration, stream)
    with contextlib.ExitStack() as stack:
        if config.target is None:
            from gpubroker.broker.launcher import BrokerProcess, TenantSpec

            names = [f"t{i:02d}" for i in range(1, config.tenants + 1)]
            specs = [TenantSpec(config.admin_tenant, admin=True), *(TenantSpec(n) for n in names)]
            progress.message(f"starting an embedded broker (backend {config.backend}) with {len(names)} tenants")
            broker = stack.enter_context(BrokerProcess(specs, backend=config.backend))
            target, embedded = broker.target, True
            tokens = {n: broker.tokens[n] for n in names}
            admin_token: str | None = broker.tokens[config.admin_tenant]
        else:
            assert config.tokens_file is not None
            tokens, admin_token = load_tokens(config.tokens_file, config.admin_tenant, config.tenants)
            target, embedded = config.target, False
            if admin_token is None:
                progress.message(f"no {config.admin_tenant!r} token in {config.tokens_file}: "
                                 "device-time shares are not measured")
        usage = _Usage(target, admin_token, config.device, config.tls)
        stack.callback(usage.close)
        long_ms = config.long_ms if "long" in workloads else None
        if long_ms is not None:
            progress.message(f"calibrating the long kernel to {long_ms:g} ms")
        backend, device_name, calibration = _probe_and_calibrate(
            target, admin_token or next(iter(tokens.values())), config.device, long_ms, config.tls)
        states = {t: TenantState(t, w) for t, w in zip(tokens, workloads, strict=True)}
        run = RawRun(config, target, embedded, backend, device_name,
                     datetime.now(UTC).isoformat(timespec="seconds"), calibration, states)
        _run_tenants(config, run, tokens, usage, progress)
    return run
