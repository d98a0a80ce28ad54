"""Worker operations for copies between a tenant's sessions (CopyPeer; the front drives them, see server/_peer.py).

Buffers are named by the client's handles as ``(handle, view_offset)`` refs, resolved in the sessions' handle
tables (workers/_handles.py); the front pins both buffers (``Pin`` / ``Unpin``) around a copy, so neither can be
freed while another worker may be reading or writing it.

- ``peer_local``: both sessions on this worker's device: a device-to-device copy, waited for.
- ``peer_export`` (source worker) / ``peer_open``, ``peer_copy``, ``peer_close`` (destination worker): the GPUs'
  peer path, where the backend has one (CUDA IPC). An opened source belongs to the destination session, so a
  session that ends closes what it opened.

The host path needs nothing new: the front registers one staging memfd with both workers and moves it through
``copy_shared``.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass
from typing import Any

from gpubroker.broker.worker._handles import HandleTables
from gpubroker.wire.commands import BufRef
from gpubroker.wire.compute import GpuCompute
from gpubroker.wire.errors import FailedPrecondition, GpuBrokerError, NotFound, OutOfRange
from gpubroker.wire.types import Buffer
from gpubroker.wire.worker import PeerClose, PeerCopy, PeerExport, PeerExported, PeerLocal, PeerOpen, Pin, Unpin

__all__ = ["PeerImports", "PeerOps"]

log = logging.getLogger("gpubroker.worker")


@dataclass
class _Import:
    session: str
    ptr: int
    src_device: int  # the backend's index of the source device
    size: int  # of the source allocation


class PeerImports:
    """Other workers' allocations this worker opened, by id, each owned by the session that opened it."""

    def __init__(self) -> None:
        self._entries: dict[str, _Import] = {}
        self._ids = itertools.count(1)

    def add(self, entry: _Import) -> str:
        import_id = f"imp{next(self._ids)}"
        self._entries[import_id] = entry
        return import_id

    def get(self, session: str, import_id: object) -> _Import:
        entry = self._entries.get(str(import_id))
        if entry is None or entry.session != session:
            raise NotFound("unknown peer import")
        return entry

    def pop_session(self, session: str) -> list[_Import]:
        ids = [i for i, e in self._entries.items() if e.session == session]
        return [self._entries.pop(i) for i in ids]

    def pop(self, session: str, import_id: object) -> _Import:
        entry = self.get(session, import_id)
        del self._entries[str(import_id)]
        return entry


class PeerOps:
    """The worker's side of copies between a tenant's sessions: its backend's peer path and what it opened."""

    def __init__(self, backend: GpuCompute, tables: HandleTables) -> None:
        self.backend = backend
        self.tables = tables
        self.imports = PeerImports()  # other devices' allocations opened for CopyPeer

    def _view(self, session: str, ref: BufRef) -> Buffer:
        """The backend's view for a ``(handle, view_offset)`` ref of ``session``."""
        return self.tables.session(session).view(*ref)

    def pin(self, session: str, request: Pin) -> None:
        """Keep buffers from being freed while a copy to or from another device uses them (all or none)."""
        objs = self.tables.session(session)
        entries = [objs.buffer(handle) for handle in request.handles]
        for entry in entries:
            entry.pins += 1

    def unpin(self, session: str, request: Unpin) -> None:
        objs = self.tables.session(session)
        for handle in request.handles:
            entry = objs.buffers.get(handle)
            if entry is not None and entry.pins:
                entry.pins -= 1

    def _peer_backend(self, method: str) -> Any:
        fn = getattr(self.backend, method, None)
        if fn is None:
            raise FailedPrecondition("this backend has no peer path between devices", peer_unsupported=True)
        return fn

    def local(self, session: str, request: PeerLocal) -> None:
        """Copy from another session's buffer on this device into this session's, and wait for it."""
        src = self._view(request.src_session, request.src)
        dst = self._view(session, request.dst)
        self.backend.copy_d2d(src, dst, request.size, request.src_offset, request.dst_offset)
        self.backend.synchronize()

    def export(self, session: str, request: PeerExport) -> PeerExported:
        handle, size = self._peer_backend("export_peer")(self._view(session, request.buf))
        return PeerExported(handle, size)

    def open(self, session: str, request: PeerOpen) -> str:
        ptr = self._peer_backend("open_peer")(request.handle, request.src_device)
        return self.imports.add(_Import(session, ptr, request.src_device, request.size))

    def copy(self, session: str, request: PeerCopy) -> None:
        entry = self.imports.get(session, request.import_id)
        src_offset, size = request.src_offset, request.size
        if src_offset + size > entry.size:
            raise OutOfRange(f"{size} bytes at offset {src_offset} run past the peer's {entry.size}-byte allocation")
        self._peer_backend("copy_from_peer")(entry.ptr + src_offset, self._view(session, request.dst),
                                             request.dst_offset, size)

    def close(self, session: str, request: PeerClose) -> None:
        self._peer_backend("close_peer")(self.imports.pop(session, request.import_id).ptr)

    def close_session(self, session: str) -> None:
        """The session ends: unmap what it opened (errors are logged; the rest still close)."""
        for entry in self.imports.pop_session(session):
            try:
                self._peer_backend("close_peer")(entry.ptr)
            except GpuBrokerError as exc:
                log.warning("closing a peer import of session %s: %s", session, exc.message)
