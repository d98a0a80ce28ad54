"""The framed link's listeners: the front authenticates a hello, then hands the connection to the session's worker.

After the hello, a link carries protocol batches (client/_protocol.py) between the client and its worker, and
the front never sees them. Three listeners, one hello and one hand-off:

- ``<socket>.fast`` beside each Unix listener (same host): the accepted socket goes to the worker (SCM_RIGHTS).
- ``link_vsock_port`` (VM guests): the accepted AF_VSOCK socket goes to the worker the same way.
- ``link_listen`` (TCP): the front terminates TLS (mTLS as the gRPC listener's) and relays bytes both ways
  between the connection and one end of a socketpair whose other end goes to the worker: a worker runs its
  tenant's code and must never hold the server's key. Without [tls] (loopback, or ``insecure``) the same relay:
  a worker takes only local sockets, whose peers the kernel names.

The hello is one frame (4-byte big-endian length + msgpack ``{"token", "session", "link": 1}``), read under the
pre-authentication limits (``hello_max_bytes``, ``hello_timeout_seconds``, the unauthenticated-connection caps)
and authenticated exactly as a gRPC call (failure delay, audit). A refusal is ``[0, 1, error]`` from the front;
the worker itself answers an accepted hello (``[0, 0, {"link": 1, "max_frame": n}]``). The tenant's turns on the
device are leased to the worker for its links' device work, and a revoked credential closes the session's links
(``close_links``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import ssl
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any, cast

from gpubroker.client import GpuBrokerError, InvalidArgument, Unauthenticated, WorkerCrashed
from gpubroker.client._frames import FRAME_HEADER, pack_frame, unpack_frame

from ..auth import Principal, wait_failure_delay
from ..logs import bind_log_context
from ..scheduler import TurnLease
from ..sessions import Session
from ._preauth import PreAuthGate, Ticket

__all__ = ["LinkServer", "fast_path_address"]

log = logging.getLogger("gpubroker.links")
# What a TCP link's relay buffers each way before it pauses reading the other side.
_RELAY_BUFFER = 4 << 20


def fast_path_address(unix_path: str) -> str:
    return f"{unix_path}.fast"


class _HelloRefused(Exception):
    """The hello did not arrive whole and in time (audited on its ticket); the connection just closes."""


class LinkServer:
    """Every link listener of the broker, sharing the pre-authentication gate with the side channel."""

    def __init__(self, service: Any, gate: PreAuthGate) -> None:
        self.service = service
        self.gate = gate
        self._listeners: list[tuple[socket.socket, str]] = []
        self._servers: list[asyncio.AbstractServer] = []
        self._paths: list[Path] = []
        self._link_watches: dict[tuple[str, str], tuple[Principal, int]] = {}  # (session, credential) -> watch
        self._tasks: set[asyncio.Task[Any]] = set()
        service.sessions.closing_hooks.append(self._session_closing)

    # -- listeners -----------------------------------------------------------------------------------
    def listen_socket(self, sock: socket.socket, where: str, path: Path | None = None) -> None:
        """Serve links on a listening Unix or vsock socket: each accepted socket is handed to a worker."""
        sock.setblocking(False)
        self._listeners.append((sock, where))
        if path is not None:
            self._paths.append(path)
        self._spawn(self._accept(sock, where))

    async def listen_tcp(self, host: str, port: int, tls: ssl.SSLContext | None) -> int:
        """Serve links on TCP (TLS terminated here when ``tls``); the port bound."""
        where = f"{'tls' if tls is not None else 'tcp'}:{host}:{port}"
        server = await asyncio.get_running_loop().create_server(
            lambda: _TcpLink(self, where), host, port, ssl=tls,
            ssl_handshake_timeout=self.gate.hello_timeout if tls else None)
        self._servers.append(server)
        bound: int = server.sockets[0].getsockname()[1]
        return bound

    async def stop(self) -> None:
        for server in self._servers:
            server.close()
        for sock, _ in self._listeners:
            sock.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for path in self._paths:
            path.unlink(missing_ok=True)

    def _spawn(self, coro: Awaitable[Any]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _accept(self, listener: socket.socket, where: str) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, address = await loop.sock_accept(listener)
            except OSError as exc:  # EMFILE and the like: back off rather than spin
                log.warning("link listener %s: accept failed: %s", where, exc)
                await asyncio.sleep(0.1)
                continue
            local = conn.family == socket.AF_UNIX
            ticket = self.gate.admit(conn if local else None, where if local else f"{where} peer={address}",
                                     address=None if local else f"vsock:{_host(address)}")
            if ticket is None:  # past a cap on unauthenticated connections: refused (and audited) at once
                conn.close()
                continue
            conn.setblocking(False)
            self._spawn(self._serve_socket(conn, ticket, address))

    # -- a socket handed over whole (Unix, vsock) --------------------------------------------------------
    async def _serve_socket(self, conn: socket.socket, ticket: Ticket, address: Any) -> None:
        loop = asyncio.get_running_loop()

        async def recv_exactly(n: int) -> bytes:
            # Never more than the hello: what follows it is the worker's to read.
            data = bytearray()
            while len(data) < n:
                part = await loop.sock_recv(conn, n - len(data))
                if not part:
                    raise ConnectionError("closed during the hello")
                data += part
            return bytes(data)

        async def send(frame: bytes) -> None:
            await loop.sock_sendall(conn, frame)

        penalty = f"uid:{ticket.uid}" if conn.family == socket.AF_UNIX else f"addr:{_host(address)}"
        try:
            session, principal = await self._hello(recv_exactly, send, ticket, {}, penalty)
            await self._hand_over(session, principal, conn.fileno(), send)
        except (_HelloRefused, ConnectionError, OSError):
            pass
        finally:
            ticket.done()
            conn.close()  # this process's descriptor: the connection lives on in the worker

    # -- TCP (TLS terminated here): relayed to the worker -----------------------------------------------
    async def _serve_tcp(self, link: _TcpLink, where: str) -> None:
        """The hello, then a socketpair to the worker, whose end here relays to and from the connection."""
        transport = link.transport
        peer = transport.get_extra_info("peername")
        ticket = self.gate.admit(None, f"{where} peer={peer}", address=_host(peer))
        if ticket is None:
            transport.abort()
            return
        ours: socket.socket | None = None
        try:
            context = _auth_context(transport.get_extra_info("peercert"))
            session, principal = await self._hello(link.recv_exactly, link.send, ticket, context,
                                                   f"addr:{_host(peer)}")
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                if not await self._hand_over(session, principal, theirs.fileno(), link.send):
                    return
            finally:
                theirs.close()
            ours.setblocking(False)
            await asyncio.get_running_loop().connect_accepted_socket(lambda: _WorkerEnd(link), ours)
            ours = None  # the worker end's transport owns it now
            link.relay()
        except (_HelloRefused, ConnectionError, OSError):
            pass
        finally:
            ticket.done()
            if ours is not None:
                ours.close()
            if link.worker is None:
                transport.close()  # (after what was written: a refusal reaches the client)

    # -- the hello and the hand-off --------------------------------------------------------------------
    async def _hello(self, recv_exactly: Callable[[int], Awaitable[bytes]], send: Callable[[bytes], Awaitable[None]],
                     ticket: Ticket, auth_context: Mapping[str, list[bytes]], penalty: str
                     ) -> tuple[Session, Principal]:
        """The first frame, authenticated as a gRPC call would be; refusals are answered and raise
        _HelloRefused."""
        limit = self.gate.hello_max_bytes
        try:
            async with asyncio.timeout(self.gate.hello_timeout):
                (length,) = FRAME_HEADER.unpack(await recv_exactly(FRAME_HEADER.size))
                if length > limit:  # refused before a byte of the body is read
                    ticket.refuse(f"hello of {length} bytes exceeds hello_max_bytes ({limit})")
                    await send(pack_frame([0, 1, InvalidArgument(
                        f"a link hello is at most {limit} bytes, got {length}").to_wire()]))
                    raise _HelloRefused
                payload = await recv_exactly(length)
        except TimeoutError:
            ticket.refuse(f"no hello within hello_timeout_seconds ({self.gate.hello_timeout:g} s)")
            raise _HelloRefused from None
        auth = self.service.auth
        try:
            try:
                hello = unpack_frame(payload)
            except ValueError:  # (msgpack's unpack errors: a malformed hello is no credentials, as a wrong token)
                hello = None
            token = hello.get("token") if isinstance(hello, dict) else None
            token = token if isinstance(token, str) and token else None
            await auth.tokens.prepare(token)
            metadata = [("authorization", f"Bearer {token}")] if token else []
            try:
                principal = auth.authenticate(metadata, auth_context, ticket.peer, "link/hello", penalty_key=penalty)
            except Unauthenticated:
                await wait_failure_delay()
                raise
            assert isinstance(hello, dict)
            if hello.get("link") != 1:
                raise InvalidArgument(f"this broker speaks link version 1, the hello asked for {hello.get('link')!r}")
            session = self.service.sessions.get(str(hello.get("session", "")), principal.tenant)
            session.check_alive()
        except GpuBrokerError as exc:
            await send(pack_frame([0, 1, exc.to_wire()]))
            raise _HelloRefused from None
        ticket.done()
        bind_log_context(tenant=session.tenant, session=session.id)
        return session, principal

    async def _hand_over(self, session: Session, principal: Principal, fd: int,
                         send: Callable[[bytes], Awaitable[None]]) -> bool:
        """Give the connection (``fd``) to the session's worker, which answers the hello and serves it from then
        on; a worker that cannot take it gets the client the reason instead."""
        dup = os.dup(fd)
        try:
            worker = session.check_alive()
            self._lease(session)
            await worker.call_with_fd("attach_link", session.id, dup)  # (checked: {"link": 1})
        except GpuBrokerError as exc:
            if not isinstance(exc, WorkerCrashed):
                log.info("no link for session %s: %s", session.id, exc)
            await send(pack_frame([0, 1, exc.to_wire()]))
            return False
        finally:
            os.close(dup)  # the worker holds its own copy now
        self._watch_links(session, principal)
        return True

    def _lease(self, session: Session) -> None:
        """The worker's turns on the device for its links' device work come from this device's scheduler."""
        worker = session.worker
        if worker.on_control is None:
            lease = TurnLease(self.service.schedulers[session.device], session.tenant, worker.send_control)
            worker.on_control = lease.on_message
            worker.on_death.append(lease.close)

    def _watch_links(self, session: Session, principal: Principal) -> None:
        """A link lives in the worker: at a revocation, the front tells the worker to close the session's links
        (the client reconnects with the current token). One watch per session and credential."""
        key = (session.id, principal.credential)
        if key in self._link_watches:
            return

        def close_links() -> None:
            self._link_watches.pop(key, None)
            self._spawn(self._close_links(session))

        self._link_watches[key] = (principal, self.service.auth.revocations.watch(principal, close_links))

    async def _close_links(self, session: Session) -> None:
        if session.lost is None:
            with contextlib.suppress(GpuBrokerError):
                await session.worker.call("close_links", session.id)

    async def _session_closing(self, session: Session) -> None:
        for key in [k for k in self._link_watches if k[0] == session.id]:
            principal, watch = self._link_watches.pop(key)
            self.service.auth.revocations.unwatch(principal, watch)


def _host(address: Any) -> str:
    return str(address[0]) if isinstance(address, tuple) and address else str(address)


def _auth_context(cert: Any) -> dict[str, list[bytes]]:
    """A verified client certificate's names as gRPC's auth context gives them (auth.certificate_identities)."""
    if not isinstance(cert, dict):
        return {}
    names = [value.encode() for kind, value in cert.get("subjectAltName", ()) if kind == "URI"]
    common = [value.encode() for rdn in cert.get("subject", ()) for key, value in rdn if key == "commonName"]
    return {"x509_subject_alternative_name": names, "x509_common_name": common}



class _TcpLink(asyncio.Protocol):
    """One TCP link: its hello buffered here for the front to judge, then every byte written straight to the
    worker's socketpair (and back, by _WorkerEnd): one callback per read, no task switch, so the relay costs
    the front as little as an event loop allows. Each side's flow control pauses the other's reading."""

    def __init__(self, server: LinkServer, where: str) -> None:
        self.server = server
        self.where = where
        self.transport: asyncio.Transport = None  # type: ignore[assignment]  # (set at once by connection_made)
        self.worker: asyncio.Transport | None = None  # the worker's end, once relaying
        self._buffer = bytearray()
        self._waiter: asyncio.Future[None] | None = None
        self._closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # (uvloop's transports subclass no asyncio class)
        # A few copy chunks in flight each way before the other side is paused, not one chunk's fraction.
        self.transport.set_write_buffer_limits(high=_RELAY_BUFFER)
        sock = transport.get_extra_info("socket")
        if sock is not None:  # a launch + sync is a small frame each way: never held back by Nagle
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.server._spawn(self.server._serve_tcp(self, self.where))

    def data_received(self, data: bytes) -> None:
        if self.worker is not None:
            self.worker.write(data)
            return
        self._buffer += data
        if len(self._buffer) > FRAME_HEADER.size + self.server.gate.hello_max_bytes:
            self.transport.pause_reading()  # what an unauthenticated peer makes the front hold stays bounded
        self._wake()

    def eof_received(self) -> bool | None:
        if self.worker is not None and self.worker.can_write_eof():
            self.worker.write_eof()
        self._closed = True
        self._wake()
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed = True
        self._wake()
        if self.worker is not None:
            self.worker.close()

    def pause_writing(self) -> None:
        if self.worker is not None:
            self.worker.pause_reading()

    def resume_writing(self) -> None:
        if self.worker is not None:
            self.worker.resume_reading()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def recv_exactly(self, n: int) -> bytes:
        while len(self._buffer) < n:
            if self._closed:
                raise ConnectionError("closed during the hello")
            if self.transport.is_reading() is False and len(self._buffer) < n:
                self.transport.resume_reading()
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
        data = bytes(self._buffer[:n])
        del self._buffer[:n]
        return data

    async def send(self, frame: bytes) -> None:
        self.transport.write(frame)

    def relay(self) -> None:
        """From now on the worker serves the link: what arrived after the hello goes first."""
        assert self.worker is not None
        if self._buffer:
            self.worker.write(bytes(self._buffer))
            self._buffer.clear()
        if self._closed:
            self.worker.close()
        else:
            self.transport.resume_reading()


class _WorkerEnd(asyncio.Protocol):
    """The front's end of a TCP link's socketpair: the worker's bytes go to the client as they come."""

    def __init__(self, link: _TcpLink) -> None:
        self.link = link

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.link.worker = cast(asyncio.Transport, transport)
        self.link.worker.set_write_buffer_limits(high=_RELAY_BUFFER)
        self.link.transport.pause_reading()  # until relay() has sent what came after the hello

    def data_received(self, data: bytes) -> None:
        self.link.transport.write(data)

    def eof_received(self) -> bool | None:
        self.link.transport.close()  # the worker closed the link (revocation, a malformed frame, its end)
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        self.link.transport.close()

    def pause_writing(self) -> None:
        self.link.transport.pause_reading()

    def resume_writing(self) -> None:
        self.link.transport.resume_reading()
