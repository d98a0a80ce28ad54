"""The Admin service: list and end sessions, reload tenants, drain. Every call needs an admin identity."""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable

import grpc

from gpubroker.client import NotFound
from gpubroker.v1 import admin_pb2 as apb
from gpubroker.v1 import admin_pb2_grpc as apb_grpc

from ..auth import Authenticator
from ..scheduler import DeviceScheduler
from ..sessions import SessionManager
from ._status import principal_of, rpc

__all__ = ["AdminService"]

audit = logging.getLogger("gpubroker.audit")


class AdminService(apb_grpc.AdminServicer):
    def __init__(self, auth: Authenticator, sessions: SessionManager,
                 reload: Callable[[], Awaitable[apb.ReloadResponse]], schedulers: dict[int, DeviceScheduler]) -> None:
        self.auth = auth
        self.sessions = sessions
        self._reload = reload
        self.schedulers = schedulers

    def _admin(self, context: grpc.aio.ServicerContext, action: str) -> str:
        principal = principal_of(self.auth, context)
        principal.require_admin(action)
        return principal.tenant

    @rpc
    async def ListSessions(self, request: apb.ListSessionsRequest, context: grpc.aio.ServicerContext
                           ) -> apb.ListSessionsResponse:
        self._admin(context, "ListSessions")
        now = time.monotonic()
        return apb.ListSessionsResponse(sessions=[
            apb.SessionSummary(session=s.id, tenant=s.tenant, device=s.device, idle_seconds=now - s.last_seen,
                               memory_used=s.memory_used, handles=len(s.handles), lost=s.lost or "",
                               worker_pid=s.worker.pid or 0)
            for s in self.sessions.sessions.values() if not request.tenant or s.tenant == request.tenant])

    @rpc
    async def EndSession(self, request: apb.EndSessionRequest, context: grpc.aio.ServicerContext
                         ) -> apb.EndSessionResponse:
        admin = self._admin(context, "EndSession")
        session = self.sessions.sessions.get(request.session)
        if session is None:
            raise NotFound(f"no session {request.session!r}")
        freed = session.memory_used
        await self.sessions.close(session, reason=f"ended by admin {admin}")
        audit.info("admin=%s action=end-session session=%s tenant=%s peer=%s", admin, session.id, session.tenant,
                   context.peer())
        return apb.EndSessionResponse(tenant=session.tenant, memory_freed=freed)

    @rpc
    async def Reload(self, request: apb.ReloadRequest, context: grpc.aio.ServicerContext) -> apb.ReloadResponse:
        admin = self._admin(context, "Reload")
        audit.info("admin=%s action=reload peer=%s", admin, context.peer())
        return await self._reload()

    @rpc
    async def Drain(self, request: apb.DrainRequest, context: grpc.aio.ServicerContext) -> apb.DrainResponse:
        admin = self._admin(context, "Drain")
        self.sessions.draining = True
        audit.info("admin=%s action=drain peer=%s", admin, context.peer())
        return apb.DrainResponse(sessions_running=len(self.sessions.sessions))

    @rpc
    async def Usage(self, request: apb.UsageRequest, context: grpc.aio.ServicerContext) -> apb.UsageResponse:
        self._admin(context, "Usage")
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
                    memory_used=self.sessions.used(tenant, device), memory_quota=self.sessions.quota(tenant),
                    sessions=sum(1 for s in self.sessions.sessions.values()
                                 if s.tenant == tenant and s.device == device)))
        return apb.UsageResponse(tenants=rows, fair_scheduling=config.fair_scheduling, quantum_ms=config.quantum_ms)
