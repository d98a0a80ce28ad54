"""The shared-memory side channel: same-host clients hand memfd segments to their tenant's worker.

gRPC cannot carry file descriptors, so each ``unix:PATH`` listener gets a sibling socket ``PATH.shm`` (same mode
and group). The protocol is in ``gpubroker/client/_shm.py``. This runs in the broker's event loop with only
non-blocking socket calls, readiness waited for through ``add_reader``/``add_writer``: uvloop's ``sock_recv``
cannot receive SCM_RIGHTS, and a thread per connection would need waking to stop.

Bounds: before authentication, the pre-authentication gate (_preauth.py: caps per uid and in all, the hello's size
and time, a newer connection of a peer taking an idle one's place); after it, ``max_shm_connections_per_tenant``
connections per tenant (so one tenant's idle connections cannot use up the listener for the others), and the
bytes mapped per session and per tenant (the tenant's ``shared_memory``, its memory quota by default, and the
broker's ``max_shared_bytes_per_tenant``). A malformed first frame is refused as a failed authentication is: an
answer, an audit line and the failure delay; never a traceback. So is a frame that comes with more than one
descriptor, however they are spread over its bytes: the front never holds more than one of a peer's descriptors.
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
from pathlib import Path
from typing import Any

from gpubroker.broker.config import BrokerConfig
from gpubroker.broker.front._preauth import Idle, IdleSweeper, PreAuthGate, Ticket, refuse_malformed
from gpubroker.broker.front._sessions import Session, SessionManager, out_of_descriptors
from gpubroker.broker.front._status import descriptors_exhausted
from gpubroker.broker.front.auth import (
    Authenticator,
    Principal,
    RateLimitedLog,
    failure_delay,
    peer_credentials,
    wait_failure_delay,
)
from gpubroker.wire.commands import MAX_HANDLE
from gpubroker.wire.errors import (
    GpuBrokerError,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
)
from gpubroker.wire.frames import FRAME_HEADER, MAX_FRAME, pack_frame, unpack_frame
from gpubroker.wire.worker import RegisterSegment, ReleaseSegment

__all__ = ["SharedMemoryServer"]

log = logging.getLogger("gpubroker.server")
# Connections are cheap but not free: beyond this many at once, new ones are closed at once.
MAX_CONNECTIONS = 1024
# The descriptors one request may carry: a registration's segment. Any request may be a connection's first (the
# token rides in every request, so a client may register without a hello), so a frame not yet authenticated may
# carry it too; a peer costs the front at most this many descriptors besides its socket, however it sends them.
FDS_PER_FRAME = 1


def _answer_and_close(conn: socket.socket, error: GpuBrokerError) -> None:
    """Best effort: a fresh socket's buffer takes a short answer without blocking; then the close."""
    with contextlib.suppress(OSError):
        conn.setblocking(False)
        conn.send(_refusal(error))
    conn.close()


# The seals a segment must carry (the SDK's create_segment_fd adds them): it can neither shrink under the worker's
# mapping (touching a page past the end would SIGBUS the worker) nor grow past the size it was charged for.
SEGMENT_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW


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


async def _wait(loop: asyncio.AbstractEventLoop, fd: int, writable: bool) -> None:
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


class _CutShort(ConnectionError):
    """The peer closed in the middle of a frame."""


class _SurplusFds(InvalidArgument):
    """A frame came with more descriptors than a request carries (all of them closed at once)."""


def _refusal(error: GpuBrokerError) -> bytes:
    return pack_frame({"error": error.to_wire()})


# The types a request's fields have when present (more fields are allowed: a newer client's).
# (A registration's handle and size are checked with the registration, which says what they must be.)
_FIELDS: dict[str, type] = {"token": str, "session": str, "release": str, "hello": int}


def _malformed(message: Any) -> str:
    """Why a request is not one (empty: it is well formed)."""
    if not isinstance(message, dict):
        return f"not a map but {type(message).__name__}"
    for name, kind in _FIELDS.items():
        value = message.get(name)
        if value is not None and (not isinstance(value, kind) or isinstance(value, bool)):
            return f"{name} is {type(value).__name__}, not {kind.__name__}"
    return ""


class _Connection:
    """One client's connection: frames in (with any fds that came along), replies out."""

    def __init__(self, sock: socket.socket, peer: str, ticket: Ticket) -> None:
        self.sock = sock
        self.peer = peer
        self.ticket = ticket  # open until a request authenticates
        self.loop = asyncio.get_running_loop()
        self._buf = bytearray()
        self._fds: list[int] = []
        self.limit = MAX_FRAME
        self.tenant: str | None = None  # whose connection this is, from its first authenticated request
        self.closing = False  # refused for good: closed once the refusal is answered
        self.watches: dict[tuple[str, str], tuple[Principal, int]] = {}  # revocation watches, by credential

    async def read(self) -> tuple[Any, list[int]] | None:
        """The next request and the fds received with it (the caller closes them); None at end of stream.

        Never more than FDS_PER_FRAME descriptors are held for a frame: a Unix stream delivers each message that
        carries descriptors on its own, so a peer could otherwise send a frame a byte at a time, each byte with
        descriptors, and have the front hold them all until the frame ends (or its own limit is reached). The
        kernel drops what does not fit the one slot offered (MSG_CTRUNC), a second one that arrives later is
        closed at once, and either way the connection is refused (``_SurplusFds``)."""
        while True:
            limit = self.limit
            # Only up to the end of the frame being read (its header first): the next frame's bytes, and the
            # descriptors that come with them, stay in the socket until this one is answered.
            want = FRAME_HEADER.size - len(self._buf)
            if want <= 0:
                (length,) = FRAME_HEADER.unpack_from(self._buf)
                if length > limit:  # (a hello's is audited and delayed by the caller, as any malformed hello)
                    if self.ticket.open:
                        raise InvalidArgument(f"hello of {length} bytes exceeds hello_max_bytes ({limit})")
                    raise InvalidArgument(f"side-channel frame of {length} bytes exceeds {limit}")
                end = FRAME_HEADER.size + length
                if len(self._buf) >= end:
                    payload = bytes(self._buf[FRAME_HEADER.size:end])
                    del self._buf[:end]
                    fds, self._fds = self._fds, []
                    try:
                        return unpack_frame(payload), fds
                    except Exception as exc:  # (ValueError and kin; TypeError for a list or map as a key)
                        self._fds = fds  # closed with the connection
                        raise InvalidArgument(f"malformed side-channel request: not msgpack ({type(exc).__name__}); "
                                              "a request is one msgpack map") from None
                want = end - len(self._buf)
            try:
                data, fds, flags, _ = socket.recv_fds(self.sock, want, FDS_PER_FRAME)
            except BlockingIOError:
                await _wait(self.loop, self.sock.fileno(), writable=False)
                continue
            self._fds += fds
            if flags & socket.MSG_CTRUNC or len(self._fds) > FDS_PER_FRAME:
                self._close_fds()
                raise _SurplusFds(f"a side-channel request carries at most {FDS_PER_FRAME} file descriptor (a "
                                  "registration's memfd), attached to its frame; this one came with more")
            if not data:
                if self._buf:
                    raise _CutShort(f"cut short: the peer closed with {len(self._buf)} bytes of a frame unread")
                return None
            self._buf += data

    async def write(self, obj: Any) -> None:
        view = memoryview(pack_frame(obj))
        while view:
            try:
                view = view[self.sock.send(view):]
            except BlockingIOError:
                await _wait(self.loop, self.sock.fileno(), writable=True)

    def hang_up(self) -> None:
        """End the connection from outside its task (a revocation, idleness): its pending read sees the end."""
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)

    def _close_fds(self) -> None:
        fds, self._fds = self._fds, []
        for fd in fds:
            os.close(fd)

    def close(self) -> None:
        self.ticket.done()
        self._close_fds()
        self.sock.close()


class SharedMemoryServer:
    """Accepts segment registrations on every ``.shm`` socket and forwards each fd to the tenant's worker."""

    def __init__(self, config: BrokerConfig, auth: Authenticator, sessions: SessionManager,
                 gate: PreAuthGate | None = None) -> None:
        self.config = config
        self.auth = auth
        self.sessions = sessions
        self.gate = gate if gate is not None else PreAuthGate(config)
        self.idle = IdleSweeper(config.connection_idle_seconds, "side channel")
        self._listeners: list[tuple[socket.socket, Path, int]] = []
        self.per_tenant: dict[str, int] = {}  # authenticated connections per tenant
        self.audit = RateLimitedLog(logging.getLogger("gpubroker.audit"))
        self.accept_log = RateLimitedLog(log)
        self._tasks: set[asyncio.Task[None]] = set()

    def listen(self, path: Path, secure: Callable[[Path], None]) -> None:
        """Bind ``path`` (a stale socket there must already be gone), secure it, then listen: never open early."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(str(path))
            secure(path)
            sock.listen(64)
            sock.setblocking(False)
        except BaseException:
            sock.close()
            raise
        self._listeners.append((sock, path, os.stat(path).st_ino))
        self._spawn(self._accept(sock, path))

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.idle.stop()
        for sock, path, ino in self._listeners:
            sock.close()
            with contextlib.suppress(OSError):
                if os.stat(path).st_ino == ino:  # still ours, not a newer broker's
                    path.unlink()
        self._listeners.clear()

    async def _accept(self, listener: socket.socket, path: Path) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, _ = await loop.sock_accept(listener)
            except OSError as exc:  # EMFILE and the like: back off rather than spin (and log it rate-limited)
                self.accept_log.warning(f"shm accept {path}", "side channel %s: accept failed: %s", path, exc)
                await asyncio.sleep(0.1)
                continue
            if len(self._tasks) > MAX_CONNECTIONS:
                pid, uid = peer_credentials(conn)
                self.gate.refused(str(path), pid, uid, f"{MAX_CONNECTIONS} side-channel connections open, the limit")
                _answer_and_close(conn, Unavailable(f"the broker has {MAX_CONNECTIONS} shared-memory connections "
                                                     "open; copies can go without shared memory, or retry later"))
                continue
            ticket = self.gate.admit(conn, str(path))
            if ticket is None:  # past a cap on unauthenticated connections: refused (and audited) at once
                _answer_and_close(conn, ResourceExhausted(
                    "too many unauthenticated shared-memory connections from your uid are open; send the "
                    "request at once after connecting (the SDK does), or retry later"))
                continue
            connection = _Connection(conn, ticket.peer, ticket)
            # Until its first request comes, a newer connection of its peer may take its place (_preauth.py).
            ticket.sock, ticket.evict = conn, connection.hang_up
            conn.setblocking(False)
            self._spawn(self._serve(connection))

    async def _serve(self, conn: _Connection) -> None:
        idle: Idle | None = None
        try:
            while True:
                try:
                    if conn.ticket.open:  # the first request is the hello: small, and soon
                        conn.limit = min(MAX_FRAME, self.gate.hello_max_bytes)
                        try:
                            async with asyncio.timeout(self.gate.hello_timeout):
                                request = await conn.read()
                        except TimeoutError:
                            conn.ticket.refuse("no request within hello_timeout_seconds "
                                               f"({self.config.hello_timeout_seconds:g} s)")
                            return
                    else:
                        conn.limit = MAX_FRAME
                        request = await conn.read()
                except GpuBrokerError as exc:  # a broken frame: say why, then hang up
                    if conn.ticket.open:  # a malformed hello: audited and delayed as a failed authentication
                        await refuse_malformed(conn.ticket, self.auth.penalty, f"uid:{conn.ticket.uid}", exc.message)
                    elif isinstance(exc, _SurplusFds):  # (its tenant's: audited and delayed the same way)
                        await self._refuse_surplus(conn, exc)
                    await conn.write({"error": exc.to_wire()})
                    return
                except _CutShort as exc:
                    if conn.ticket.open:
                        await refuse_malformed(conn.ticket, self.auth.penalty, f"uid:{conn.ticket.uid}", str(exc))
                    return
                if request is None:
                    return
                message, fds = request
                malformed = _malformed(message)
                if malformed:
                    for fd in fds:
                        os.close(fd)
                    hello = conn.ticket.open
                    if hello:  # audited and delayed as a failed authentication; then the connection ends
                        await refuse_malformed(conn.ticket, self.auth.penalty, f"uid:{conn.ticket.uid}", malformed)
                    await conn.write({"error": InvalidArgument(
                        f"malformed side-channel request ({malformed}): it is one msgpack map "
                        '{"token": str, "session": str, and "size": int + "handle": str, "release": str or '
                        '"hello": 1}').to_wire()})
                    if hello:
                        return
                    continue  # (an authenticated connection goes on, as after any refused request)
                if idle is not None:
                    idle.busy += 1
                failed = False
                conn.ticket.judging = True  # (a request in hand: not to be evicted while it is judged)
                try:
                    reply = await self._handle(conn, message, fds)
                except GpuBrokerError as exc:
                    reply = {"error": exc.to_wire()}
                    failed = isinstance(exc, Unauthenticated)
                except Exception as exc:
                    if out_of_descriptors(exc):  # (the front's condition, for a while: no bug, no traceback)
                        reply = {"error": descriptors_exhausted(exc).to_wire()}
                    else:
                        log.exception("side channel: unexpected error")
                        reply = {"error": {"code": "INTERNAL",
                                           "message": f"internal broker error: {type(exc).__name__}"}}
                finally:
                    conn.ticket.judging = False
                    for fd in fds:  # the worker has its own copy by now (or never will)
                        os.close(fd)
                    if idle is not None:
                        idle.busy -= 1
                        idle.last_active = time.monotonic()
                if failed:
                    await (conn.ticket.sit_out_failure() if conn.ticket.open else wait_failure_delay())
                await conn.write(reply)
                if conn.ticket.open or conn.closing:
                    return  # a connection that did not authenticate gets one try
                if idle is None:
                    idle = self.idle.add(conn.hang_up)
        except (ConnectionError, OSError):
            pass  # the client went away; its segments live on with its session
        finally:
            for principal, watch in conn.watches.values():
                self.auth.revocations.unwatch(principal, watch)
            if conn.tenant is not None:
                left = self.per_tenant.get(conn.tenant, 1) - 1
                if left > 0:
                    self.per_tenant[conn.tenant] = left
                else:
                    self.per_tenant.pop(conn.tenant, None)
            if idle is not None:
                self.idle.remove(idle)
            conn.close()

    async def _refuse_surplus(self, conn: _Connection, exc: _SurplusFds) -> None:
        """An authenticated connection sent a frame with surplus descriptors: audited with its tenant and charged
        the failure delay to its peer, as a malformed hello is (the caller answers and hangs up)."""
        self.audit.warning(f"shm surplus fds {conn.tenant}", "refused: peer=%s tenant=%s reason=%s", conn.peer,
                           conn.tenant, exc.message)
        failure_delay.set(self.auth.penalty.fail(f"uid:{conn.ticket.uid}"))
        await wait_failure_delay()

    def _claim(self, conn: _Connection, tenant: str) -> None:
        """Count an authenticated connection against its tenant's cap (once); a connection is one tenant's."""
        if conn.tenant == tenant:
            return
        if conn.tenant is not None:
            conn.closing = True
            raise PermissionDenied(
                f"this shared-memory connection is tenant {conn.tenant!r}'s; connect again for another tenant")
        cap = self.config.max_shm_connections_per_tenant
        mine = self.per_tenant.get(tenant, 0)
        if mine >= cap:
            self.audit.warning(f"shm tenant cap {tenant}", "refused: peer=%s tenant=%s reason=%s", conn.peer, tenant,
                               f"{mine} authenticated shared-memory connections open, the limit "
                               "(max_shm_connections_per_tenant)")
            conn.closing = True
            raise ResourceExhausted(
                f"tenant {tenant!r} has {mine} shared-memory connections open, the limit "
                f"(max_shm_connections_per_tenant = {cap}); close RemoteGpu sessions you no longer use, or ask the "
                "operator to raise it", limit=cap, used=mine)
        self.per_tenant[tenant] = mine + 1
        conn.tenant = tenant

    async def _handle(self, conn: _Connection, message: dict[str, Any], fds: list[int]) -> dict[str, Any]:
        token = message.get("token")
        # The same rules and the same answer as a gRPC call on the Unix socket (which has no certificates).
        metadata = [("authorization", f"Bearer {token}")] if token else []
        await self.auth.prepare(metadata)
        principal = self.auth.authenticate(metadata, {}, conn.peer, "SharedMemory",
                                           penalty_key=f"uid:{conn.ticket.uid}")
        self._claim(conn, principal.tenant)
        conn.ticket.done()  # authenticated: no longer counted against the pre-authentication caps
        key = (principal.tenant, principal.credential)
        if key not in conn.watches:  # closed when this token is rotated or its tenant removed
            conn.watches[key] = (principal, self.auth.revocations.watch(principal, conn.hang_up))
        session_id = message.get("session")
        if not isinstance(session_id, str):
            raise InvalidArgument("the request names no session")
        session = self.sessions.get(session_id, principal.tenant)
        session.check_alive()
        if message.get("hello") is not None:  # the SDK's first request, sent as it connects: authenticated, no more
            return {"hello": 1}
        if "release" in message:
            await self._release(session, str(message["release"]))
            return {"released": True}
        size = message.get("size")
        if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
            raise InvalidArgument(f"segment size must be a positive int, got {size!r}")
        if len(fds) != 1:
            raise InvalidArgument(f"a registration carries exactly one file descriptor, got {len(fds)}")
        # The client names its segment (gpubroker/wire/commands.py new_handle); the worker resolves it.
        handle = message.get("handle")
        if not isinstance(handle, str) or not 0 < len(handle) <= MAX_HANDLE:
            raise InvalidArgument(f"a registration names its segment: a handle of 1 to {MAX_HANDLE} characters")
        await self._register(session, fds[0], size, handle, conn.peer)
        return {"segment": handle, "size": size}

    async def _register(self, session: Session, fd: int, size: int, handle: str, peer: str) -> None:
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
        try:
            check_segment_fd(fd, size)
        except InvalidArgument as exc:  # a client that is not the SDK, or a hostile one: the operator sees it
            self.audit.warning(f"shm segment {session.tenant}", "refused: peer=%s tenant=%s reason=%s", peer,
                               session.tenant, exc.message)
            raise
        if handle in session.segments:
            raise InvalidArgument(f"segment {handle!r} is already registered in this session")
        # Reserved before the worker maps it, so concurrent registrations can never overshoot the limits.
        self.sessions.reserve_shared(session, size)
        session.segments[handle] = size
        try:
            await session.worker.call(RegisterSegment(handle, size), session.id, fd)
        except BaseException:
            if session.segments.pop(handle, None) is not None:
                self.sessions.release_shared(session, size)
            raise
        if self.sessions.sessions.get(session.id) is not session or session.lost is not None:
            # Closed while the worker mapped it: the worker's close ran first, so unmap this one too. (The close
            # uncounted this segment with the rest of the session's.)
            with contextlib.suppress(GpuBrokerError):
                await session.worker.call(ReleaseSegment(handle), session.id)
            raise NotFound(f"no session {session.id!r}")

    async def _release(self, session: Session, handle: str) -> None:
        if handle not in session.segments:
            raise NotFound(f"no segment {handle[:80]!r} in this session")
        await session.worker.call(ReleaseSegment(handle), session.id)
        size = session.segments.pop(handle, None)
        if size is not None:
            self.sessions.release_shared(session, size)
