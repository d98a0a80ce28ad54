"""Shared-memory segments: same-host clients hand memfds to their tenant's worker on a link connection.

gRPC cannot carry file descriptors; a Unix link can (SCM_RIGHTS). So a connection to ``<socket>.fast`` whose hello
says ``segments: 1`` (gpubroker/wire/link.py) is authenticated as every link is (``_links.py``: the pre-
authentication gate, the token, the failure delay, the audit) and then stays with the front, which registers
segments on it: ``RegisterSegment`` with the memfd attached, ``ReleaseSegment``; each answered in order. A
CopyShared command (on any transport: gRPC, a link, a ring) then moves bytes between a segment and device memory.
The front, not the worker, takes the descriptors: it checks each one and charges its bytes to the session and the
tenant before the worker maps it, and a worker runs its tenant's code.

This runs in the broker's event loop with only non-blocking socket calls, readiness waited for through
``add_reader``/``add_writer``: the loop's ``sock_recv`` cannot receive SCM_RIGHTS, and a thread per connection
would need waking to stop.

Bounds, after the hello's (_preauth.py): ``max_shm_connections_per_tenant`` segment connections per tenant (so one
tenant's idle connections cannot use up the front for the others) and ``MAX_CONNECTIONS`` in all; idle ones closed
after ``connection_idle_seconds``; a request of at most ``MAX_SEGMENT_FRAME`` bytes with at most one descriptor,
however its bytes are spread (a surplus is closed at once, audited with the tenant, charged the failure delay,
and the connection ends); the bytes mapped per session and per tenant (the tenant's ``shared_memory``, its memory
quota by default, and the broker's ``max_shared_bytes_per_tenant``); a memfd sealed against shrinking and growing,
exactly the size announced. A request that does not decode is answered INVALID_ARGUMENT and the connection goes
on; never a traceback.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import socket
import stat
import time
from collections.abc import Callable

from gpubroker.broker.config import BrokerConfig
from gpubroker.broker.front._descriptors import PASSRIGHTS_SUPPORTED, close_receiving, discard, set_passrights
from gpubroker.broker.front._preauth import IdleSweeper
from gpubroker.broker.front._sessions import Session, SessionManager, out_of_descriptors
from gpubroker.broker.front._status import descriptors_exhausted
from gpubroker.broker.front.auth import Authenticator, Principal, RateLimitedLog, failure_delay, wait_failure_delay
from gpubroker.wire import worker as to_worker  # (its RegisterSegment and ReleaseSegment: the worker's side)
from gpubroker.wire.errors import (
    GpuBrokerError,
    Internal,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    Unavailable,
)
from gpubroker.wire.frames import FRAME_HEADER, FrameDecoder, FrameTooLarge
from gpubroker.wire.link import (
    MAX_SEGMENT_FRAME,
    Malformed,
    RegisterSegment,
    SegmentRegistered,
    SegmentReleased,
    SegmentsAccepted,
    accepted,
    decode_segment_request,
    refusal,
)

__all__ = ["FdStream", "SegmentService", "SurplusFds", "check_segment_fd"]

log = logging.getLogger("gpubroker.server")
# Segment connections are cheap but not free: beyond this many at once, new ones are refused at their hello.
MAX_CONNECTIONS = 1024
# The descriptors one segment request may carry: a registration's memfd. A peer costs the front at most this many
# descriptors besides its socket, however it sends them.
FDS_PER_FRAME = 1
# The seals a segment must carry (the SDK's create_segment_fd adds them): it can neither shrink under the worker's
# mapping (touching a page past the end would SIGBUS the worker) nor grow past the size it was charged for.
SEGMENT_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
_FORMS = ('a segment request is ["register", handle, size] naming its segment by a handle of 1 to 64 characters, '
          'with its memfd attached, or ["release", handle]')


def check_segment_fd(fd: int, size: int) -> None:
    """Only a memfd sealed against shrinking and growing, exactly ``size`` bytes long.

    The tenant is charged ``size`` bytes, and the worker maps that much; but every page of the file is the worker's
    to fill (a kernel may map the whole file through a second mapping, ``mremap`` of the first), pages that no
    rlimit counts and that live as long as the memfd. So the file must hold exactly what was charged and never
    more: a sparse memfd larger than announced, or one that the client could grow after the check, would let the
    worker allocate host memory that nobody is charged for.

    This runs on the event loop, and the client chose the descriptor: a file of a FUSE filesystem (or a stale
    network mount) can block any call that asks its filesystem, ``fstat`` included, and with it the whole front.
    F_GET_SEALS asks nobody: only a memfd (shmem or hugetlbfs) answers it, every other file is EINVAL at once, and
    a tmpfs file that is no memfd answers F_SEAL_SEAL without F_SEAL_SHRINK. So the seals are checked first, and
    only a memfd, whose size is in memory, is ever ``fstat``-ed."""
    refusal = ("the segment must be a memfd sealed against shrinking and growing (F_SEAL_SHRINK | F_SEAL_GROW) "
               "after ftruncate to exactly the announced size, as the SDK's create_segment_fd makes it")
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:
        raise InvalidArgument(refusal) from None
    if seals & SEGMENT_SEALS != SEGMENT_SEALS:
        raise InvalidArgument(refusal)
    try:
        info = os.fstat(fd)
    except OSError:
        raise InvalidArgument(refusal) from None
    if not stat.S_ISREG(info.st_mode):
        raise InvalidArgument(refusal)
    if info.st_size != size:
        raise InvalidArgument(f"the segment's memfd holds {info.st_size} bytes, not the {size} announced: "
                              "announce its exact size (ftruncate it to that size before sealing it)")


async def _ready(loop: asyncio.AbstractEventLoop, fd: int, writable: bool) -> None:
    fut = loop.create_future()
    add, remove = (loop.add_writer, loop.remove_writer) if writable else (loop.add_reader, loop.remove_reader)

    def wake() -> None:
        if not fut.done():
            fut.set_result(None)

    add(fd, wake)
    try:
        await fut
    finally:
        remove(fd)


class CutShort(ConnectionError):
    """The peer closed in the middle of a frame."""


class SurplusFds(InvalidArgument):
    """A frame came with more descriptors than it may carry (all of them closed at once)."""


class FdStream:
    """A link listener's accepted socket on the event loop: read exactly, with the descriptors that come with
    the bytes (at most ``max_fds`` per frame: the hello none, a segment request one), and written without blocking.

    Never more than ``max_fds`` descriptors are held for a frame: a Unix stream delivers each message that carries
    descriptors on its own, so a peer could otherwise send a frame a byte at a time, each byte with descriptors,
    and have the front hold them all until the frame ends. The kernel drops what does not fit the one slot offered
    (MSG_CTRUNC), one more that arrives later is closed at once, and either way the frame is refused
    (``SurplusFds``). Reads stop at the end of the frame being read: the next frame's bytes, and the descriptors
    that come with them, stay in the socket until this one is answered (or, once a batch link's hello is read,
    for the worker)."""

    def __init__(self, sock: socket.socket, what: str) -> None:
        sock.setblocking(False)
        self.sock = sock
        self.what = what  # what a frame is, for a refusal: "a link hello", "a segment request"
        self.max_fds = 0
        self.fds: list[int] = []  # the frame's so far
        # It may have descriptors queued: once authenticated (allow_rights), or always where the kernel cannot refuse
        # them (no SO_PASSRIGHTS before Linux 6.16).
        self.rights = not PASSRIGHTS_SUPPORTED
        self.handed_on = False  # the socket is the worker's now (a link): the front's close is not its last
        self._loop = asyncio.get_running_loop()

    async def _recv(self, n: int) -> bytes:
        """At most ``n`` bytes, once some come (b"" at the peer's end), with the descriptors sent along."""
        while True:
            try:
                part, fds, flags, _ = socket.recv_fds(self.sock, n, max(1, self.max_fds))
            except BlockingIOError:
                await _ready(self._loop, self.sock.fileno(), writable=False)
                continue
            self.fds += fds
            if flags & socket.MSG_CTRUNC or len(self.fds) > self.max_fds:
                self.close_fds()
                most = f"at most {self.max_fds} file descriptor" if self.max_fds else "no file descriptor"
                raise SurplusFds(f"{self.what} carries {most}{' (a registration memfd)' if self.max_fds else ''}, "
                                 "attached to its frame; this one came with more")
            return part

    async def recv_exactly(self, n: int) -> bytes:
        """``n`` bytes; ConnectionError if the peer's end comes first."""
        data = bytearray()
        while len(data) < n:
            part = await self._recv(n - len(data))
            if not part:
                raise ConnectionError(f"closed with {len(data)} of {n} bytes read")
            data += part
        return bytes(data)

    async def read_frame(self, limit: int) -> tuple[bytes, list[int]] | None:
        """The next frame's payload and the descriptors that came with it (the caller closes them); None at the
        peer's end between frames, CutShort within one, InvalidArgument for a frame over ``limit`` bytes (before
        a byte of its payload is read)."""
        frames = FrameDecoder(limit, bytearray)
        while True:
            into = frames.buffer()  # (never past the frame's end: the next frame and its descriptors wait)
            part = await self._recv(len(into))
            if not part:
                cut = frames.cut_short()
                if cut is not None:
                    raise CutShort(cut)
                return None
            into[:len(part)] = part
            try:
                payload = frames.advance(len(part))
            except FrameTooLarge as exc:
                raise InvalidArgument(f"{self.what} of {exc.length} bytes exceeds {limit}") from None
            if payload is not None:
                fds, self.fds = self.fds, []
                return bytes(payload), fds

    async def send(self, frame: bytes) -> None:
        view = memoryview(frame)
        while view:
            try:
                view = view[self.sock.send(view):]
            except BlockingIOError:
                await _ready(self._loop, self.sock.fileno(), writable=True)

    async def answer(self, payload: bytes) -> None:
        await self.send(FRAME_HEADER.pack(len(payload)) + payload)

    def hang_up(self) -> None:
        """End the connection from outside its task (a revocation, idleness): its pending read sees the end."""
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)

    def close_fds(self) -> None:
        fds, self.fds = self.fds, []
        discard(fds)  # (never on the loop: a descriptor's last close may wait as long as its sender likes)

    def allow_rights(self) -> None:
        """Authenticated for segments: from now on the peer may pass descriptors (a segment's memfd; a batch link
        never: its socket goes to the worker, front/_links.py)."""
        set_passrights(self.sock, True)
        self.rights = True

    def close(self) -> None:
        self.close_fds()
        if self.rights and not self.handed_on:
            close_receiving(self.sock)  # (what is still queued in it is taken out first: see close_receiving)
        else:
            self.sock.close()


class SegmentService:
    """Serves the segment connections the link listeners authenticated: forwards each memfd to the tenant's
    worker, within the session's and tenant's shared-memory limits."""

    def __init__(self, config: BrokerConfig, auth: Authenticator, sessions: SessionManager) -> None:
        self.config = config
        self.auth = auth
        self.sessions = sessions
        self.idle = IdleSweeper(config.connection_idle_seconds, "segments connection")
        self.per_tenant: dict[str, int] = {}  # open segment connections per tenant
        self.connections = 0
        self.audit = RateLimitedLog(logging.getLogger("gpubroker.audit"))

    async def close(self) -> None:
        await self.idle.stop()

    async def serve(self, stream: FdStream, peer: str, penalty_key: str, session: Session,
                    principal: Principal) -> None:
        """Answer the hello of ``stream`` (authenticated by its listener for ``principal``, naming ``session``),
        then its requests, until it ends. The caller closes the stream."""
        tenant = session.tenant
        try:
            self._claim(tenant, peer)
        except GpuBrokerError as exc:
            await stream.answer(refusal(exc))
            return
        # Closed when this token is rotated or its tenant removed.
        watch = self.auth.revocations.watch(principal, stream.hang_up)
        idle = self.idle.add(stream.hang_up)
        try:
            await stream.answer(accepted(SegmentsAccepted()))
            stream.max_fds, stream.what = FDS_PER_FRAME, "a segment request"
            while True:
                try:
                    frame = await stream.read_frame(MAX_SEGMENT_FRAME)
                except SurplusFds as exc:  # audited with its tenant and charged the failure delay; then the end
                    self.audit.warning(f"segments surplus fds {tenant}", "refused: peer=%s tenant=%s reason=%s",
                                       peer, tenant, exc.message)
                    failure_delay.set(self.auth.penalty.fail(penalty_key))
                    await wait_failure_delay()
                    await stream.answer(refusal(exc))
                    return
                except InvalidArgument as exc:  # a frame too long: what follows cannot be framed
                    await stream.answer(refusal(exc))
                    return
                if frame is None:
                    return
                payload, fds = frame
                idle.busy += 1
                try:
                    reply = await self._request(session, payload, fds, peer)
                finally:
                    discard(fds)  # the worker has its own copy by now (or never will); never closed on the loop
                    idle.busy -= 1
                    idle.last_active = time.monotonic()
                await stream.answer(reply)
        except (ConnectionError, OSError):
            pass  # the client went away; its segments live on with its session
        finally:
            self.idle.remove(idle)
            self.auth.revocations.unwatch(principal, watch)
            self._unclaim(tenant)

    def _claim(self, tenant: str, peer: str) -> None:
        """Count a segment connection against the caps; ResourceExhausted or Unavailable past them."""
        if self.connections >= MAX_CONNECTIONS:
            raise Unavailable(f"the broker has {MAX_CONNECTIONS} shared-memory connections open; copies can go "
                              "without shared memory, or retry later")
        cap = self.config.max_shm_connections_per_tenant
        mine = self.per_tenant.get(tenant, 0)
        if mine >= cap:
            self.audit.warning(f"segments tenant cap {tenant}", "refused: peer=%s tenant=%s reason=%s", peer, tenant,
                               f"{mine} authenticated shared-memory connections open, the limit "
                               "(max_shm_connections_per_tenant)")
            raise ResourceExhausted(
                f"tenant {tenant!r} has {mine} shared-memory connections open, the limit "
                f"(max_shm_connections_per_tenant = {cap}); close RemoteGpu sessions you no longer use, or ask the "
                "operator to raise it", limit=cap, used=mine)
        self.per_tenant[tenant] = mine + 1
        self.connections += 1

    def _unclaim(self, tenant: str) -> None:
        self.connections -= 1
        left = self.per_tenant.get(tenant, 1) - 1
        if left > 0:
            self.per_tenant[tenant] = left
        else:
            self.per_tenant.pop(tenant, None)

    async def _request(self, session: Session, payload: bytes, fds: list[int], peer: str) -> bytes:
        """One request's answer: what it did, or why not."""
        try:
            try:
                request = decode_segment_request(payload)
            except Malformed as exc:
                raise InvalidArgument(f"malformed segment request ({exc}): {_FORMS}") from None
            # The session may have ended since the hello (closed, its lease expired, its worker lost).
            live = self.sessions.get(session.id, session.tenant)
            live.check_alive()
            if isinstance(request, RegisterSegment):
                if len(fds) != 1:
                    raise InvalidArgument(f"a registration carries exactly one file descriptor, got {len(fds)}")
                await self._register(live, fds[0], request.size, request.handle, peer)
                return accepted(SegmentRegistered(request.handle, request.size))
            await self._release(live, request.handle)
            return accepted(SegmentReleased())
        except GpuBrokerError as exc:
            return refusal(exc)
        except Exception as exc:
            if out_of_descriptors(exc):  # (the front's condition, for a while: no bug, no traceback)
                return refusal(descriptors_exhausted(exc))
            log.exception("segments: unexpected error")
            return refusal(Internal(f"internal broker error: {type(exc).__name__}"))

    def _check_limits(self, session: Session, size: int) -> None:
        """ResourceExhausted if ``size`` more bytes of shared memory would pass the session's or tenant's limit."""
        limit = self.config.max_shared_bytes_per_session
        if session.shared_bytes + size > limit:
            raise ResourceExhausted(f"this session would map {session.shared_bytes + size} bytes of shared memory; "
                                    f"the limit is {limit}", limit=limit, used=session.shared_bytes, requested=size)
        # Summed over all of the tenant's sessions (on every device): sessions x the per-session limit is no bound.
        tenant_limit, which = self.config.shared_limit(session.tenant)
        tenant_used = self.sessions.shared(session.tenant)
        if tenant_used + size > tenant_limit:
            raise ResourceExhausted(
                f"tenant {session.tenant!r} would map {tenant_used + size} bytes of shared memory across its "
                f"sessions: {size} requested, {tenant_used} in use, and the limit ({which}) is "
                f"{tenant_limit}; release segments (drop host arrays) or end sessions first, or ask the operator "
                "to raise it", limit=tenant_limit, used=tenant_used, requested=size)

    def charge(self, session: Session, size: int) -> Callable[[], None]:
        """Count ``size`` bytes of shared memory the front itself gives the session's worker (a link's ring, whose
        every page the worker can fill: its whole size), within the limits a segment is held to; ResourceExhausted
        past them. The callable returned uncounts it (once)."""
        self._check_limits(session, size)
        self.sessions.reserve_shared(session, size)
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self.sessions.release_shared(session, size)

        return release

    async def _register(self, session: Session, fd: int, size: int, handle: str, peer: str) -> None:
        self._check_limits(session, size)
        try:
            check_segment_fd(fd, size)
        except InvalidArgument as exc:  # a client that is not the SDK, or a hostile one: the operator sees it
            self.audit.warning(f"segments segment {session.tenant}", "refused: peer=%s tenant=%s reason=%s", peer,
                               session.tenant, exc.message)
            raise
        if handle in session.segments:
            raise InvalidArgument(f"segment {handle!r} is already registered in this session")
        # Reserved before the worker maps it, so concurrent registrations can never overshoot the limits.
        self.sessions.reserve_shared(session, size)
        session.segments[handle] = size
        try:
            await session.worker.call(to_worker.RegisterSegment(handle, size), session.id, fd)
        except BaseException:
            if session.segments.pop(handle, None) is not None:
                self.sessions.release_shared(session, size)
            raise
        if self.sessions.sessions.get(session.id) is not session or session.lost is not None:
            # Closed while the worker mapped it: the worker's close ran first, so unmap this one too. (The close
            # uncounted this segment with the rest of the session's.)
            with contextlib.suppress(GpuBrokerError):
                await session.worker.call(to_worker.ReleaseSegment(handle), session.id)
            raise NotFound(f"no session {session.id!r}")

    async def _release(self, session: Session, handle: str) -> None:
        if handle not in session.segments:
            raise NotFound(f"no segment {handle[:80]!r} in this session")
        await session.worker.call(to_worker.ReleaseSegment(handle), session.id)
        size = session.segments.pop(handle, None)
        if size is not None:
            self.sessions.release_shared(session, size)
