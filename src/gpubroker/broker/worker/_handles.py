"""The worker's one handle table: per session, the client's handles -> the backend's objects, with the limits.

Handles are chosen by the client (``_protocol.new_handle``) and scoped to its session: the same string in another
session is another object, or none. Every lookup answers an unknown, freed or foreign handle alike ("no buf
'b…' in this session"), so guessing teaches nothing. The front keeps no handle table: it sets the limits
(``set_limits``) and mirrors the memory use this table reports.

Limits: ``max_handles`` and ``max_streams`` hold per session; ``memory_quota`` holds for the whole worker, which
serves exactly one (tenant, device), so it is the tenant's quota on that device. Until the front sets them there
are none (a bare worker started by a test); a broker sends them before the first session's first command.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from gpubroker.broker.worker._segments import Segment
from gpubroker.wire.errors import InvalidArgument, NotFound, OutOfRange, ResourceExhausted
from gpubroker.wire.types import Buffer, Event, Kernel, Module, Stream

if TYPE_CHECKING:
    from gpubroker.broker.backends import TorchSession

__all__ = ["BufferEntry", "HandleTables", "KernelEntry", "Limits", "SessionObjects"]

# Cached views and resolved launches per session; past this a cache is simply cleared (never a wrong answer: an
# entry is dropped with any object it names).
_CACHE_MAX = 4096


@dataclass(slots=True)
class Limits:
    """What the front allows; None: not set (a bare worker), no limit."""

    memory_quota: int | None = None
    max_handles: int | None = None
    max_streams: int | None = None


@dataclass(slots=True)
class BufferEntry:
    buffer: Buffer  # the backend's, sized to the allocation
    size: int
    pins: int = 0  # CopyPeer copies under way that read or write it (the front pins both sides)


@dataclass(slots=True)
class KernelEntry:
    kernel: Kernel  # the backend's
    name: str
    module: str  # the client's module handle


@dataclass(slots=True)
class SessionObjects:
    """One session's objects by the client's handles."""

    id: str
    kinds: dict[str, str] = field(default_factory=dict)  # every handle in use -> its kind (one namespace)
    buffers: dict[str, BufferEntry] = field(default_factory=dict)
    streams: dict[str, Stream] = field(default_factory=dict)
    events: dict[str, Event] = field(default_factory=dict)
    modules: dict[str, Module] = field(default_factory=dict)
    kernels: dict[str, KernelEntry] = field(default_factory=dict)
    segments: dict[str, Segment] = field(default_factory=dict)
    memory_used: int = 0
    # (buffer handle, view offset) -> the backend's Buffer view: a launch's args are rebuilt from these.
    views: dict[tuple[str, int], Buffer] = field(default_factory=dict)
    # A launch's arguments as the client sent them -> the backend's argument list (workers/_executor.py).
    launch_args: dict[Any, Any] = field(default_factory=dict)  # (kernel, args) -> the backend's prepared launch
    # Reads left to send raw without trying to compress them: a chunk that did not shrink says the next ones of
    # the copy likely will not either (see the executor's _read).
    raw_reads: int = 0
    # The session's torch tensors (the torch device), made at its first torch command: PyTorch is imported then.
    torch: TorchSession | None = None

    def missing(self, kind: str, handle: str) -> NotFound:
        # The same answer for a freed, foreign or invented handle.
        return NotFound(f"no {kind} {handle!r} in this session")

    def buffer(self, handle: str) -> BufferEntry:
        entry = self.buffers.get(handle)
        if entry is None:
            raise self.missing("buf", handle)
        return entry

    def view(self, handle: str, offset: int) -> Buffer:
        """The backend's Buffer for the client's view ``(handle, offset)``; OUT_OF_RANGE past the allocation."""
        key = (handle, offset)
        view = self.views.get(key)
        if view is not None:
            return view
        entry = self.buffer(handle)
        if offset > entry.size:
            raise OutOfRange(f"buffer view offset {offset} is past the end of its {entry.size}-byte allocation")
        view = entry.buffer if offset == 0 else Buffer(entry.buffer.handle, entry.size, offset)
        if len(self.views) >= _CACHE_MAX:
            self.views.clear()
        self.views[key] = view
        return view

    def stream(self, handle: str) -> Stream | None:
        if not handle:
            return None
        stream = self.streams.get(handle)
        if stream is None:
            raise self.missing("stream", handle)
        return stream

    def event(self, handle: str) -> Event:
        event = self.events.get(handle)
        if event is None:
            raise self.missing("event", handle)
        return event

    def kernel(self, handle: str) -> KernelEntry:
        entry = self.kernels.get(handle)
        if entry is None:
            raise self.missing("kernel", handle)
        return entry

    def module(self, handle: str) -> Module:
        module = self.modules.get(handle)
        if module is None:
            raise self.missing("module", handle)
        return module

    def segment(self, handle: str) -> Segment:
        seg = self.segments.get(handle)
        if seg is None:
            raise self.missing("segment", handle)
        return seg

    def forget_caches(self) -> None:
        """An object went: cached views and launches may name it (a later object may reuse its handle)."""
        self.views.clear()
        self.launch_args.clear()


class HandleTables:
    """Every session's objects, the limits, and the worker's memory use (the tenant's on this device)."""

    def __init__(self, tenant: str = "", device: int = 0) -> None:
        self.tenant = tenant
        self.device = device  # the broker's index, named in quota errors (set_limits may correct it)
        self.limits = Limits()
        self.sessions: dict[str, SessionObjects] = {}
        self.memory_used = 0

    def session(self, session: str) -> SessionObjects:
        objs = self.sessions.get(session)
        if objs is None:
            objs = self.sessions[session] = SessionObjects(session)
        return objs

    def claim(self, objs: SessionObjects, kind: str, handle: str) -> None:
        """Check that ``handle`` is free and the session has room for one more object of ``kind``."""
        if handle in objs.kinds:
            used = objs.kinds[handle]
            raise InvalidArgument(f"handle {handle!r} is already in use in this session "
                                  f"({'an' if used[0] in 'aeiou' else 'a'} {used})")
        limit = self.limits.max_handles
        if limit is not None and len(objs.kinds) >= limit:
            raise ResourceExhausted(f"this session already holds {len(objs.kinds)} handles, the limit; free some",
                                    limit=limit)
        if kind == "stream" and self.limits.max_streams is not None and len(objs.streams) >= self.limits.max_streams:
            raise ResourceExhausted(f"this session already has {len(objs.streams)} streams, the limit",
                                    limit=self.limits.max_streams)

    def reserve(self, size: int) -> None:
        """Count ``size`` bytes against the quota before allocating them (the message of the front's quota)."""
        quota, used = self.limits.memory_quota, self.memory_used
        if quota is not None and used + size > quota:
            raise ResourceExhausted(
                f"memory quota exceeded for tenant {self.tenant!r} on device {self.device}: quota {quota} bytes, "
                f"used {used}, requested {size}", quota=quota, used=used, requested=size, device=self.device)
        self.memory_used = used + size

    def unreserve(self, size: int) -> None:
        self.memory_used = max(0, self.memory_used - size)

    def usage(self) -> dict[str, int]:
        return {sid: objs.memory_used for sid, objs in self.sessions.items()}
