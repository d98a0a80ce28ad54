"""The worker's requests from the front: device work as protocol batches, and the front's own operations.

It knows nothing of gRPC. Requests are ``[id, op, session, params]``; replies ``[id, 0, result]`` or
``[id, 1, error]`` (the loop is in _process.py). Device work is the ``batch`` op (an encoded protocol Batch, run
by the one executor that also serves links); every other op is the front's: limits, accounting, sessions,
segments, links, and copies between devices.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Callable
from typing import Any

from gpubroker.broker.worker._executor import Executor
from gpubroker.broker.worker._handles import HandleTables, Limits
from gpubroker.broker.worker._links import Links
from gpubroker.broker.worker._peer import PeerImports, PeerOps
from gpubroker.broker.worker._segments import SegmentTable
from gpubroker.wire.commands import encode, parse_batch
from gpubroker.wire.compute import GpuCompute
from gpubroker.wire.errors import GpuBrokerError, Internal, InvalidArgument
from gpubroker.wire.worker import EXIT_FATAL, send_frame

__all__ = ["EXIT_FATAL", "WorkerServer"]

log = logging.getLogger("gpubroker.worker")
_MAX_HANDLE = 64  # characters, as the protocol's


def _limit(p: dict[str, Any], key: str) -> int | None:
    value = p.get(key)
    if value is None:
        return None
    if type(value) is not int or value < 0:
        raise InvalidArgument(f"set_limits: {key} must be an int >= 0, got {str(value)[:40]}")
    return value


def _handle(value: Any) -> str:
    if type(value) is not str or not 0 < len(value) <= _MAX_HANDLE:
        raise InvalidArgument(f"a handle must be a string of 1 to {_MAX_HANDLE} characters")
    return value


class WorkerServer(PeerOps):
    """Serves the front's requests against one backend through the one handle table and executor."""

    def __init__(self, backend: GpuCompute, tenant: str = "", device: int = 0) -> None:
        self.backend = backend
        self.front: socket.socket | None = None
        self.tables = HandleTables(tenant, device)
        self.segments = SegmentTable(backend)  # shared-memory segments; main() attaches the fd channel
        self.executor = Executor(backend, self.tables, self.segments)
        self.links = Links(self.executor, self._send_front)
        self.peer_imports = PeerImports()  # other devices' allocations opened for CopyPeer (workers/_peer.py)
        self._ops: dict[str, Callable[[str, dict[str, Any]], Any]] = {
            "batch": self.op_batch, "ping": self.op_ping, "take_device_time": self.op_take_device_time,
            "set_limits": self.op_set_limits, "usage": self.op_usage, "close_session": self.op_close_session,
            "register_segment": self.op_register_segment, "release_segment": self.op_release_segment,
            "attach_link": self.op_attach_link, "serve_link": self.op_serve_link, "drop_link": self.op_drop_link,
            "close_links": self.op_close_links,
            "pin": self.op_pin,
            "unpin": self.op_unpin, "peer_local": self.op_peer_local, "peer_export": self.op_peer_export,
            "peer_open": self.op_peer_open, "peer_copy": self.op_peer_copy, "peer_close": self.op_peer_close,
        }

    @property
    def fatal(self) -> bool:
        """A command corrupted the device context: the worker exits once it has replied."""
        return self.executor.fatal

    def _send_front(self, frame: list[Any]) -> None:
        if self.front is not None:
            send_frame(self.front, frame)

    def handle(self, op: str, session: str, p: dict[str, Any]) -> Any:
        method = self._ops.get(op) if type(op) is str else None
        if method is None:
            raise InvalidArgument(f"unknown worker operation {str(op)[:40]!r}")
        if type(p) is not dict:
            raise InvalidArgument(f"{op}: params must be a map")
        return method(str(session), p)

    # -- device work -------------------------------------------------------------------------------
    def op_batch(self, session: str, p: dict[str, Any]) -> Any:
        """Run an encoded protocol Batch (module loads included); the result is its encoded Ack."""
        data = p.get("batch")
        if type(data) is not bytes:
            raise InvalidArgument("batch: params must hold the encoded batch as bytes")
        return encode(self.executor.run(session, parse_batch(data)))

    # -- the front's own ---------------------------------------------------------------------------
    def op_ping(self, session: str, p: dict[str, Any]) -> Any:
        return os.getpid()

    def op_take_device_time(self, session: str, p: dict[str, Any]) -> Any:
        """Device seconds used since the last take (the fair scheduler's charge; waits for queued work), and
        the memory in use, which the front mirrors."""
        take = getattr(self.backend, "take_device_time", None)
        return {"seconds": float(take()) if take is not None else 0.0, "memory_used": self.tables.memory_used}

    def op_set_limits(self, session: str, p: dict[str, Any]) -> Any:
        """The tenant's memory quota on this device and the per-session limits (at start and every reload).
        Optional: ``device``, the broker's index of this device (named in quota errors), and ``max_frame``, the
        largest frame a link takes (the config's chunk_bytes plus 64 KiB)."""
        limits = Limits(_limit(p, "memory_quota"), _limit(p, "max_handles"), _limit(p, "max_streams"))
        device, max_frame = _limit(p, "device"), _limit(p, "max_frame")
        self.tables.limits = limits
        if device is not None:
            self.tables.device = device
        if max_frame is not None:
            self.links.max_frame = self.executor.max_inflate = max_frame

    def op_usage(self, session: str, p: dict[str, Any]) -> Any:
        return {"memory_used": self.tables.memory_used, "sessions": self.tables.usage()}

    def op_close_session(self, session: str, p: dict[str, Any]) -> Any:
        """Free everything the session owned; an error on one object does not stop the rest. Returns how many
        buffers and streams were freed."""
        self.links.close_session(session)
        self.close_peer_imports(session)
        objs = self.tables.sessions.pop(session, None)
        if objs is None:
            return 0
        for seg in objs.segments.values():  # unpin and unmap: a dead client's segments go with its lease
            self.segments.release(seg)
        freed = 0
        for event in objs.events.values():  # first: a stream's destruction need not outlive them
            try:
                self.backend.destroy_event(event)
            except GpuBrokerError as exc:
                log.warning("close_session %s: %s", session, exc.message)
        for stream in objs.streams.values():
            try:
                self.backend.destroy_stream(stream)
                freed += 1
            except GpuBrokerError as exc:
                log.warning("close_session %s: %s", session, exc.message)
        for entry in objs.buffers.values():
            self.tables.unreserve(entry.size)  # gone from the accounts whatever the device says
            try:
                self.backend.free_memory(entry.buffer)
                freed += 1
            except GpuBrokerError as exc:
                log.warning("close_session %s: %s", session, exc.message)
        for module in objs.modules.values():
            try:
                self.backend.unload_module(module)  # type: ignore[attr-defined]
            except GpuBrokerError as exc:
                log.warning("close_session %s: %s", session, exc.message)
        return freed

    # -- shared memory -----------------------------------------------------------------------------
    def op_register_segment(self, session: str, p: dict[str, Any]) -> Any:
        """Map the memfd the front sent on the fd channel with this request, under the client's handle."""
        token = p.get("token", b"")
        seg = self.segments.register(token if type(token) is bytes else b"", p.get("size"))  # first: fds in step
        try:
            handle = _handle(p.get("handle"))
            objs = self.tables.session(session)
            self.tables.claim(objs, "segment", handle)
        except GpuBrokerError:
            self.segments.release(seg)
            raise
        objs.segments[handle] = seg
        objs.kinds[handle] = "segment"

    def op_release_segment(self, session: str, p: dict[str, Any]) -> Any:
        objs = self.tables.session(session)
        handle = _handle(p.get("handle"))
        seg = objs.segment(handle)
        del objs.segments[handle], objs.kinds[handle]
        self.segments.release(seg)

    # -- links -------------------------------------------------------------------------------------
    def op_attach_link(self, session: str, p: dict[str, Any]) -> Any:
        """Take over a client's authenticated link (sent on the fd channel) for this session; the worker
        answers the client's hello itself, at once, or with ``held`` (the front's number for the link, an int)
        once the front says ``serve_link``."""
        held = p.get("held")
        if held is not None and type(held) is not int:
            raise InvalidArgument("attach_link: held must be an int")
        token = p.get("token", b"")
        fd = self.segments.receive(token if type(token) is bytes else b"")
        sock = socket.socket(fileno=fd)
        # The front hands over a Unix socket (same host, or its end of a TLS relay) or a vsock connection.
        if sock.family not in (socket.AF_UNIX, getattr(socket, "AF_VSOCK", -1)) or sock.type != socket.SOCK_STREAM:
            sock.close()
            raise InvalidArgument("a link must be a Unix or vsock stream socket")
        try:
            self.links.attach(sock, session, p.get("compress"), held)
        except GpuBrokerError:
            sock.close()
            raise
        except OSError as exc:
            sock.close()
            raise Internal(f"could not answer the client on its link: {exc}") from None
        return {"link": 1}

    def op_serve_link(self, session: str, p: dict[str, Any]) -> Any:
        """Answer and serve a link taken with ``held``: the front checked, after the hand-off, that the credential
        which opened it was not revoked meanwhile."""
        held = p.get("held")
        if type(held) is not int:
            raise InvalidArgument("serve_link: held must be an int")
        try:
            self.links.serve(held, session)
        except OSError as exc:
            raise Internal(f"could not answer the client on its link: {exc}") from None

    def op_drop_link(self, session: str, p: dict[str, Any]) -> Any:
        """Close a link taken with ``held`` that the front will not serve: its hand-off timed out."""
        held = p.get("held")
        if type(held) is not int:
            raise InvalidArgument("drop_link: held must be an int")
        self.links.drop(held, session)

    def op_close_links(self, session: str, p: dict[str, Any]) -> Any:
        """Close the session's links (the token that opened them was revoked); the session stays."""
        self.links.close_session(session)
