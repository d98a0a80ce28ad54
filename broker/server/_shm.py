"""The shared-memory side channel: same-host clients hand memfd segments to their tenant's worker.

gRPC cannot carry file descriptors, so each ``unix:PATH`` listener gets a sibling socket ``PATH.shm`` (same mode
and group). The protocol is in ``gpubroker.client._shm``. This runs in the broker's event loop with only
non-blocking socket calls, readiness waited for through ``add_reader``/``add_writer``: uvloop's ``sock_recv``
cannot receive SCM_RIGHTS, and a thread per connection would need waking to stop.
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

from gpubroker.client import (
    GpuBrokerError,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    Unauthenticated,
)
from gpubroker.client._protocol import MAX_HANDLE
from gpubroker.client._shm import FRAME_HEADER, MAX_FRAME, pack_frame, unpack_frame

from ..auth import Authenticator, Principal, peer_credentials, wait_failure_delay
from ..config import BrokerConfig
from ..sessions import Session, SessionManager
from ._preauth import Idle, IdleSweeper, PreAuthGate, Ticket

__all__ = ["SharedMemoryServer"]

log = logging.getLogger("gpubroker.server")
# Connections are cheap but not free: beyond this many at once, new ones are closed at once.
MAX_CONNECTIONS = 1024
_MAX_FDS = 4  # one is expected; a few more are received only to be closed


def check_segment_fd(fd: int, size: int) -> None:
    """Only a sealed memfd at least ``size`` bytes long: it can never shrink under the worker's mapping."""
    try:
        info = os.fstat(fd)
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:
        raise InvalidArgument("the segment must be a memfd sealed against shrinking (F_SEAL_SHRINK)") from None
    if not stat.S_ISREG(info.st_mode) or not seals & fcntl.F_SEAL_SHRINK:
        raise InvalidArgument("the segment must be a memfd sealed against shrinking (F_SEAL_SHRINK)")
    if info.st_size < size:
        raise InvalidArgument(f"the segment's memfd holds {info.st_size} bytes, fewer than the {size} announced")


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
        self.watches: dict[tuple[str, str], tuple[Principal, int]] = {}  # revocation watches, by credential

    async def read(self) -> tuple[Any, list[int]] | None:
        """The next request and the fds received with it (the caller closes them); None at end of stream."""
        while True:
            limit = self.limit
            if len(self._buf) >= FRAME_HEADER.size:
                (length,) = FRAME_HEADER.unpack_from(self._buf)
                if length > limit:
                    if self.ticket.open:
                        self.ticket.refuse(f"hello of {length} bytes exceeds hello_max_bytes ({limit})")
                    raise InvalidArgument(f"side-channel frame of {length} bytes exceeds {limit}")
                end = FRAME_HEADER.size + length
                if len(self._buf) >= end:
                    payload = bytes(self._buf[FRAME_HEADER.size:end])
                    del self._buf[:end]
                    fds, self._fds = self._fds, []
                    try:
                        return unpack_frame(payload), fds
                    except ValueError:
                        self._fds = fds  # closed with the connection
                        raise InvalidArgument("side-channel frame is not valid msgpack") from None
            # Never more than the frame being read can still need: the buffer stays under the frame limit.
            want = (FRAME_HEADER.size + limit) - len(self._buf)
            try:
                data, fds, flags, _ = socket.recv_fds(self.sock, max(want, 1), _MAX_FDS)
            except BlockingIOError:
                await _wait(self.loop, self.sock.fileno(), writable=False)
                continue
            self._fds += fds
            if flags & socket.MSG_CTRUNC:
                raise InvalidArgument(f"at most one file descriptor per request ({_MAX_FDS} received)")
            if not data:
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

    def close(self) -> None:
        self.ticket.done()
        for fd in self._fds:
            os.close(fd)
        self._fds = []
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
            except OSError as exc:  # EMFILE and the like: back off rather than spin
                log.warning("side channel %s: accept failed: %s", path, exc)
                await asyncio.sleep(0.1)
                continue
            if len(self._tasks) > MAX_CONNECTIONS:
                pid, uid = peer_credentials(conn)
                self.gate.refused(str(path), pid, uid, f"{MAX_CONNECTIONS} side-channel connections open, the limit")
                conn.close()
                continue
            ticket = self.gate.admit(conn, str(path))
            if ticket is None:  # past a cap on unauthenticated connections: refused (and audited) at once
                conn.close()
                continue
            conn.setblocking(False)
            self._spawn(self._serve(_Connection(conn, ticket.peer, ticket)))

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
                    await conn.write({"error": exc.to_wire()})
                    return
                if request is None:
                    return
                message, fds = request
                if idle is not None:
                    idle.busy += 1
                failed = False
                try:
                    reply = await self._handle(conn, message, fds)
                except GpuBrokerError as exc:
                    reply = {"error": exc.to_wire()}
                    failed = isinstance(exc, Unauthenticated)
                except Exception as exc:
                    log.exception("side channel: unexpected error")
                    reply = {"error": {"code": "INTERNAL", "message": f"internal broker error: {type(exc).__name__}"}}
                finally:
                    for fd in fds:  # the worker has its own copy by now (or never will)
                        os.close(fd)
                    if idle is not None:
                        idle.busy -= 1
                        idle.last_active = time.monotonic()
                if failed:
                    await wait_failure_delay()
                await conn.write(reply)
                if conn.ticket.open:
                    return  # a connection that did not authenticate gets one try
                if idle is None:
                    idle = self.idle.add(conn.hang_up)
        except (ConnectionError, OSError):
            pass  # the client went away; its segments live on with its session
        finally:
            for principal, watch in conn.watches.values():
                self.auth.revocations.unwatch(principal, watch)
            if idle is not None:
                self.idle.remove(idle)
            conn.close()

    async def _handle(self, conn: _Connection, message: Any, fds: list[int]) -> dict[str, Any]:
        if not isinstance(message, dict):
            raise InvalidArgument("a side-channel request is a map")
        token = message.get("token")
        # The same rules and the same answer as a gRPC call on the Unix socket (which has no certificates).
        metadata = [("authorization", f"Bearer {token}")] if isinstance(token, str) and token else []
        await self.auth.prepare(metadata)
        principal = self.auth.authenticate(metadata, {}, conn.peer, "SharedMemory",
                                           penalty_key=f"uid:{conn.ticket.uid}")
        conn.ticket.done()  # authenticated: no longer counted against the pre-authentication caps
        key = (principal.tenant, principal.credential)
        if key not in conn.watches:  # closed when this token is rotated or its tenant removed
            conn.watches[key] = (principal, self.auth.revocations.watch(principal, conn.hang_up))
        session_id = message.get("session")
        if not isinstance(session_id, str):
            raise InvalidArgument("the request names no session")
        session = self.sessions.get(session_id, principal.tenant)
        session.check_alive()
        if "release" in message:
            await self._release(session, str(message["release"]))
            return {"released": True}
        size = message.get("size")
        if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
            raise InvalidArgument(f"segment size must be a positive int, got {size!r}")
        if len(fds) != 1:
            raise InvalidArgument(f"a registration carries exactly one file descriptor, got {len(fds)}")
        # The client names its segment (client/_protocol.py new_handle); the worker resolves it.
        handle = message.get("handle")
        if not isinstance(handle, str) or not 0 < len(handle) <= MAX_HANDLE:
            raise InvalidArgument(f"a registration names its segment: a handle of 1 to {MAX_HANDLE} characters")
        await self._register(session, fds[0], size, handle)
        return {"segment": handle, "size": size}

    async def _register(self, session: Session, fd: int, size: int, handle: str) -> None:
        limit = self.config.max_shared_bytes_per_session
        if session.shared_bytes + size > limit:
            raise ResourceExhausted(f"this session would map {session.shared_bytes + size} bytes of shared memory; "
                                    f"the limit is {limit}", limit=limit, used=session.shared_bytes, requested=size)
        # Summed over all of the tenant's sessions (on every device): sessions x the per-session limit is no bound.
        tenant_limit, tenant_used = self.config.max_shared_bytes_per_tenant, self.sessions.shared(session.tenant)
        if tenant_used + size > tenant_limit:
            raise ResourceExhausted(
                f"tenant {session.tenant!r} would map {tenant_used + size} bytes of shared memory across its "
                f"sessions: {size} requested, {tenant_used} in use, and the limit (max_shared_bytes_per_tenant) is "
                f"{tenant_limit}; release segments or end sessions first", limit=tenant_limit, used=tenant_used,
                requested=size)
        check_segment_fd(fd, size)
        if handle in session.segments:
            raise InvalidArgument(f"segment {handle!r} is already registered in this session")
        # Reserved before the worker maps it, so concurrent registrations can never overshoot the limits.
        self.sessions.reserve_shared(session, size)
        session.segments[handle] = size
        try:
            await session.worker.call_with_fd("register_segment", session.id, fd, handle=handle, size=size)
        except BaseException:
            if session.segments.pop(handle, None) is not None:
                self.sessions.release_shared(session, size)
            raise
        if self.sessions.sessions.get(session.id) is not session or session.lost is not None:
            # Closed while the worker mapped it: the worker's close ran first, so unmap this one too. (The close
            # uncounted this segment with the rest of the session's.)
            with contextlib.suppress(GpuBrokerError):
                await session.worker.call("release_segment", session.id, handle=handle)
            raise NotFound(f"no session {session.id!r}")

    async def _release(self, session: Session, handle: str) -> None:
        if handle not in session.segments:
            raise NotFound(f"no segment {handle[:80]!r} in this session")
        await session.worker.call("release_segment", session.id, handle=handle)
        size = session.segments.pop(handle, None)
        if size is not None:
            self.sessions.release_shared(session, size)
