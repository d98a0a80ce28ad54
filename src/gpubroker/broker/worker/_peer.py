"""Worker operations for copies between a tenant's sessions (CopyPeer; the front drives them, see server/_peer.py).

Buffers are named by the client's handles as ``[handle, view_offset]`` refs, resolved in the sessions' handle
tables (workers/_handles.py); the front pins both buffers (``pin`` / ``unpin``) around a copy, so neither can be
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
from gpubroker.wire.compute import GpuCompute
from gpubroker.wire.errors import FailedPrecondition, GpuBrokerError, InvalidArgument, NotFound, OutOfRange
from gpubroker.wire.types import Buffer

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


def _int(value: Any, what: str) -> int:
    if type(value) is not int or value < 0:
        raise InvalidArgument(f"{what} must be an int >= 0, got {str(value)[:40]}")
    return value


class PeerOps:
    """Mixed into WorkerServer, which provides ``backend``, ``tables`` and ``peer_imports``."""

    backend: GpuCompute
    tables: HandleTables
    peer_imports: PeerImports

    def _view(self, session: str, ref: Any) -> Buffer:
        """The backend's view for a ``[handle, view_offset]`` ref of ``session``."""
        if type(ref) not in (list, tuple) or len(ref) != 2 or type(ref[0]) is not str:
            raise InvalidArgument("a buffer ref must be [handle, view_offset]")
        return self.tables.session(session).view(ref[0], _int(ref[1], "a buffer view offset"))

    def op_pin(self, session: str, p: dict[str, Any]) -> Any:
        """Keep buffers from being freed while a copy to or from another device uses them (all or none)."""
        objs = self.tables.session(session)
        entries = [objs.buffer(str(handle)) for handle in p["handles"]]
        for entry in entries:
            entry.pins += 1

    def op_unpin(self, session: str, p: dict[str, Any]) -> Any:
        objs = self.tables.session(session)
        for handle in p["handles"]:
            entry = objs.buffers.get(str(handle))
            if entry is not None and entry.pins:
                entry.pins -= 1

    def _peer_backend(self, method: str) -> Any:
        fn = getattr(self.backend, method, None)
        if fn is None:
            raise FailedPrecondition("this backend has no peer path between devices", peer_unsupported=True)
        return fn

    def op_peer_local(self, session: str, p: dict[str, Any]) -> Any:
        """Copy from another session's buffer on this device into this session's, and wait for it."""
        src = self._view(str(p["src_session"]), p["src"])
        dst = self._view(session, p["dst"])
        self.backend.copy_d2d(src, dst, _int(p["size"], "size"), _int(p["src_offset"], "src_offset"),
                              _int(p["dst_offset"], "dst_offset"))
        self.backend.synchronize()

    def op_peer_export(self, session: str, p: dict[str, Any]) -> Any:
        handle, size = self._peer_backend("export_peer")(self._view(session, p["buf"]))
        return {"handle": handle, "size": size}

    def op_peer_open(self, session: str, p: dict[str, Any]) -> Any:
        src_device, size = _int(p["src_device"], "src_device"), _int(p["size"], "size")
        ptr = self._peer_backend("open_peer")(bytes(p["handle"]), src_device)
        return self.peer_imports.add(_Import(session, ptr, src_device, size))

    def op_peer_copy(self, session: str, p: dict[str, Any]) -> Any:
        entry = self.peer_imports.get(session, p["import"])
        src_offset, size = _int(p["src_offset"], "src_offset"), _int(p["size"], "size")
        if src_offset + size > entry.size:
            raise OutOfRange(f"{size} bytes at offset {src_offset} run past the peer's {entry.size}-byte allocation")
        self._peer_backend("copy_from_peer")(entry.ptr + src_offset, self._view(session, p["dst"]),
                                             _int(p["dst_offset"], "dst_offset"), size)

    def op_peer_close(self, session: str, p: dict[str, Any]) -> Any:
        self._peer_backend("close_peer")(self.peer_imports.pop(session, p["import"]).ptr)

    def close_peer_imports(self, session: str) -> None:
        """The session ends: unmap what it opened (errors are logged; the rest still close)."""
        for entry in self.peer_imports.pop_session(session):
            try:
                self._peer_backend("close_peer")(entry.ptr)
            except GpuBrokerError as exc:
                log.warning("closing a peer import of session %s: %s", session, exc.message)
