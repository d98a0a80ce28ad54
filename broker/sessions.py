"""Sessions: a tenant's use of one device, with opaque handles scoped to it and a lease."""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from dataclasses import dataclass, field
from typing import Protocol

from gpubroker.client import (
    NotFound,
    ResourceExhausted,
    Unavailable,
    WorkerCrashed,
)

from .config import BrokerConfig
from .workers import WorkerClient, WorkerPool

__all__ = ["Admission", "HandleEntry", "Session", "SessionManager"]

log = logging.getLogger("gpubroker.sessions")

_PREFIX = {"buf": "buf", "module": "mod", "kernel": "krn", "stream": "str", "segment": "seg"}


@dataclass
class HandleEntry:
    kind: str
    backend: str  # the worker's own handle, never shown to clients
    size: int = 0
    name: str = ""


@dataclass
class Session:
    id: str
    tenant: str
    device: int
    worker: WorkerClient
    lease_seconds: float
    last_seen: float = field(default_factory=time.monotonic)
    handles: dict[str, HandleEntry] = field(default_factory=dict)
    memory_used: int = 0
    lost: str | None = None  # why the session's device state is gone
    max_handles: int = 4096
    inflight: int = 0
    shared_bytes: int = 0  # host memory mapped for this session through the shared-memory side channel
    tenant_inflight: dict[str, int] = field(default_factory=dict)

    def touch(self) -> None:
        self.last_seen = time.monotonic()

    def check_alive(self) -> WorkerClient:
        if self.lost is not None:
            raise WorkerCrashed(self.lost)
        return self.worker

    def check_room(self) -> None:
        """Called before the worker creates an object, so a refused handle leaks nothing."""
        if len(self.handles) >= self.max_handles:
            raise ResourceExhausted(f"this session already holds {len(self.handles)} handles, the limit; free some")

    @staticmethod
    def new_handle(kind: str) -> str:
        """A fresh client handle, made before the worker creates the object so the worker can learn it too."""
        return f"{_PREFIX[kind]}_{secrets.token_urlsafe(16)}"

    def add(self, kind: str, backend: str, size: int = 0, name: str = "", handle: str | None = None) -> str:
        handle = handle or self.new_handle(kind)
        self.handles[handle] = HandleEntry(kind, backend, size, name)
        return handle

    def resolve(self, handle: str, kind: str) -> HandleEntry:
        entry = self.handles.get(handle)
        if entry is None or entry.kind != kind:
            # Same answer for a foreign, freed or invented handle: nothing to learn by guessing.
            raise NotFound(f"no {kind} {handle!r} in this session")
        return entry


class Admission(Protocol):
    """Health's say on new sessions (server/_health.py): a draining broker or a failing device refuses them."""

    def check_open(self, device: int) -> None: ...

    def worker_start_failed(self, device: int, error: BaseException) -> None: ...


class SessionManager:
    """Opens, finds, expires and closes sessions; keeps per-tenant memory accounting."""

    def __init__(self, config: BrokerConfig, pool: WorkerPool, admission: Admission | None = None) -> None:
        self.config = config
        self.pool = pool
        self.admission = admission
        self.sessions: dict[str, Session] = {}
        self.memory_used: dict[tuple[str, int], int] = {}
        self.draining = False
        # Set while no session is open: a drain waits on it.
        self.idle = asyncio.Event()
        self.idle.set()
        # Calls in flight per tenant across its sessions; each Session shares this dict to release its slot.
        self.inflight: dict[str, int] = {}
        self._reaper: asyncio.Task[None] | None = None

    # -- lifecycle ---------------------------------------------------------------------------------
    def start(self) -> None:
        self._reaper = asyncio.create_task(self._reap_loop(), name="session-reaper")

    async def stop(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
        for session in list(self.sessions.values()):
            await self.close(session)

    def _check_admission(self, device: int) -> None:
        if self.admission is not None:
            self.admission.check_open(device)  # draining, or the device out of service: UNAVAILABLE + retry hint
        elif self.draining:
            raise Unavailable("the broker is draining and accepts no new sessions; retry on another broker")

    async def open(self, tenant: str, device: int) -> Session:
        self._check_admission(device)
        live = sum(1 for s in self.sessions.values() if s.tenant == tenant)
        if live >= self.config.max_sessions_per_tenant:
            raise ResourceExhausted(f"tenant {tenant!r} already has {live} sessions, the limit; close one first")
        try:
            worker = await self.pool.get(tenant, device)
        except Exception as exc:
            if self.admission is not None:
                self.admission.worker_start_failed(device, exc)
            raise
        self._check_admission(device)  # a drain may have begun while the worker started
        session = Session(id=f"ses_{secrets.token_urlsafe(18)}", tenant=tenant, device=device, worker=worker,
                          lease_seconds=self.config.lease_seconds, max_handles=self.config.max_handles_per_session,
                          tenant_inflight=self.inflight)
        self.sessions[session.id] = session
        self.idle.clear()
        log.info("session %s opened for tenant %s on device %d", session.id, tenant, device)
        return session

    def get(self, session_id: str, tenant: str) -> Session:
        session = self.sessions.get(session_id)
        if session is None or session.tenant != tenant:
            raise NotFound(f"no session {session_id!r}")
        session.touch()
        return session

    async def close(self, session: Session, reason: str = "closed") -> None:
        if self.sessions.pop(session.id, None) is None:
            return
        try:
            if session.lost is None:
                try:
                    await session.worker.call("close_session", session.id)
                except WorkerCrashed:
                    pass
            self.release(session, session.memory_used)
            session.handles.clear()
            log.info("session %s of tenant %s %s", session.id, session.tenant, reason)
        finally:
            if not self.sessions:
                self.idle.set()

    async def end_tenant(self, tenant: str, reason: str) -> int:
        """End every session of a tenant and stop its workers (the tenant was removed)."""
        ended = 0
        for session in [s for s in self.sessions.values() if s.tenant == tenant]:
            await self.close(session, reason=reason)
            ended += 1
        await self.pool.stop_tenant(tenant)
        return ended

    def worker_exited(self, worker: WorkerClient) -> None:
        """The worker died or was stopped: its sessions' device memory is gone with it."""
        for session in self.sessions.values():
            if session.worker is worker and session.lost is None:
                session.lost = worker.death or "the worker stopped"
                self.release(session, session.memory_used)
                session.handles.clear()
                session.shared_bytes = 0  # the worker's mappings died with it

    async def _reap_loop(self) -> None:
        interval = max(0.05, min(1.0, self.config.lease_seconds / 4))
        while True:
            await asyncio.sleep(interval)
            now = time.monotonic()
            for session in list(self.sessions.values()):
                if now - session.last_seen > session.lease_seconds:
                    await self.close(session, reason="expired (no heartbeat within the lease)")
            busy = {(s.tenant, s.device) for s in self.sessions.values() if s.lost is None}
            await self.pool.reap_idle(busy)

    # -- memory accounting -------------------------------------------------------------------------
    def quota(self, tenant: str) -> int:
        t = self.config.tenants.get(tenant)
        return t.memory_quota if t else 0

    def reserve(self, session: Session, size: int) -> None:
        """Reserve before allocating so concurrent allocations can never overshoot the quota."""
        key = (session.tenant, session.device)
        used = self.memory_used.get(key, 0)
        quota = self.quota(session.tenant)
        if used + size > quota:
            raise ResourceExhausted(
                f"memory quota exceeded for tenant {session.tenant!r}: quota {quota} bytes, "
                f"used {used}, requested {size}", quota=quota, used=used, requested=size)
        self.memory_used[key] = used + size
        session.memory_used += size

    def release(self, session: Session, size: int) -> None:
        key = (session.tenant, session.device)
        self.memory_used[key] = max(0, self.memory_used.get(key, 0) - size)
        session.memory_used = max(0, session.memory_used - size)

    def used(self, tenant: str, device: int) -> int:
        return self.memory_used.get((tenant, device), 0)
