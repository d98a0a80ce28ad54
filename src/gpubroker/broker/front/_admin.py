"""The Admin service: list and end sessions, reload tenants, drain, status. Every call needs an admin identity."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable, Sequence

from gpubroker import __version__
from gpubroker.broker.front._grpc_peers import grpc_peer
from gpubroker.broker.front._health import BrokerHealth
from gpubroker.broker.front._sessions import Session, SessionManager
from gpubroker.broker.front._status import Context, principal_of, rpc
from gpubroker.broker.front.auth import Authenticator
from gpubroker.broker.front.scheduler import DeviceScheduler
from gpubroker.v1 import admin_pb2 as apb
from gpubroker.v1 import admin_pb2_grpc as apb_grpc
from gpubroker.wire.errors import InvalidArgument, NotFound
from gpubroker.wire.types import DeviceInfo

__all__ = ["AdminService"]

audit = logging.getLogger("gpubroker.audit")
# Seconds an EndSession's answer waits for the session's worker to close it (what it reports freed is the session's
# use before, either way).
_CLOSE_WAIT = 1.0


def _summary(s: Session, now: float) -> apb.SessionSummary:
    return apb.SessionSummary(session=s.id, tenant=s.tenant, device=s.device, idle_seconds=now - s.last_seen,
                              memory_used=s.memory_used, lost=s.lost or "",
                              worker_pid=s.worker.pid or 0)


class AdminService(apb_grpc.AdminServicer):
    """``drain(grace)`` starts a drain and returns the seconds until the sessions left are ended (None: never)."""

    def __init__(self, auth: Authenticator, sessions: SessionManager,
                 reload: Callable[[], Awaitable[apb.ReloadResponse]], schedulers: dict[int, DeviceScheduler], *,
                 drain: Callable[[float | None], Awaitable[float | None]] | None = None,
                 undrain: Callable[[], Awaitable[bool]] | None = None,
                 health: BrokerHealth | None = None, devices: Sequence[DeviceInfo] = (), sandbox: str = "") -> None:
        self.auth = auth
        self.sandbox = sandbox  # the worker sandbox's layers in force (or "OFF")
        self.sessions = sessions
        self._reload = reload
        self.schedulers = schedulers
        self._drain = drain
        self._undrain = undrain
        self.health = health
        self.devices = list(devices)
        self.started = time.monotonic()

    def _admin(self, context: Context, action: str) -> str:
        principal = principal_of(self.auth, context)
        principal.require_admin(action)
        return principal.tenant

    @rpc
    async def ListSessions(self, request: apb.ListSessionsRequest, context: Context) -> apb.ListSessionsResponse:
        self._admin(context, "ListSessions")
        await self.sessions.refresh_all()
        now = time.monotonic()
        return apb.ListSessionsResponse(sessions=[
            _summary(s, now) for s in self.sessions.sessions.values()
            if not request.tenant or s.tenant == request.tenant])

    @rpc
    async def EndSession(self, request: apb.EndSessionRequest, context: Context) -> apb.EndSessionResponse:
        admin = self._admin(context, "EndSession")
        session = self.sessions.sessions.get(request.session)
        if session is None:
            raise NotFound(f"no session {request.session!r}")
        await self.sessions.refresh_all()
        freed = session.memory_used
        # Gone from the sessions at once; the answer waits a moment for its worker to close it, never longer (a
        # worker held in its tenant's kernel closes it when it next reads, or its death frees all it held).
        closing = self.sessions.end(session, reason=f"ended by admin {admin}")
        if closing is None:
            raise NotFound(f"no session {request.session!r}")
        await asyncio.wait([closing], timeout=_CLOSE_WAIT)
        audit.info("admin=%s action=end-session session=%s tenant=%s peer=%s", admin, session.id, session.tenant,
                   grpc_peer(context))
        return apb.EndSessionResponse(tenant=session.tenant, memory_freed=freed)

    @rpc
    async def Reload(self, request: apb.ReloadRequest, context: Context) -> apb.ReloadResponse:
        admin = self._admin(context, "Reload")
        audit.info("admin=%s action=reload peer=%s", admin, grpc_peer(context))
        return await self._reload()

    @rpc
    async def Drain(self, request: apb.DrainRequest, context: Context) -> apb.DrainResponse:
        admin = self._admin(context, "Drain")
        grace = request.grace_seconds if request.HasField("grace_seconds") else None
        if grace is not None and not (math.isfinite(grace) and grace >= 0):
            raise InvalidArgument(f"grace_seconds must be a finite number >= 0, got {grace}")
        audit.info("admin=%s action=drain grace=%s peer=%s", admin, "none" if grace is None else f"{grace:g}",
                   grpc_peer(context))
        if self._drain is not None:
            seconds_left = await self._drain(grace)
        else:
            self.sessions.draining, seconds_left = True, None
        now = time.monotonic()
        running = [_summary(s, now) for s in self.sessions.sessions.values()]
        return apb.DrainResponse(sessions_running=len(running), sessions=running, seconds_left=seconds_left)

    @rpc
    async def Undrain(self, request: apb.UndrainRequest, context: Context) -> apb.UndrainResponse:
        admin = self._admin(context, "Undrain")
        audit.info("admin=%s action=undrain peer=%s", admin, grpc_peer(context))
        if self._undrain is not None:
            was = await self._undrain()
        else:
            was, self.sessions.draining = self.sessions.draining, False
        return apb.UndrainResponse(was_draining=was, sessions_running=len(self.sessions.sessions))

    @rpc
    async def Usage(self, request: apb.UsageRequest, context: Context) -> apb.UsageResponse:
        self._admin(context, "Usage")
        await self.sessions.refresh_all()
        window = request.window_seconds or 10.0
        config = self.sessions.config
        rows = []
        for device, scheduler in sorted(self.schedulers.items()):
            names = sorted(set(scheduler.usage) | {s.tenant for s in self.sessions.sessions.values()
                                                   if s.device == device})
            for tenant in names:
                use = scheduler.usage.get(tenant)
                account = scheduler.policy.accounts.get(tenant)
                rows.append(apb.TenantUsage(
                    tenant=tenant, device=device, weight=account.weight if account else 1.0,
                    device_seconds=use.device_seconds if use else 0.0, share=scheduler.share(tenant, window),
                    queued=use.queued if use else 0, inflight=use.inflight if use else 0,
                    wait_p50_ms=use.wait_percentile(0.5) * 1e3 if use else 0.0,
                    wait_p99_ms=use.wait_percentile(0.99) * 1e3 if use else 0.0,
                    memory_used=self.sessions.used(tenant, device),
                    memory_quota=self.sessions.quota(tenant, device),
                    sessions=sum(1 for s in self.sessions.sessions.values()
                                 if s.tenant == tenant and s.device == device),
                    shared_bytes=self.sessions.shared(tenant), shared_bytes_limit=config.shared_limit(tenant)[0]))
        return apb.UsageResponse(tenants=rows, fair_scheduling=config.fair_scheduling, quantum_ms=config.quantum_ms)

    @rpc
    async def Status(self, request: apb.StatusRequest, context: Context) -> apb.StatusResponse:
        self._admin(context, "Status")
        await self.sessions.refresh_all()
        sessions = list(self.sessions.sessions.values())
        health = self.health
        draining = self.sessions.draining or (health is not None and health.draining)
        devices = []
        for i, info in enumerate(self.devices):
            problem = health.problem(i) if health is not None else None
            devices.append(apb.DeviceStatus(
                device=i, name=info.name, backend=info.backend, total_memory=info.total_memory,
                health="NOT_SERVING" if problem or draining else "SERVING",
                reason=problem or ("the broker is draining" if draining else ""),
                recent_worker_failures=health.recent_failures(i) if health is not None else 0,
                sessions=sum(1 for s in sessions if s.device == i),
                memory_used=sum(used for (_, d), used in self.sessions.memory_used.items() if d == i)))
        tenants = [apb.TenantStatus(
            tenant=t.name, weight=t.weight, memory_quota=t.memory_quota, admin=t.admin,
            sessions=sum(1 for s in sessions if s.tenant == t.name),
            memory_used=sum(self.sessions.used(t.name, d) for d in range(len(self.devices))))
            for t in self.sessions.config.tenants.values()]
        seconds_left = None
        if health is not None and health.drain_deadline is not None:
            seconds_left = max(0.0, health.drain_deadline - time.monotonic())
        serving = not draining and any(d.health == "SERVING" for d in devices)
        return apb.StatusResponse(version=__version__, uptime_seconds=time.monotonic() - self.started,
                                  health="SERVING" if serving else "NOT_SERVING", draining=draining,
                                  drain_seconds_left=seconds_left, devices=devices, tenants=tenants,
                                  sandbox=self.sandbox)
