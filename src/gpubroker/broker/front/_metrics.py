"""Prometheus metrics: per-tenant memory, device time, shares, sessions, queues and waits; RPC latencies; devices'
health and memory; the build; and the probes ``/livez`` and ``/readyz`` on the same listener.

The tenant figures are read from the live sessions, schedulers and worker pool at scrape time, on the broker's
event loop (they are only ever changed there), so a scrape sees one consistent moment and costs nothing between
scrapes. The endpoint is a small HTTP/1.1 server on the same event loop (``MetricsServer``): unauthenticated by
design, so bounded in connections, time, request size and refreshes (no thread per connection, no refresh per
scrape), on a registry of its own. It accepts through the front's one accept loop (``listeners.Acceptor``), which
names each peer as every listener does: a local one by its uid, a remote one by its network.
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import itertools
import logging
import math
import os
import platform
import socket
import time
from collections.abc import Callable, Iterator, Reversible, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, TypeVar

from prometheus_client import CollectorRegistry, Histogram, ProcessCollector, exposition
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.openmetrics import exposition as openmetrics_exposition
from prometheus_client.registry import Collector

from gpubroker import __version__
from gpubroker.broker.front._sessions import END_REASONS, SessionManager
from gpubroker.broker.front.auth import AUTH_FAILURE_KINDS, RateLimitedLog
from gpubroker.broker.front.listen import BACKLOG, tcp_listeners
from gpubroker.broker.front.listeners import Acceptor, OffLoop, Peer, PeerRate, take_place_of
from gpubroker.broker.front.scheduler import WAIT_BUCKETS, DeviceScheduler
from gpubroker.broker.front.workers import WorkerPool
from gpubroker.wire.addresses import TcpAddress, parse_host_port
from gpubroker.wire.errors import FailedPrecondition, InvalidArgument
from gpubroker.wire.types import DeviceInfo

__all__ = ["METRICS", "RPC_BUCKETS", "RPC_DURATION", "RPC_METRIC", "SCHEDULER_WAIT", "SHARE_WINDOW_SECONDS",
           "BrokerCollector", "MetricSpec", "MetricsLimits", "MetricsServer", "build_commit", "observe_rpc",
           "serve_metrics"]

log = logging.getLogger("gpubroker.metrics")
audit = logging.getLogger("gpubroker.audit")
T = TypeVar("T")

SHARE_WINDOW_SECONDS = 10.0  # gpubroker_device_share covers this much recent device time


@dataclass(frozen=True)
class MetricSpec:
    """One metric family the broker exposes: what ``BrokerCollector.collect`` yields, and the docs list."""

    name: str  # the family's name; a counter's samples add ``_total``, a histogram's ``_bucket``, ``_sum``, ``_count``
    type: Literal["gauge", "counter", "histogram"]
    labels: tuple[str, ...]
    help: str

    def family(self, value: float | None = None) -> CounterMetricFamily | GaugeMetricFamily:
        """An empty family to fill with ``add_metric`` (or, without labels, holding ``value``); not a histogram's
        (``histogram``)."""
        assert self.type != "histogram"
        kind: type[CounterMetricFamily | GaugeMetricFamily] = (
            CounterMetricFamily if self.type == "counter" else GaugeMetricFamily)
        if value is not None:
            return kind(self.name, self.help, value=value)
        return kind(self.name, self.help, labels=list(self.labels))


_TD = ("tenant", "device")
# Every family, in the order a scrape shows them: BrokerCollector.collect yields exactly these (the docs'
# metrics list is generated from this table and RPC_METRIC, and a test checks a live scrape against both).
MEMORY_USED = MetricSpec("gpubroker_memory_used_bytes", "gauge", _TD,
                         "Device memory the tenant's sessions hold on the device.")
MEMORY_QUOTA = MetricSpec("gpubroker_memory_quota_bytes", "gauge", _TD,
                          "The tenant's device-memory quota on the device.")
DEVICE_SECONDS = MetricSpec("gpubroker_device_seconds", "counter", _TD,
                            "Device time charged to the tenant by the fair scheduler (charged at its fences).")
DEVICE_SHARE = MetricSpec("gpubroker_device_share", "gauge", _TD,
                          f"The tenant's fraction of the device time charged in the last {SHARE_WINDOW_SECONDS:g} s.")
SESSIONS = MetricSpec("gpubroker_sessions", "gauge", _TD, "Open sessions.")
QUEUE_DEPTH = MetricSpec("gpubroker_queue_depth", "gauge", _TD,
                         "Device calls waiting for the tenant's turn on the device.")
INFLIGHT = MetricSpec("gpubroker_device_calls_inflight", "gauge", _TD, "Device calls holding a turn on the device.")
WORKER_UP = MetricSpec("gpubroker_worker_up", "gauge", _TD,
                       "1 while the tenant has a live worker process on the device.")
WORKER_RESTARTS = MetricSpec("gpubroker_worker_restarts", "counter", _TD,
                             "Workers that died or were killed (crash, fatal device error, compile timeout); the "
                             "tenant's next session gets a fresh one.")
SCHEDULER_WAIT = MetricSpec("gpubroker_scheduler_wait_seconds", "histogram", _TD,
                            "Wait of each of the tenant's device calls for its turn on the device (0 when it "
                            "already held it), since the broker started.")
LAUNCHES = MetricSpec("gpubroker_kernel_launches", "counter", _TD,
                      "Kernel launches the tenant's workers ran (the tenant's own kernels; library and torch "
                      "operators are not counted), as its workers report them at each refresh.")
BYTES_COPIED = MetricSpec("gpubroker_copied_bytes", "counter", (*_TD, "direction"),
                          "Bytes the tenant's workers copied: direction h2d (host to device: writes, shared-memory "
                          "copies in), d2h (device to host) or d2d (within the device), as its workers report "
                          "them at each refresh.")
COPY_DIRECTIONS = ("h2d", "d2h", "d2d")
SESSIONS_OPENED = MetricSpec("gpubroker_sessions_opened", "counter", _TD, "Sessions opened.")
SESSIONS_ENDED = MetricSpec("gpubroker_sessions_ended", "counter", (*_TD, "how"),
                            "Sessions ended: how closed (by the client), expired (no heartbeat within the lease) "
                            "or ended (by an admin, a drain, the broker's stop, its tenant's removal).")
SHARED_MEMORY = MetricSpec("gpubroker_shared_memory_bytes", "gauge", ("tenant",),
                           "Host memory the tenant maps as same-host shared-memory segments and links' "
                           "rings, summed over its sessions on every device, and CopyPeer's host staging while "
                           "its workers hold it.")
SHARED_LIMIT = MetricSpec("gpubroker_shared_memory_limit_bytes", "gauge", ("tenant",),
                          "How much of it the tenant may map: its shared_memory (its memory quota unless set), "
                          "within max_shared_bytes_per_tenant.")
TENANT_CRASHES = MetricSpec("gpubroker_tenant_worker_crashes", "counter", ("tenant",),
                            "Worker deaths charged to the tenant (its kernels, compiles or lies, or a kill for the "
                            "kernel time limit): its crash budget. Never counted against the device.")
TENANT_BACKOFF = MetricSpec("gpubroker_tenant_backoff_seconds", "gauge", ("tenant",),
                            "Seconds until the tenant, over its crash budget, may open sessions again (0: it may).")
MEMORY_KILLS = MetricSpec("gpubroker_device_memory_kills", "counter", (*_TD, "cause"),
                          "Workers killed for device memory, each also one of the tenant's worker crashes: cause "
                          "nvml (on CUDA, NVML counted more on a device than the tenant's quota there plus "
                          "device_memory_headroom) or report (the worker reported more in use than its quota: its "
                          "own accounting was overwritten).")
MEMORY_KILL_CAUSES = ("nvml", "report")
OUTPUT_DROPPED = MetricSpec("gpubroker_worker_output_dropped_bytes", "counter", ("tenant",),
                            "Bytes its workers wrote on stdout and stderr that were not logged: over the per-worker "
                            "rate limit, or past the longest line kept.")
DRAINING = MetricSpec("gpubroker_draining", "gauge", (), "1 while the broker refuses new sessions.")
BUILD_INFO = MetricSpec("gpubroker_build_info", "gauge", ("version", "commit", "python", "backend"),
                        "Always 1: the broker's version, the commit it was built from (GPUBROKER_COMMIT, or the "
                        "source checkout's HEAD; empty when unknown), the Python it runs on and its backend.")
DEVICE_HEALTHY = MetricSpec("gpubroker_device_healthy", "gauge", ("device",),
                            "1 while the device takes new sessions as far as its health goes (0: its workers keep "
                            "failing, or a critical Xid); a drain does not change it (gpubroker_draining does).")
DEVICE_MEMORY_TOTAL = MetricSpec("gpubroker_device_memory_total_bytes", "gauge", ("device",),
                                 "The device's memory, as its backend reports it.")
DEVICE_MEMORY_USED = MetricSpec("gpubroker_device_memory_used_bytes", "gauge", ("device",),
                                "Device memory every tenant's sessions hold on the device, summed "
                                "(gpubroker_memory_used_bytes over the tenants).")
AUTH_FAILURES = MetricSpec("gpubroker_auth_failures", "counter", ("credential",),
                           "Failed authentications: credential token (missing, unknown or wrong) or certificate "
                           "(a client certificate that maps to no tenant). Each is also an audit line.")
ENDPOINT_REFUSALS = MetricSpec("gpubroker_endpoint_refusals", "counter", ("endpoint", "reason"),
                               "Connections, requests and streams the unauthenticated endpoints refused or cut: "
                               "metrics (over max_metrics_connections or its per-peer cap, too slow, too large or not "
                               "a request, over the per-peer request rate), health (Watch and reflection streams over "
                               "max_health_streams or its per-peer cap), grpc (connections refused as they were "
                               "accepted: over max_grpc_connections or max_grpc_connections_per_peer; connections that "
                               "never authenticated, closed after grpc_unauthenticated_seconds or evicted for a "
                               "newcomer at max_grpc_connections; calls over "
                               "max_grpc_calls_per_peer_per_second, whose connection is cut). Any endpoint (grpc, "
                               "link, metrics, relay): connections over max_connections_per_peer_per_second.")
METRICS: tuple[MetricSpec, ...] = (MEMORY_USED, MEMORY_QUOTA, DEVICE_SECONDS, DEVICE_SHARE, SESSIONS, QUEUE_DEPTH,
                                   INFLIGHT, WORKER_UP, WORKER_RESTARTS, SCHEDULER_WAIT, LAUNCHES, BYTES_COPIED,
                                   SESSIONS_OPENED, SESSIONS_ENDED, SHARED_MEMORY, SHARED_LIMIT, TENANT_CRASHES,
                                   TENANT_BACKOFF, MEMORY_KILLS, OUTPUT_DROPPED, DRAINING, BUILD_INFO, DEVICE_HEALTHY,
                                   DEVICE_MEMORY_TOTAL, DEVICE_MEMORY_USED, AUTH_FAILURES, ENDPOINT_REFUSALS)
# Every (endpoint, reason) of gpubroker_endpoint_refusals, at 0 from the start (so rate() sees the first one).
METRICS_REASONS = ("connections", "peer connections", "timeout", "bad request", "rate", "evicted")
HEALTH_REASONS = ("streams", "peer streams", "requests", "peer requests", "evicted streams", "evicted requests")


# One histogram for the process: the RPC wrappers observe it whether or not an endpoint serves it (a few
# microseconds against a gRPC call's hundreds), and each broker's registry exposes it.
RPC_METRIC = MetricSpec("gpubroker_rpc_duration_seconds", "histogram", ("method", "code"),
                        "Time from an RPC's arrival to its answer (a stream's whole life), by status.")
RPC_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
               30.0, 60.0)
RPC_DURATION = Histogram(RPC_METRIC.name, RPC_METRIC.help, list(RPC_METRIC.labels), registry=None,
                         buckets=RPC_BUCKETS)


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
    wait_counts: list[int]  # by bucket of WAIT_BUCKETS, then over them all (not cumulative)
    wait_sum: float
    worker_up: bool
    restarts: int
    done: list[int]  # launches, bytes h2d, d2h, d2d
    opened: int
    ended: dict[str, int]  # by END_REASONS


@dataclass
class _Snapshot:
    rows: list[_TenantRow]
    draining: bool
    shared: dict[str, int]  # host memory each tenant maps as shared-memory segments (all devices)
    shared_limit: dict[str, int]  # what each of those tenants may map
    # Per tenant: worker deaths charged to it (its crash budget), and how long its new sessions are refused.
    crashes: dict[str, int]
    backoff: dict[str, float]
    output_dropped: dict[str, int]  # bytes of its workers' output not logged (the rate limit)
    memory_kills: dict[tuple[str, int, str], int]  # workers killed for device memory, by (tenant, device, cause)
    device_healthy: list[bool]  # by device
    auth_failures: dict[str, int]  # by AUTH_FAILURE_KINDS


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
                 refusals: dict[tuple[str, str], int], devices: Sequence[DeviceInfo] = (),
                 device_problem: Callable[[int], str | None] | None = None,
                 auth_failures: dict[str, int] | None = None) -> None:
        self.sessions = sessions
        self.devices = list(devices)  # (as clients number them)
        self.device_problem = device_problem or (lambda device: None)  # (BrokerHealth.problem)
        self.auth_failures = auth_failures if auth_failures is not None else dict.fromkeys(AUTH_FAILURE_KINDS, 0)
        backend = self.devices[0].backend if self.devices else ""
        self.build = (__version__, build_commit(), platform.python_version(), backend)
        self.schedulers = schedulers
        self.pool = pool
        # What ``collect`` shows: the endpoint sets it to a fresh snapshot just before it renders a page.
        self.current: _Snapshot | None = None
        # Connections and streams refused by the unauthenticated endpoints, by (endpoint, reason): the metrics
        # endpoint's own and the health service's (server/_health.py).
        self.refusals = refusals

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
        known |= {t for t, _ in self.pool.restarts_by} | set(manager.shared_used) | set(manager.shared_held)
        known |= set(self.pool.output_dropped)
        known |= {t for t, _, _ in self.pool.memory_kills}
        rows = []
        since = time.monotonic() - SHARE_WINDOW_SECONDS  # the schedulers' clock
        for device, scheduler in sorted(self.schedulers.items()):
            recent = {t: _recent_seconds(u.charges, since) for t, u in scheduler.usage.items()}
            whole = sum(recent.values())
            for tenant in sorted(known | set(scheduler.usage)):
                use = scheduler.usage.get(tenant)
                rows.append(_TenantRow(
                    tenant=tenant, device=device, memory_used=manager.used(tenant, device),
                    memory_quota=manager.quota(tenant, device), sessions=counts.get((tenant, device), 0),
                    device_seconds=use.device_seconds if use is not None else 0.0,
                    share=recent.get(tenant, 0.0) / whole if whole > 0 else 0.0,
                    queued=use.queued if use is not None else 0, inflight=use.inflight if use is not None else 0,
                    wait_counts=list(use.wait_counts) if use is not None else [0] * (len(WAIT_BUCKETS) + 1),
                    wait_sum=use.wait_sum if use is not None else 0.0,
                    worker_up=self.pool.live(tenant, device) is not None,
                    restarts=self.pool.restarts_by.get((tenant, device), 0),
                    done=list(manager.done.get((tenant, device), (0, 0, 0, 0))),
                    opened=manager.opened.get((tenant, device), 0),
                    ended={how: manager.ended.get((tenant, device, how), 0) for how in END_REASONS}))
        crashes = self.pool.crashes
        tenants = sorted(known | set(crashes.total))
        return _Snapshot(rows, manager.draining, {t: manager.shared(t) for t in sorted(known)},
                         {t: manager.config.shared_limit(t)[0] for t in sorted(known)},
                         {t: crashes.total.get(t, 0) for t in tenants},
                         {t: crashes.backoff(t) or 0.0 for t in tenants},
                         {t: self.pool.output_dropped.get(t, 0) for t in sorted(known)},
                         {(r.tenant, r.device, cause): self.pool.memory_kills.get((r.tenant, r.device, cause), 0)
                          for r in rows for cause in MEMORY_KILL_CAUSES},
                         [self.device_problem(d) is None for d in range(len(self.devices))],
                         dict(self.auth_failures))

    async def fresh_snapshot(self) -> _Snapshot:
        """Fresh figures: links allocate without the front, so the workers' memory figures first (each bounded)."""
        await self.sessions.refresh_all()
        return self.snapshot()

    def collect(self) -> Iterator[Metric]:
        snap = self.current
        if snap is None:
            return
        def per_row(spec: MetricSpec, value: Callable[[_TenantRow], float]) -> Metric:
            metric = spec.family()
            for row in snap.rows:
                metric.add_metric([row.tenant, str(row.device)], value(row))
            return metric

        yield per_row(MEMORY_USED, lambda r: r.memory_used)
        yield per_row(MEMORY_QUOTA, lambda r: r.memory_quota)
        yield per_row(DEVICE_SECONDS, lambda r: r.device_seconds)
        yield per_row(DEVICE_SHARE, lambda r: r.share)
        yield per_row(SESSIONS, lambda r: r.sessions)
        yield per_row(QUEUE_DEPTH, lambda r: r.queued)
        yield per_row(INFLIGHT, lambda r: r.inflight)
        yield per_row(WORKER_UP, lambda r: int(r.worker_up))
        yield per_row(WORKER_RESTARTS, lambda r: r.restarts)
        waits = HistogramMetricFamily(SCHEDULER_WAIT.name, SCHEDULER_WAIT.help, labels=list(SCHEDULER_WAIT.labels))
        for row in snap.rows:
            cumulative = list(itertools.accumulate(row.wait_counts))
            buckets = [(f"{bound:g}", float(n)) for bound, n in zip(WAIT_BUCKETS, cumulative, strict=False)]
            buckets.append(("+Inf", float(cumulative[-1])))
            waits.add_metric([row.tenant, str(row.device)], buckets, row.wait_sum)
        yield waits
        yield per_row(LAUNCHES, lambda r: r.done[0])
        copied = BYTES_COPIED.family()
        for row in snap.rows:
            for direction, nbytes in zip(COPY_DIRECTIONS, row.done[1:], strict=True):
                copied.add_metric([row.tenant, str(row.device), direction], nbytes)
        yield copied
        yield per_row(SESSIONS_OPENED, lambda r: r.opened)
        ended = SESSIONS_ENDED.family()
        for row in snap.rows:
            for how, count in row.ended.items():
                ended.add_metric([row.tenant, str(row.device), how], count)
        yield ended
        shared = SHARED_MEMORY.family()
        for name, used in snap.shared.items():
            shared.add_metric([name], used)
        yield shared
        limits = SHARED_LIMIT.family()
        for name, limit in snap.shared_limit.items():
            limits.add_metric([name], limit)
        yield limits
        crashes = TENANT_CRASHES.family()
        backoff = TENANT_BACKOFF.family()
        for tenant, count in snap.crashes.items():
            crashes.add_metric([tenant], count)
            backoff.add_metric([tenant], snap.backoff[tenant])
        yield crashes
        yield backoff
        kills = MEMORY_KILLS.family()
        for (tenant, device, cause), count in snap.memory_kills.items():
            kills.add_metric([tenant, str(device), cause], count)
        yield kills
        dropped = OUTPUT_DROPPED.family()
        for tenant, nbytes in snap.output_dropped.items():
            dropped.add_metric([tenant], nbytes)
        yield dropped
        yield DRAINING.family(value=int(snap.draining))
        build = BUILD_INFO.family()
        build.add_metric(list(self.build), 1)
        yield build
        healthy = DEVICE_HEALTHY.family()
        memory_total = DEVICE_MEMORY_TOTAL.family()
        memory_used = DEVICE_MEMORY_USED.family()
        for device, ok in enumerate(snap.device_healthy):
            healthy.add_metric([str(device)], int(ok))
            memory_total.add_metric([str(device)], self.devices[device].total_memory)
            memory_used.add_metric([str(device)], sum(r.memory_used for r in snap.rows if r.device == device))
        yield healthy
        yield memory_total
        yield memory_used
        failures = AUTH_FAILURES.family()
        for kind, count in snap.auth_failures.items():
            failures.add_metric([kind], count)
        yield failures
        refused = ENDPOINT_REFUSALS.family()
        for (endpoint, reason), count in sorted(self.refusals.items()):
            refused.add_metric([endpoint, reason], count)
        yield refused


@dataclass
class _Page:
    """One refresh of the figures and the pages rendered from it (by content type and encoding), shared by every
    scrape that waited for it."""

    snapshot: _Snapshot
    bodies: dict[tuple[str, bool], bytes] = field(default_factory=dict)


@dataclass(frozen=True)
class MetricsLimits:
    max_connections: int = 16
    max_connections_per_peer: int = 4
    request_timeout: float = 5.0  # for the request head, and again for taking the answer
    refresh_interval: float = 1.0  # the figures are taken at most once per this
    requests_per_peer_per_second: float = 10.0  # a peer's answers are paced to this, whatever it asks for


class MetricsServer:
    """``/metrics`` (and the probes ``/livez``, ``/readyz``) over HTTP/1.1 on the broker's event loop, on a registry
    of this broker's own.

    The endpoint is unauthenticated by design, so everything it does for a peer is bounded: at most
    ``max_connections`` connections (``max_connections_per_peer`` from one peer: a local user by its uid, a remote
    host by its /24 or /64; more are closed as they are accepted), a request head of at most 8 KiB that must
    arrive within ``request_timeout`` (and an answer that must be taken within it), one request per connection,
    no thread for any of them, and each peer's answers paced to ``requests_per_peer_per_second`` (a request waits
    its turn, at no cost, so a peer asking in a loop for any path, even a missing one, gets no more of the event
    loop than that). The figures are taken at most once per ``refresh_interval``: a scrape always gets figures
    taken after it arrived, and every scrape waiting meanwhile shares the next refresh and its rendered page, so a
    flood of scrapes costs the workers one ``usage`` round trip per interval and the event loop little more than
    reading requests.
    """

    def __init__(self, collector: BrokerCollector, limits: MetricsLimits | None = None,
                 connection_rate: PeerRate | None = None, accepts: OffLoop | None = None,
                 ready: Callable[[], str | None] | None = None) -> None:
        self.collector = collector
        # Why the broker takes no new sessions, None when it does (BrokerHealth.not_ready): /readyz.
        self.ready: Callable[[], str | None] = ready or (lambda: None)
        self.connection_rate = connection_rate  # (how fast each peer may connect: the Acceptor's)
        self.accepts = accepts  # (where the Acceptors accept: the front's acceptor process, if not on the loop)
        self.limits = limits or MetricsLimits()
        self.registry = CollectorRegistry()
        self.registry.register(collector)
        self.registry.register(RPC_DURATION)
        ProcessCollector(registry=self.registry)
        self.address = ""
        for reason in METRICS_REASONS:
            collector.refusals.setdefault(("metrics", reason), 0)
        self._acceptors: list[Acceptor] = []
        self._connections = 0  # held, from their accept to their close
        self._open: dict[str, int] = {}  # peer (Peer.key) -> connections held
        self._held: dict[str, dict[asyncio.Task[None], None]] = {}  # peer -> its connections' handlers, oldest first
        self._evicted: set[asyncio.Task[None]] = set()  # ended for a newcomer: their places already given back
        self._writers: set[asyncio.StreamWriter] = set()
        self._handlers: set[asyncio.Task[None]] = set()
        self._next_turn: dict[str, float] = {}  # peer -> when its next answer may go (the event loop's clock)
        self._refresh: asyncio.Task[_Page] | None = None
        self._refresh_started = -math.inf  # (the event loop's clock)
        self._refusals = RateLimitedLog(audit)

    async def start(self, listen: str) -> str:
        """Bind ``HOST:PORT`` (port 0 picks one) and return the bound address."""
        try:
            wanted = parse_host_port(listen)
        except ValueError as exc:
            raise InvalidArgument(f"metrics_listen: {exc}") from None
        try:
            socks = tcp_listeners(wanted.host, wanted.port, BACKLOG)
        except OSError as exc:
            raise FailedPrecondition(f"metrics_listen {listen}: {exc.strerror or exc}") from None
        self.address = str(TcpAddress(wanted.host, socks[0].getsockname()[1]))
        for sock in socks:
            acceptor = Acceptor(sock, f"metrics:{self.address}", self._admit, "metrics", self.connection_rate,
                                self.accepts)
            self._acceptors.append(acceptor)
            acceptor.start()
        return self.address

    async def stop(self) -> None:
        acceptors, self._acceptors = self._acceptors, []
        if not acceptors:
            return
        for acceptor in acceptors:
            acceptor.close()
        for writer in list(self._writers):
            writer.transport.abort()
        for task in list(self._handlers):  # (those waiting for their turn or for a refresh)
            task.cancel()
        await asyncio.gather(*self._handlers, return_exceptions=True)
        if self._refresh is not None and not self._refresh.done():
            self._refresh.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._refresh

    # -- connections -------------------------------------------------------------------------------
    def _refuse(self, reason: str, peer: str, detail: str) -> None:
        self.collector.refusals[("metrics", reason)] += 1
        self._refusals.warning(f"metrics {reason}", "action=refuse-connection listener=metrics peer=%s reason=%s",
                               peer, detail)

    def _admit(self, conn: socket.socket, accepted: Peer) -> bool:
        """Serve ``conn`` (from the acceptor), or close it at once past a cap; go on accepting either way."""
        limits = self.limits
        peer = _name(accepted)
        key = accepted.key
        if self._connections >= limits.max_connections and not self._evict_for(key, peer):
            self._refuse("connections", peer, f"over max_metrics_connections ({limits.max_connections})")
            conn.close()
            return True
        if self._open.get(key, 0) >= limits.max_connections_per_peer:
            self._refuse("peer connections", peer,
                         f"{key} holds {self._open[key]}: max_metrics_connections_per_peer "
                         f"({limits.max_connections_per_peer})")
            conn.close()
            return True
        self._connections += 1
        self._open[key] = self._open.get(key, 0) + 1
        task = asyncio.get_running_loop().create_task(self._connection(conn, key, peer))
        self._handlers.add(task)
        task.add_done_callback(self._handlers.discard)
        self._held.setdefault(key, {})[task] = None
        return True

    def _evict_for(self, key: str, peer: str) -> bool:
        """At max_metrics_connections, end the oldest connection of the peer holding the most, if it holds at
        least two more than ``key`` (four local users at their share held all 16, and every scrape was refused);
        whether one was ended (its places given back now)."""
        if self._open.get(key, 0) >= self.limits.max_connections_per_peer:
            return False
        found = take_place_of(self._held, key)
        if found is None:
            return False
        most, victim = found
        self._uncount(most, victim)
        self._evicted.add(victim)
        victim.cancel()
        self._refuse("evicted", most, f"max_metrics_connections ({self.limits.max_connections}) open: its place "
                     f"taken by {peer} ({most} holds the most)")
        return True

    def _uncount(self, key: str, task: asyncio.Task[None]) -> None:
        self._connections -= 1
        self._open[key] -= 1
        if not self._open[key]:
            del self._open[key]
        held = self._held.get(key)
        if held is not None:
            held.pop(task, None)
            if not held:
                del self._held[key]

    async def _connection(self, conn: socket.socket, key: str, peer: str) -> None:
        writer: asyncio.StreamWriter | None = None
        try:
            reader, writer = await asyncio.open_connection(sock=conn, limit=_MAX_HEAD)
            self._writers.add(writer)
            # (drain() then waits until the whole answer is with the kernel, not just below the usual 64 KiB)
            writer.transport.set_write_buffer_limits(high=0)
            await self._exchange(reader, writer, key, peer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass  # the peer went away
        finally:
            task = asyncio.current_task()
            if task in self._evicted:
                self._evicted.discard(task)  # (its places went back as it was ended)
            elif task is not None:
                self._uncount(key, task)
            if writer is None:
                conn.close()
            else:
                self._writers.discard(writer)
                # One request per connection. An answer the peer did not take in time is dropped (a graceful close
                # would keep the connection until the peer reads it).
                if writer.transport.get_write_buffer_size():
                    writer.transport.abort()
                else:
                    writer.close()

    async def _exchange(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, peer_key: str,
                        peer: str) -> None:
        timeout = self.limits.request_timeout
        try:
            async with asyncio.timeout(timeout):
                head = await reader.readuntil(b"\r\n\r\n")
        except TimeoutError:
            self._refuse("timeout", peer, f"no whole request within metrics_request_timeout_seconds ({timeout:g})")
            return
        except asyncio.LimitOverrunError:
            self._refuse("bad request", peer, f"a request head over {_MAX_HEAD} bytes")
            await self._answer(writer, 431, b"request header fields too large\n")
            return
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
            self._refuse("bad request", peer, "not an HTTP/1 request")
            await self._answer(writer, 400, b"bad request\n")
            return
        method, target = parts[0], parts[1]
        head_only = method == "HEAD"  # (every answer to a HEAD: its status and headers alone)
        if not await self._turn(peer_key):
            self._refuse("rate", peer, "over metrics_requests_per_peer_per_second")
            await self._answer(writer, 429, b"too many requests from this peer\n", extra=[("Retry-After", "1")],
                               head_only=head_only)
            return
        headers = {}
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if sep:
                headers[name.strip().lower()] = value.strip()
        path = target.split("?", 1)[0]
        if method not in ("GET", "HEAD"):
            await self._answer(writer, 405, b"only GET and HEAD\n", extra=[("Allow", "GET, HEAD")])
            return
        if path == "/livez":
            # Answered on the event loop every call and stream is served on: an answer means the loop turns.
            await self._answer(writer, 200, b"ok\n", head_only=head_only)
            return
        if path == "/readyz":
            problem = self.ready()
            if problem is None:
                await self._answer(writer, 200, b"ready\n", head_only=head_only)
            else:
                await self._answer(writer, 503, f"not ready: {problem}\n".encode(), head_only=head_only)
            return
        if path != "/metrics":
            await self._answer(writer, 404, b"not found: this endpoint serves /metrics, /livez and /readyz\n",
                               head_only=head_only)
            return
        encoder, content_type = _encoder(headers.get("accept", ""))
        gzipped = "gzip" in headers.get("accept-encoding", "")
        try:
            page = await self._fresh_page()
        except Exception:
            log.exception("taking the metrics figures failed")
            await self._answer(writer, 503, b"the figures could not be taken; see the broker's log\n",
                               head_only=head_only)
            return
        key = (content_type, gzipped)
        body = page.bodies.get(key)
        if body is None:
            self.collector.current = page.snapshot
            try:
                body = encoder(self.registry)
            finally:
                self.collector.current = None
            page.bodies[key] = body = gzip.compress(body) if gzipped else body
        extra = [("Content-Encoding", "gzip")] if gzipped else []
        await self._answer(writer, 200, body, content_type, extra, head_only=head_only)

    async def _answer(self, writer: asyncio.StreamWriter, status: int, body: bytes,
                      content_type: str = "text/plain; charset=utf-8", extra: list[tuple[str, str]] | None = None,
                      head_only: bool = False) -> None:
        reason = _REASONS.get(status, "")
        lines = [f"HTTP/1.1 {status} {reason}", f"Content-Type: {content_type}", f"Content-Length: {len(body)}",
                 "Connection: close", *(f"{name}: {value}" for name, value in extra or [])]
        writer.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"))
        if not head_only:
            writer.write(body)
        try:
            async with asyncio.timeout(self.limits.request_timeout):
                await writer.drain()
        except TimeoutError:
            self._refuse("timeout", str(writer.get_extra_info("peername")), "did not take its answer in time")

    async def _turn(self, peer: str) -> bool:
        """Wait for this peer's (``Peer.key``) next turn to be answered; False if that is further off than a
        request may take."""
        loop = asyncio.get_running_loop()
        now = loop.time()
        if len(self._next_turn) > _MAX_PACED_PEERS:  # forget the peers whose turn has come anyway
            self._next_turn = {p: t for p, t in self._next_turn.items() if t > now}
        turn = max(now, self._next_turn.get(peer, now))
        if turn - now > self.limits.request_timeout:
            return False
        self._next_turn[peer] = turn + 1.0 / self.limits.requests_per_peer_per_second
        if turn > now:
            await asyncio.sleep(turn - now)
        return True

    # -- figures -----------------------------------------------------------------------------------
    async def _fresh_page(self) -> _Page:
        """A page of figures taken after this call: the refresh under way if it began since, else the next one
        (no sooner than ``refresh_interval`` after the last began)."""
        loop = asyncio.get_running_loop()
        arrived = loop.time()
        while True:
            task = self._refresh
            if task is not None and self._refresh_started >= arrived:
                return await asyncio.shield(task)  # (one scrape giving up must not cancel the others' refresh)
            if task is not None and not task.done():
                with contextlib.suppress(Exception):
                    await asyncio.shield(task)  # it began before this scrape: wait for it, then take the next
                continue
            wait = self._refresh_started + self.limits.refresh_interval - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
                continue
            self._refresh_started = loop.time()
            self._refresh = loop.create_task(self._take(), name="metrics refresh")

    async def _take(self) -> _Page:
        return _Page(await self.collector.fresh_snapshot())


def build_commit() -> str:
    """The commit the broker was built from: ``GPUBROKER_COMMIT`` (an image build sets it), else the HEAD of the git
    checkout the package runs from (an editable install), else ""."""
    commit = os.environ.get("GPUBROKER_COMMIT", "").strip()
    if commit:
        return commit[:64]
    for parent in Path(__file__).resolve().parents:
        git = parent / ".git"
        if git.is_dir():
            try:
                head = (git / "HEAD").read_text().strip()
                if not head.startswith("ref: "):
                    return head[:40]
                ref = head[5:]
                loose = git / ref
                if loose.is_file():
                    return loose.read_text().strip()[:40]
                for line in (git / "packed-refs").read_text().splitlines():
                    if line.endswith(" " + ref):
                        return line.split(" ", 1)[0][:40]
            except OSError:
                pass
            return ""
    return ""


def _name(peer: Peer) -> str:
    """A peer as the audit lines name it: its address, and its uid where the kernel names it."""
    return f"{peer.address}" + (f" uid={peer.uid}" if peer.uid >= 0 else "")


_MAX_HEAD = 8192  # bytes of request line and headers; a scrape sends a few hundred
_MAX_PACED_PEERS = 4096  # peers whose next turn is remembered before the past ones are forgotten
_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed", 429: "Too Many Requests",
            431: "Request Header Fields Too Large", 503: "Service Unavailable"}


async def serve_metrics(listen: str, collector: BrokerCollector, limits: MetricsLimits | None = None,
                        connection_rate: PeerRate | None = None, accepts: OffLoop | None = None,
                        ready: Callable[[], str | None] | None = None) -> MetricsServer:
    """Start the endpoint for a running broker (call on its event loop); ``ready`` says why the broker takes no new
    sessions (None when it does), for ``/readyz``."""
    server = MetricsServer(collector, limits, connection_rate, accepts, ready)
    await server.start(listen)
    log.info("metrics on http://%s/metrics, probes on /livez and /readyz (unauthenticated: keep it on loopback or a "
             "monitoring network)", server.address)
    return server


def _encoder(accept: str) -> tuple[Callable[[CollectorRegistry], bytes], str]:
    """One of two fixed formats, by the Accept header: OpenMetrics if asked for, else Prometheus' text. Nothing of
    the header is parsed further or reflected (prometheus_client's own choice raised on a bad version and copied it,
    line breaks included, into the answer's Content-Type)."""
    if "application/openmetrics-text" in accept:
        return openmetrics_exposition.generate_latest, openmetrics_exposition.CONTENT_TYPE_LATEST
    return exposition.generate_latest, exposition.CONTENT_TYPE_LATEST
