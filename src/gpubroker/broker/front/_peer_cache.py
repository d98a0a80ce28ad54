"""What CopyPeer keeps between copies, because setting it up costs more than a big copy itself.

- Peer imports (CUDA IPC): a source allocation that a destination session's worker has mapped stays mapped, so
  the next copy of that buffer to that session skips ``cudaIpcOpenMemHandle`` (milliseconds for a big buffer).
  The mapping is closed before the source buffer is freed, and when either session ends.
- Host staging: one memfd per tenant, for every host-path copy of the tenant whatever its size, mapped (and on
  CUDA page-locked) once by each session's worker that takes part, instead of for every copy. A tenant's
  host-path copies take turns on it. A worker runs its tenant's code, which may keep a descriptor or a mapping of
  it (``dup`` while the worker maps it, ``mremap``) past any release; so the memfd is sealed at its size (no
  kept copy can grow it: ``fallocate`` past it is EPERM), counted in the tenant's shared memory from its creation
  until every worker it was sent to has exited (its pages may be held, and filled, until then), and kept by the
  front for as long, to be reused: however many copies, sessions and releases, a tenant holds one.
  A session's mapping is released when it ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import mmap
import os
from collections.abc import AsyncIterator, Collection
from dataclasses import dataclass, field

from gpubroker.broker.config import BrokerConfig
from gpubroker.broker.front._sessions import Session, SessionManager
from gpubroker.broker.front.workers import WorkerClient
from gpubroker.wire.commands import new_handle
from gpubroker.wire.errors import GpuBrokerError, ResourceExhausted
from gpubroker.wire.ring import sealed_memfd
from gpubroker.wire.worker import PeerClose, RegisterSegment, ReleaseSegment

__all__ = ["STAGING_PIECE", "ImportCache", "Staging", "StagingCache", "staging_size"]

# The most a piece of a host-path copy takes: about a millisecond of copying either way (pinned host copies run at
# ~50 GB/s).
STAGING_PIECE = 64 * 1024 * 1024

ImportKey = tuple[str, str, str]  # (source session, source buffer's handle, destination session)


class ImportCache:
    """Source allocations mapped in destination workers, by ImportKey: (destination session, import id)."""

    def __init__(self) -> None:
        self._imports: dict[ImportKey, tuple[Session, str]] = {}

    def get(self, key: ImportKey) -> str | None:
        found = self._imports.get(key)
        return found[1] if found is not None else None

    def add(self, key: ImportKey, dst: Session, import_id: str) -> bool:
        """Keep it (False if another copy cached one for the key meanwhile: the caller closes its own)."""
        if key in self._imports:
            return False
        self._imports[key] = (dst, import_id)
        return True

    async def close_where(self, session: Session, buffers: Collection[str] | None = None) -> None:
        """Close the mappings of ``session``'s buffers (only ``buffers``, when given: one pass for a batch's frees)
        and, when not, those it opened."""
        for key in [k for k in self._imports if (k[0] == session.id and (buffers is None or k[1] in buffers))
                    or (buffers is None and k[2] == session.id)]:
            dst, import_id = self._imports.pop(key)
            with contextlib.suppress(GpuBrokerError):  # a dead worker took its mappings with it
                await dst.worker.call(PeerClose(import_id), dst.id)


@dataclass
class Staging:
    fd: int
    size: int  # sealed: the most host memory it holds, wherever a worker keeps it
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    segments: dict[str, tuple[Session, str]] = field(default_factory=dict)  # session id -> (session, segment)
    users: int = 0  # copies holding or waiting for it: it stays while there are any
    # The live workers it was sent to (by id): it stays, and stays counted, until each has exited.
    holders: dict[int, WorkerClient] = field(default_factory=dict)

    @property
    def piece(self) -> int:
        """Bytes per piece: the pipeline moves one piece through each half."""
        return self.size // 2


def staging_size(limit: int) -> int:
    """The staging's size for a tenant whose shared memory is ``limit`` bytes: two pieces of at most STAGING_PIECE,
    a quarter of its shared memory at most (the rest stays its own), in whole pages (0: too little to stage
    through)."""
    unit = 2 * mmap.PAGESIZE
    return min(2 * STAGING_PIECE, limit // 4) // unit * unit


class StagingCache:
    """One host staging memfd per tenant, counted in its shared memory (``sessions``) while any worker may hold it."""

    def __init__(self, config: BrokerConfig, sessions: SessionManager) -> None:
        self.config = config
        self.sessions = sessions
        self._by_tenant: dict[str, Staging] = {}

    @contextlib.asynccontextmanager
    async def use(self, tenant: str) -> AsyncIterator[Staging]:
        """The tenant's staging, to itself for the duration (its copies take turns)."""
        staging = self._of(tenant)
        staging.users += 1
        try:
            async with staging.lock:
                yield staging
        finally:
            staging.users -= 1
            self.prune(tenant)

    def _of(self, tenant: str) -> Staging:
        staging = self._by_tenant.get(tenant)
        if staging is not None:
            return staging
        limit, which = self.config.shared_limit(tenant)
        size = staging_size(limit)
        if size == 0:
            raise ResourceExhausted(
                f"a copy between these two devices goes through host shared memory, and tenant {tenant!r} may share "
                f"{limit} bytes ({which}): too little to stage through; ask the operator to raise it",
                limit=limit, requested=2 * mmap.PAGESIZE)
        used = self.sessions.shared(tenant)
        if used + size > limit:
            raise ResourceExhausted(
                f"a copy between these two devices goes through {size} bytes of host shared memory, counted in "
                f"tenant {tenant!r}'s shared memory while its workers live: {used} of {limit} ({which}) in use; "
                "release segments (drop host arrays) or end sessions first, or ask the operator to raise it",
                limit=limit, used=used, requested=size)
        # Sealed once sized: no copy of it a worker keeps can grow it (or shrink it under another's mapping), nor
        # unseal it.
        fd = sealed_memfd(f"gpubroker-peer-{tenant}", size)
        self.sessions.hold_shared(tenant, size)
        staging = self._by_tenant[tenant] = Staging(fd, size)
        return staging

    async def segment(self, staging: Staging, session: Session) -> str:
        """The staging as a segment of ``session``'s worker, registered on first use."""
        found = staging.segments.get(session.id)
        if found is not None:
            return found[1]
        worker = session.check_alive()
        if not worker.alive:  # (dead, its on_death already run: it would never leave the holders)
            raise worker.death_error()
        if id(worker) not in staging.holders:
            # Until it exits (reported by on_death, which runs as ``alive`` turns false with nothing awaited in
            # between, so a live worker's always comes).
            staging.holders[id(worker)] = worker
            worker.on_death.append(functools.partial(self.worker_exited, staging, worker))
        segment = new_handle("segment")
        await worker.call(RegisterSegment(segment, staging.size), session.id, staging.fd)
        staging.segments[session.id] = (session, segment)
        return segment

    async def release(self, session: Session) -> None:
        """The session ends: unmap the staging from its worker (which still holds it, counted, until it exits)."""
        staging = self._by_tenant.get(session.tenant)
        if staging is None:
            return
        found = staging.segments.pop(session.id, None)
        if found is not None:
            with contextlib.suppress(GpuBrokerError):
                await session.worker.call(ReleaseSegment(found[1]), session.id)
        self.prune(session.tenant)

    def worker_exited(self, staging: Staging, worker: WorkerClient) -> None:
        """A worker the staging was sent to is gone, and with it every copy of it that worker kept."""
        staging.holders.pop(id(worker), None)
        for key in [k for k, (s, _) in staging.segments.items() if s.worker is worker]:
            del staging.segments[key]
        self.prune(worker.tenant)

    def prune(self, tenant: str) -> None:
        """Drop the tenant's staging, and uncount it, once no copy uses it and no live worker may hold it."""
        staging = self._by_tenant.get(tenant)
        if staging is not None and not staging.users and not staging.holders:
            del self._by_tenant[tenant]
            os.close(staging.fd)
            self.sessions.unhold_shared(tenant, staging.size)
