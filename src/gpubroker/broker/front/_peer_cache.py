"""What CopyPeer keeps between copies, because setting it up costs more than a big copy itself.

- Peer imports (CUDA IPC): a source allocation that a destination session's worker has mapped stays mapped, so
  the next copy of that buffer to that session skips ``cudaIpcOpenMemHandle`` (milliseconds for a big buffer).
  The mapping is closed before the source buffer is freed, and when either session ends.
- Host staging: one memfd per tenant (two pieces of HOST_PIECE), mapped and page-locked once by each worker that
  takes part in a host-path copy, instead of for every copy (populating and pinning 128 MiB costs tens of ms).
  A tenant's host-path copies take turns on it. A session's mapping is released when it ends; the memfd goes
  when no session maps it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator, Collection
from dataclasses import dataclass, field

from gpubroker.broker.front._sessions import Session
from gpubroker.wire.commands import new_handle
from gpubroker.wire.errors import GpuBrokerError
from gpubroker.wire.worker import PeerClose, RegisterSegment, ReleaseSegment

__all__ = ["ImportCache", "Staging", "StagingCache"]

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
    size: int
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    segments: dict[str, tuple[Session, str]] = field(default_factory=dict)  # session id -> (session, segment)
    users: int = 0  # copies holding or waiting for it: it stays while there are any

    async def segment(self, session: Session) -> str:
        """The staging as a segment of ``session``'s worker, registered on first use."""
        found = self.segments.get(session.id)
        if found is not None:
            return found[1]
        segment = new_handle("segment")
        await session.worker.call(RegisterSegment(segment, self.size), session.id, self.fd)
        self.segments[session.id] = (session, segment)
        return segment


class StagingCache:
    """One host staging memfd per tenant."""

    def __init__(self, size: int) -> None:
        self.size = size
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
        if staging is None:
            fd = os.memfd_create(f"gpubroker-peer-{tenant}", os.MFD_CLOEXEC)
            try:
                os.ftruncate(fd, self.size)
            except OSError:
                os.close(fd)
                raise
            staging = self._by_tenant[tenant] = Staging(fd, self.size)
        return staging

    async def release(self, session: Session) -> None:
        """The session ends: unmap the staging from its worker; drop the memfd once nobody maps it."""
        staging = self._by_tenant.get(session.tenant)
        if staging is None:
            return
        found = staging.segments.pop(session.id, None)
        if found is not None:
            with contextlib.suppress(GpuBrokerError):
                await session.worker.call(ReleaseSegment(found[1]), session.id)
        self.prune(session.tenant)

    def prune(self, tenant: str) -> None:
        staging = self._by_tenant.get(tenant)
        if staging is not None and not staging.segments and not staging.users:
            del self._by_tenant[tenant]
            os.close(staging.fd)
