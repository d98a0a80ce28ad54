"""Prometheus metrics: per-tenant memory, device time, shares, sessions, queues and waits; RPC latencies.

The tenant figures are read from the live sessions, schedulers and worker pool at scrape time, on the broker's
event loop (they are only ever changed there), so a scrape sees one consistent moment and costs nothing between
scrapes. The endpoint is served by prometheus_client's HTTP thread on its own registry.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterator, Reversible
from dataclasses import dataclass
from typing import TypeVar
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Histogram, ProcessCollector, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gpubroker.client import FailedPrecondition, InvalidArgument

from ..config import split_host_port
from ..scheduler import DeviceScheduler
from ..sessions import SessionManager
from ..workers import WorkerPool

__all__ = ["RPC_DURATION", "SHARE_WINDOW_SECONDS", "BrokerCollector", "MetricsServer", "observe_rpc", "serve_metrics"]

log = logging.getLogger("gpubroker.metrics")
T = TypeVar("T")

SHARE_WINDOW_SECONDS = 10.0  # gpubroker_device_share covers this much recent device time
_SNAPSHOT_TIMEOUT = 5.0  # a scrape fails (so Prometheus sees the broker down) if the event loop is stuck this long
_QUANTILES = (0.5, 0.99)

# One histogram for the process: the RPC wrappers observe it whether or not an endpoint serves it (a few
# microseconds against a gRPC call's hundreds), and each broker's registry exposes it.
RPC_DURATION = Histogram(
    "gpubroker_rpc_duration_seconds", "Time from an RPC's arrival to its answer (a stream's whole life), by status.",
    ["method", "code"], registry=None,
    buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
             30.0, 60.0))


def observe_rpc(method: str, code: str, seconds: float) -> None:
    """Record one served call: ``code`` is the gRPC status name ("OK", "NOT_FOUND", ...)."""
    RPC_DURATION.labels(method, code).observe(seconds)


@dataclass
class _TenantRow:
    tenant: str
    device: int
    memory_used: int
    memory_quota: int
    sessions: int
    device_seconds: float
    share: float
    queued: int
    inflight: int
    waits: dict[float, float]
    worker_up: bool
    restarts: int


@dataclass
class _Snapshot:
    rows: list[_TenantRow]
    draining: bool
    shared: dict[str, int]  # host memory each tenant maps through the shared-memory side channel (all devices)
    shared_limit: int
    # Per tenant: worker deaths charged to it (its crash budget), and how long its new sessions are refused.
    crashes: dict[str, int]
    backoff: dict[str, float]


def _recent_seconds(charges: Reversible[tuple[float, float]], since: float) -> float:
    """Device seconds charged at or after ``since``; charges are appended in time order, so walk back."""
    total = 0.0
    for stamp, seconds in reversed(charges):
        if stamp < since:
            break
        total += seconds
    return total


class BrokerCollector(Collector):
    """Reads the broker's state at scrape time, on its event loop."""

    def __init__(self, sessions: SessionManager, schedulers: dict[int, DeviceScheduler], pool: WorkerPool,
                 loop: asyncio.AbstractEventLoop) -> None:
        self.sessions = sessions
        self.schedulers = schedulers
        self.pool = pool
        self.loop = loop

    def snapshot(self) -> _Snapshot:
        """The figures by (tenant, device); must run on the event loop."""
        manager = self.sessions
        counts: dict[tuple[str, int], int] = {}
        for session in manager.sessions.values():
            key = (session.tenant, session.device)
            counts[key] = counts.get(key, 0) + 1
        # Configured tenants always have rows, so a tenant's figures are there (at 0) before its first session
        # and stay after its last; tenants removed by a reload keep theirs while anything remains of them.
        known = set(manager.config.tenants) | {t for t, _ in manager.memory_used} | {t for t, _ in counts}
        known |= {t for t, _ in self.pool.restarts_by} | set(manager.shared_used)
        rows = []
        since = time.monotonic() - SHARE_WINDOW_SECONDS  # the schedulers' clock
        for device, scheduler in sorted(self.schedulers.items()):
            recent = {t: _recent_seconds(u.charges, since) for t, u in scheduler.usage.items()}
            whole = sum(recent.values())
            for tenant in sorted(known | set(scheduler.usage)):
                use = scheduler.usage.get(tenant)
                waits = sorted(use.waits) if use is not None else []
                rows.append(_TenantRow(
                    tenant=tenant, device=device, memory_used=manager.used(tenant, device),
                    memory_quota=manager.quota(tenant, device), sessions=counts.get((tenant, device), 0),
                    device_seconds=use.device_seconds if use is not None else 0.0,
                    share=recent.get(tenant, 0.0) / whole if whole > 0 else 0.0,
                    queued=use.queued if use is not None else 0, inflight=use.inflight if use is not None else 0,
                    waits={q: waits[min(len(waits) - 1, int(q * len(waits)))] if waits else 0.0 for q in _QUANTILES},
                    worker_up=self.pool.live(tenant, device) is not None,
                    restarts=self.pool.restarts_by.get((tenant, device), 0)))
        crashes = self.pool.crashes
        tenants = sorted(known | set(crashes.total))
        return _Snapshot(rows, manager.draining, {t: manager.shared(t) for t in sorted(known)},
                         manager.config.max_shared_bytes_per_tenant, {t: crashes.total.get(t, 0) for t in tenants},
                         {t: crashes.backoff(t) or 0.0 for t in tenants})

    async def _fresh_snapshot(self) -> _Snapshot:
        await self.sessions.refresh_all()
        return self.snapshot()

    def collect(self) -> Iterator[Metric]:
        # Links allocate without the front: the workers' fresh memory figures first (bounded), then the snapshot.
        snap = asyncio.run_coroutine_threadsafe(self._fresh_snapshot(), self.loop).result(_SNAPSHOT_TIMEOUT)
        labels = ["tenant", "device"]

        def family(kind: type[CounterMetricFamily | GaugeMetricFamily], name: str, doc: str,
                   value: Callable[[_TenantRow], float]) -> Metric:
            metric = kind(name, doc, labels=labels)
            for row in snap.rows:
                metric.add_metric([row.tenant, str(row.device)], value(row))
            return metric

        yield family(GaugeMetricFamily, "gpubroker_memory_used_bytes",
                     "Device memory the tenant's sessions hold on the device.", lambda r: r.memory_used)
        yield family(GaugeMetricFamily, "gpubroker_memory_quota_bytes",
                     "The tenant's device-memory quota on the device.", lambda r: r.memory_quota)
        yield family(CounterMetricFamily, "gpubroker_device_seconds",
                     "Device time charged to the tenant by the fair scheduler (charged at its fences).",
                     lambda r: r.device_seconds)
        yield family(GaugeMetricFamily, "gpubroker_device_share",
                     f"The tenant's fraction of the device time charged in the last {SHARE_WINDOW_SECONDS:g} s.",
                     lambda r: r.share)
        yield family(GaugeMetricFamily, "gpubroker_sessions", "Open sessions.", lambda r: r.sessions)
        yield family(GaugeMetricFamily, "gpubroker_queue_depth",
                     "Device calls waiting for the tenant's turn on the device.", lambda r: r.queued)
        yield family(GaugeMetricFamily, "gpubroker_device_calls_inflight",
                     "Device calls holding a turn on the device.", lambda r: r.inflight)
        yield family(GaugeMetricFamily, "gpubroker_worker_up",
                     "1 while the tenant has a live worker process on the device.", lambda r: int(r.worker_up))
        yield family(CounterMetricFamily, "gpubroker_worker_restarts",
                     "Workers that died or were killed (crash, fatal device error, compile timeout); the tenant's "
                     "next session gets a fresh one.", lambda r: r.restarts)
        waits = GaugeMetricFamily("gpubroker_scheduler_wait_seconds",
                                  "Wait for a turn on the device, over the tenant's last 4096 device calls.",
                                  labels=[*labels, "quantile"])
        for row in snap.rows:
            for q, seconds in row.waits.items():
                waits.add_metric([row.tenant, str(row.device), str(q)], seconds)
        yield waits
        shared = GaugeMetricFamily("gpubroker_shared_memory_bytes",
                                   "Host memory the tenant maps through the same-host shared-memory side channel, "
                                   "summed over its sessions on every device.", labels=["tenant"])
        for name, used in snap.shared.items():
            shared.add_metric([name], used)
        yield shared
        yield GaugeMetricFamily("gpubroker_shared_memory_limit_bytes",
                                "How much of it each tenant may map (max_shared_bytes_per_tenant).",
                                value=snap.shared_limit)
        crashes = CounterMetricFamily(
            "gpubroker_tenant_worker_crashes", "Worker deaths charged to the tenant (its kernels, compiles or lies, "
            "or a kill for the kernel time limit): its crash budget. Never counted against the device.",
            labels=["tenant"])
        backoff = GaugeMetricFamily(
            "gpubroker_tenant_backoff_seconds",
            "Seconds until the tenant, over its crash budget, may open sessions again (0: it may).", labels=["tenant"])
        for tenant, count in snap.crashes.items():
            crashes.add_metric([tenant], count)
            backoff.add_metric([tenant], snap.backoff[tenant])
        yield crashes
        yield backoff
        yield GaugeMetricFamily("gpubroker_draining", "1 while the broker refuses new sessions.",
                                value=int(snap.draining))


class MetricsServer:
    """``/metrics`` over HTTP on a registry of this broker's own."""

    def __init__(self, collector: BrokerCollector) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(collector)
        self.registry.register(RPC_DURATION)
        ProcessCollector(registry=self.registry)
        self.address = ""
        self._httpd: WSGIServer | None = None

    def start(self, listen: str) -> str:
        """Bind ``HOST:PORT`` (port 0 picks one) and return the bound address."""
        try:
            host, port = split_host_port(listen)
        except ValueError as exc:
            raise InvalidArgument(f"metrics_listen: {exc}") from None
        try:
            httpd, _thread = start_http_server(port, host, registry=self.registry)
        except OSError as exc:
            raise FailedPrecondition(f"metrics_listen {listen}: {exc.strerror or exc}") from None
        self._httpd = httpd
        bound = httpd.server_port
        self.address = f"[{host}]:{bound}" if ":" in host else f"{host}:{bound}"
        return self.address

    async def stop(self) -> None:
        httpd = self._httpd
        self._httpd = None
        if httpd is not None:
            await asyncio.to_thread(httpd.shutdown)
            httpd.server_close()


def serve_metrics(listen: str, sessions: SessionManager, schedulers: dict[int, DeviceScheduler],
                  pool: WorkerPool) -> MetricsServer:
    """Start the endpoint for a running broker (call on its event loop)."""
    server = MetricsServer(BrokerCollector(sessions, schedulers, pool, asyncio.get_running_loop()))
    server.start(listen)
    log.info("metrics on http://%s/metrics (unauthenticated: keep it on loopback or a monitoring network)",
             server.address)
    return server
