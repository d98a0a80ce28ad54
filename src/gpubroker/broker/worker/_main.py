"""The worker's requests from the front: device work as protocol batches, and the front's own operations.

It knows nothing of gRPC. Requests are typed (gpubroker/wire/worker.py: ``ToWorker`` frames, each answered by a
``FromWorker`` with its result or its WireError; the loop is in _process.py). Device work is ``RunBatch`` (an
encoded protocol Batch, run by the one executor that also serves links); every other request is the front's:
limits, accounting, sessions, segments, links, and copies between devices.
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
from gpubroker.broker.worker._peer import PeerOps
from gpubroker.broker.worker._ring import RING_FDS, WorkerRing, open_ring
from gpubroker.broker.worker._segments import SegmentTable
from gpubroker.wire.commands import MAX_HANDLE, encode, parse_batch
from gpubroker.wire.compute import GpuCompute
from gpubroker.wire.errors import GpuBrokerError, Internal, InvalidArgument
from gpubroker.wire.worker import (
    CONTROL,
    EXIT_FATAL,
    AttachLink,
    CloseLinks,
    CloseSession,
    DeviceTime,
    DropLink,
    FromWorker,
    LeaseToFront,
    PeerClose,
    PeerCopy,
    PeerExport,
    PeerLocal,
    PeerOpen,
    Pin,
    Ping,
    RegisterSegment,
    ReleaseSegment,
    RunBatch,
    ServeLink,
    SetLimits,
    TakeDeviceTime,
    Unpin,
    Usage,
    UsageReport,
    WorkerRequest,
    send_payload,
)

__all__ = ["EXIT_FATAL", "WorkerServer"]

log = logging.getLogger("gpubroker.worker")


class WorkerServer:
    """Serves the front's requests against one backend through the one handle table and executor."""

    def __init__(self, backend: GpuCompute, tenant: str = "", device: int = 0) -> None:
        self.backend = backend
        self.front: socket.socket | None = None
        self.tables = HandleTables(tenant, device)
        self.segments = SegmentTable(backend)  # shared-memory segments; main() attaches the fd channel
        self.executor = Executor(backend, self.tables, self.segments)
        self.links = Links(self.executor, self._send_front)
        # (CUDA's only: an OpenCL device has no context an error corrupts)
        self._context_lost: Callable[[], bool] | None = getattr(backend, "context_lost", None)
        self.peers = PeerOps(backend, self.tables)  # copies between a tenant's sessions (workers/_peer.py)
        peers = self.peers
        # Each request's handler, by its class; each takes the session and the request (typed: its fields were
        # checked as it was decoded).
        self._handlers: dict[type[WorkerRequest[Any]], Callable[[str, Any], Any]] = {
            RunBatch: self.op_batch, Ping: self.op_ping, TakeDeviceTime: self.op_take_device_time,
            SetLimits: self.op_set_limits, Usage: self.op_usage, CloseSession: self.op_close_session,
            RegisterSegment: self.op_register_segment, ReleaseSegment: self.op_release_segment,
            AttachLink: self.op_attach_link, ServeLink: self.op_serve_link, DropLink: self.op_drop_link,
            CloseLinks: self.op_close_links, Pin: peers.pin, Unpin: peers.unpin, PeerLocal: peers.local,
            PeerExport: peers.export, PeerOpen: peers.open, PeerCopy: peers.copy, PeerClose: peers.close,
        }

    @property
    def fatal(self) -> bool:
        """A command corrupted the device context (or a wait found it corrupted): the worker exits once it has
        replied."""
        return self.executor.fatal or (self._context_lost is not None and self._context_lost())

    def _send_front(self, message: LeaseToFront) -> None:
        if self.front is not None:
            send_payload(self.front, encode(FromWorker(CONTROL, 0, message)))

    def handle(self, session: str, request: WorkerRequest[Any]) -> Any:
        """Serve one request of the front's; its result (of the type the request returns)."""
        handler = self._handlers.get(type(request))
        if handler is None:
            raise InvalidArgument(f"unknown worker request {type(request).__name__[:40]!r}")
        return handler(session, request)

    # -- device work -------------------------------------------------------------------------------
    def op_batch(self, session: str, request: RunBatch) -> bytes:
        """Run an encoded protocol Batch (module loads included); the result is its encoded Ack."""
        return encode(self.executor.run(session, parse_batch(request.batch)))

    # -- the front's own ---------------------------------------------------------------------------
    def op_ping(self, session: str, request: Ping) -> int:
        return os.getpid()

    def op_take_device_time(self, session: str, request: TakeDeviceTime) -> DeviceTime:
        """Device seconds used since the last take (the fair scheduler's charge; waits for queued work), and
        the memory in use, which the front mirrors."""
        take = getattr(self.backend, "take_device_time", None)
        return DeviceTime(float(take()) if take is not None else 0.0, self.tables.memory_used)

    def op_set_limits(self, session: str, request: SetLimits) -> None:
        """The tenant's memory quota on this device and the per-session limits (at start and every reload)."""
        self.tables.limits = Limits(request.memory_quota, request.max_handles, request.max_streams)
        if request.device is not None:
            self.tables.device = request.device
        if request.max_frame is not None:
            self.links.max_frame = self.executor.max_inflate = request.max_frame

    def op_usage(self, session: str, request: Usage) -> UsageReport:
        done = self.executor.done
        return UsageReport(self.tables.memory_used, self.tables.usage(), done.launches, done.h2d_bytes,
                           done.d2h_bytes, done.d2d_bytes)

    def op_close_session(self, session: str, request: CloseSession) -> int:
        """Free everything the session owned; an error on one object does not stop the rest. Returns how many
        buffers and streams were freed."""
        self.links.close_session(session)
        self.peers.close_session(session)
        objs = self.tables.sessions.pop(session, None)
        if objs is None:
            return 0
        for seg in objs.segments.values():  # unpin and unmap: a dead client's segments go with its lease
            self.segments.release(seg)
        freed = 0
        if objs.torch is not None:  # its tensors' storages leave the accounts with them
            objs.torch.close()
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
    def op_register_segment(self, session: str, request: RegisterSegment) -> None:
        """Map the memfd the front sent on the fd channel with this request, under the client's handle."""
        seg = self.segments.register(request.token, request.size)  # first: the fds stay in step with requests
        handle = request.handle
        try:
            if not 0 < len(handle) <= MAX_HANDLE:
                raise InvalidArgument(f"a handle must be a string of 1 to {MAX_HANDLE} characters")
            objs = self.tables.session(session)
            self.tables.claim(objs, "segment", handle)
        except GpuBrokerError:
            self.segments.release(seg)
            raise
        objs.segments[handle] = seg
        objs.kinds[handle] = "segment"

    def op_release_segment(self, session: str, request: ReleaseSegment) -> None:
        objs = self.tables.session(session)
        handle = request.handle
        seg = objs.segment(handle)
        del objs.segments[handle], objs.kinds[handle]
        self.segments.release(seg)

    # -- links -------------------------------------------------------------------------------------
    def op_attach_link(self, session: str, request: AttachLink) -> None:
        """Take over a client's authenticated link (sent on the fd channel) for this session; the worker
        answers the client's hello itself, at once, or with ``held`` (the front's number for the link) once the
        front says ServeLink."""
        spec = request.ring
        fd, *ring_fds = self.segments.receive_all(request.token, 1 + (RING_FDS if spec is not None else 0))
        ring: WorkerRing | None = None
        if spec is not None:
            # Mapped now and its memfd closed (the mapping keeps it): the front made it and charged it to the
            # tenant's shared memory. A ring that cannot be mapped leaves a plain link (the answer says so).
            try:
                ring = open_ring(spec.commands, spec.acks, spec.spin_us, ring_fds, self.links.max_frame)
            except (GpuBrokerError, OSError) as exc:
                log.warning("a link's ring of session %s not mapped: %s", session,
                            exc.message if isinstance(exc, GpuBrokerError) else exc)
        sock = socket.socket(fileno=fd)
        try:
            # The front hands over a Unix socket (same host, or its end of a TLS relay) or a vsock connection.
            if (sock.family not in (socket.AF_UNIX, getattr(socket, "AF_VSOCK", -1))
                    or sock.type != socket.SOCK_STREAM):
                raise InvalidArgument("a link must be a Unix or vsock stream socket")
            self.links.attach(sock, session, request.compress, request.held, ring, request.spin_us)
        except GpuBrokerError:
            sock.close()
            if ring is not None:
                ring.close()
            raise
        except OSError as exc:
            sock.close()
            if ring is not None:
                ring.close()  # (again, if the link's drop closed it: closing twice does nothing)
            raise Internal(f"could not answer the client on its link: {exc}") from None

    def op_serve_link(self, session: str, request: ServeLink) -> None:
        """Answer and serve a link taken with ``held``: the front checked, after the hand-off, that the credential
        which opened it was not revoked meanwhile."""
        try:
            self.links.serve(request.held, session)
        except OSError as exc:
            raise Internal(f"could not answer the client on its link: {exc}") from None

    def op_drop_link(self, session: str, request: DropLink) -> None:
        """Close a link taken with ``held`` that the front will not serve: its hand-off timed out."""
        self.links.drop(request.held, session)

    def op_close_links(self, session: str, request: CloseLinks) -> None:
        """Close the session's links (the token that opened them was revoked); the session stays."""
        self.links.close_session(session)
