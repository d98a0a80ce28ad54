"""Streamed copies' chunks cross from the front to the worker through memory the two share, not the socket.

The worker maps a small memfd per session (page-locked on CUDA, so its copies run by DMA) and copies each chunk
between it and the device in place; the front puts received chunks into it and builds outgoing messages from
it. A chunk then costs the front one copy each way instead of msgpack packing, a socket and unpacking.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import mmap
import os
from collections.abc import AsyncIterator
from typing import Any

from ..sessions import Session, SessionManager

__all__ = ["CopyStaging", "CopyStagings"]

log = logging.getLogger("gpubroker.server")


class CopyStaging:
    """``slots`` chunk-sized slots of one memfd mapped by the front and by the session's worker."""

    def __init__(self, slots: int, slot_bytes: int) -> None:
        self.slot_bytes = slot_bytes
        self.size = slots * slot_bytes
        self.free = list(range(slots))
        self.segment = ""  # the worker's handle of its mapping, once registered
        # A copy gave up on calls already sent to the worker, which may still read or write their slots after
        # the slots were handed to the next copy: a stale staging is dropped, never reused.
        self.stale = False
        fd = os.memfd_create("gpubroker-staging", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, self.size)
            self.mm = mmap.mmap(fd, self.size)
        except BaseException:
            os.close(fd)
            raise
        self.fd: int | None = fd

    async def register(self, session: Session) -> None:
        assert self.fd is not None
        try:
            self.segment = await session.worker.call_with_fd("register_segment", session.id, self.fd, size=self.size)
        finally:
            os.close(self.fd)
            self.fd = None

    def offset(self, slot: int) -> int:
        return slot * self.slot_bytes

    def put(self, slot: int, data: bytes) -> None:
        start = slot * self.slot_bytes
        self.mm[start:start + len(data)] = data

    def get(self, slot: int, size: int) -> bytes:
        start = slot * self.slot_bytes
        return self.mm[start:start + size]

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        self.mm.close()


class CopyStagings:
    """Each session's staging, registered with its worker on first use and unmapped when the session closes.

    One streamed copy of a session uses it at a time; a concurrent one goes through the socket as before.
    """

    def __init__(self, sessions: SessionManager) -> None:
        self._sessions = sessions
        self._by_session: dict[str, CopyStaging] = {}
        self._busy: set[str] = set()
        self._unmapping: set[asyncio.Task[Any]] = set()
        sessions.closing_hooks.append(self._release)

    @contextlib.asynccontextmanager
    async def use(self, session: Session, slots: int, slot_bytes: int) -> AsyncIterator[CopyStaging | None]:
        if session.id in self._busy:
            yield None
            return
        self._busy.add(session.id)
        staging = None
        try:
            staging = await self._get(session, slots, slot_bytes)
            yield staging
        finally:
            self._busy.discard(session.id)
            if staging is not None and staging.stale:
                self._drop(session, staging)

    def _drop(self, session: Session, staging: CopyStaging) -> None:
        """Forget a stale staging; the worker unmaps it after the calls still queued there (it serves in order)."""
        if self._by_session.get(session.id) is staging:
            del self._by_session[session.id]
        staging.close()
        task = asyncio.ensure_future(session.worker.call("release_segment", session.id, segment=staging.segment))
        self._unmapping.add(task)
        task.add_done_callback(self._unmapped)

    def _unmapped(self, task: asyncio.Task[Any]) -> None:
        self._unmapping.discard(task)
        if not task.cancelled() and task.exception() is not None:  # (the session closed first: unmapped with it)
            log.debug("unmapping a stale copy staging: %s", task.exception())

    async def _get(self, session: Session, slots: int, slot_bytes: int) -> CopyStaging | None:
        staging = self._by_session.get(session.id)
        if staging is not None:
            return staging if staging.size >= slots * slot_bytes else None
        staging = CopyStaging(slots, slot_bytes)
        try:
            await staging.register(session)
        except Exception as exc:  # the worker could not map it: copy through the socket
            log.info("no copy staging for session %s: %s", session.id, exc)
            staging.close()
            return None
        if self._sessions.sessions.get(session.id) is not session:  # it closed meanwhile; its worker unmapped it
            staging.close()
            return None
        self._by_session[session.id] = staging
        return staging

    async def _release(self, session: Session) -> None:
        """The session is closing: its worker unmaps its side along with the session's other segments."""
        staging = self._by_session.pop(session.id, None)
        if staging is not None:
            staging.close()
