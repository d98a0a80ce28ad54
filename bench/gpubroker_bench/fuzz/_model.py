"""What the fuzzer believes the broker holds: sessions, handles, device memory, and every buffer's bytes.

The broker must agree with it exactly after every case. Buffer contents are shadowed byte by byte where they
are known, so a copy that succeeded must read back what was written. Work queued on different streams is not
ordered: an operation on one stream while asynchronous work is pending on another is racy, its writes make
bytes unknown and its reads are not checked, until a synchronize settles the streams.
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass, field

import numpy as np

__all__ = ["ALLOWED_CODES", "Buf", "Model", "Seg", "Sess"]

# The statuses the API documents; INTERNAL and UNKNOWN (a broker bug) never are.
ALLOWED_CODES = frozenset({
    "INVALID_ARGUMENT", "NOT_FOUND", "OUT_OF_RANGE", "RESOURCE_EXHAUSTED", "PERMISSION_DENIED", "UNAUTHENTICATED",
    "FAILED_PRECONDITION", "DEADLINE_EXCEEDED", "ABORTED", "UNAVAILABLE"})


@dataclass
class Buf:
    handle: str
    size: int
    data: bytearray = field(init=False)
    known: bytearray = field(init=False)  # 1 where ``data`` holds what the device must hold

    def __post_init__(self) -> None:
        self.data = bytearray(self.size)
        self.known = bytearray(self.size)

    def forget(self, start: int, n: int) -> None:
        self.known[start:start + n] = bytes(n)

    def set(self, start: int, payload: bytes | bytearray | memoryview, known: bytes | bytearray | None = None) -> None:
        n = len(payload)
        self.data[start:start + n] = payload
        self.known[start:start + n] = b"\x01" * n if known is None else known

    def mismatch(self, start: int, got: bytes | bytearray | memoryview) -> int | None:
        """The first offset whose known byte differs from ``got``, or None."""
        n = len(got)
        known = np.frombuffer(self.known, np.uint8, n, start).astype(bool)
        differ = np.frombuffer(self.data, np.uint8, n, start) != np.frombuffer(got, np.uint8, n)
        bad = np.flatnonzero(known & differ)
        return int(bad[0]) + start if bad.size else None


@dataclass
class Seg:
    handle: str
    size: int
    mm: mmap.mmap


@dataclass
class Sess:
    id: str
    tenant: str
    bufs: dict[str, Buf] = field(default_factory=dict)
    modules: dict[str, list[str]] = field(default_factory=dict)
    kernels: dict[str, str] = field(default_factory=dict)
    streams: set[str] = field(default_factory=set)
    segs: dict[str, Seg] = field(default_factory=dict)
    lost: bool = False  # its worker died: the broker dropped every handle and freed its memory
    # Streams with asynchronous work (memsets, device copies) not yet known to be finished, and the device copies
    # among it (destination, start, length, stream): a write racing them may change what they copy.
    inflight: set[str] = field(default_factory=set)
    pending_copies: list[tuple[Buf, int, int, str]] = field(default_factory=list)

    @property
    def memory(self) -> int:
        return sum(b.size for b in self.bufs.values())

    def handles(self) -> list[str]:
        return [*self.bufs, *self.modules, *self.kernels, *self.streams, *self.segs]

    def racy(self, stream: str) -> bool:
        """Whether work on ``stream`` is unordered with asynchronous work queued on another stream."""
        return bool(self.inflight - {stream})

    def racing_write(self, stream: str) -> None:
        """A write on ``stream`` that races other streams: what their pending copies copy is unknown now."""
        for dst, start, n, other in self.pending_copies:
            if other != stream:
                dst.forget(start, n)

    def settle(self, stream: str | None) -> None:
        """Work queued on ``stream`` (on every stream with None) has finished."""
        if stream is None:
            self.inflight.clear()
            self.pending_copies.clear()
        else:
            self.inflight.discard(stream)
            self.pending_copies = [c for c in self.pending_copies if c[3] != stream]


class Model:
    """The fuzzer's sessions across tenants, and the handles it has seen die."""

    def __init__(self, tokens: dict[str, str]) -> None:
        self.tokens = tokens
        self.sessions: dict[str, Sess] = {}
        self.dead_sessions: list[str] = []
        self.dead_handles: list[str] = []

    def open(self, session: str, tenant: str) -> Sess:
        sess = self.sessions[session] = Sess(session, tenant)
        return sess

    def _bury(self, handles: list[str]) -> None:
        self.dead_handles.extend(handles)
        del self.dead_handles[:-64]  # enough to pick from; bounded over a long run

    def drop_handles(self, sess: Sess) -> None:
        self._bury(sess.handles())
        for seg in sess.segs.values():
            seg.mm.close()
        sess.bufs.clear()
        sess.modules.clear()
        sess.kernels.clear()
        sess.streams.clear()
        sess.segs.clear()

    def close(self, sess: Sess) -> None:
        self.drop_handles(sess)
        self.sessions.pop(sess.id, None)
        self.dead_sessions.append(sess.id)
        del self.dead_sessions[:-16]

    def worker_lost(self, tenant: str) -> None:
        """The tenant's worker died: each of its sessions is lost, their handles and memory gone."""
        for sess in self.sessions.values():
            if sess.tenant == tenant:
                sess.lost = True
                self.drop_handles(sess)

    def free(self, sess: Sess, handle: str) -> None:
        sess.bufs.pop(handle)
        self._bury([handle])

    def destroy_stream(self, sess: Sess, handle: str) -> None:
        sess.streams.discard(handle)
        sess.settle(handle)
        self._bury([handle])

    def release_segment(self, sess: Sess, handle: str) -> None:
        seg = sess.segs.pop(handle)
        seg.mm.close()
        self._bury([handle])

    def tenant_memory(self, tenant: str) -> int:
        return sum(s.memory for s in self.sessions.values() if s.tenant == tenant)

    def live(self, tenant: str | None = None) -> list[Sess]:
        return [s for s in self.sessions.values() if not s.lost and (tenant is None or s.tenant == tenant)]
