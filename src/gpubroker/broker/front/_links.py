"""The framed link's listeners: the front authenticates a hello, then hands the connection to the session's worker.

After the hello, a link carries protocol batches (gpubroker/wire/commands.py) between the client and its worker, and
the front never sees them. Three listeners, one hello and one hand-off:

- ``<socket>.fast`` beside each Unix listener (same host): the accepted socket goes to the worker (SCM_RIGHTS);
  or, when its hello asks for ``segments``, it stays with the front, which registers the shared-memory segments
  sent on it (memfds, SCM_RIGHTS: ``_segments.py``). With ``fast_path = false`` it serves segments only. A batch
  link's hello may ask for a shared-memory ring: the front makes it (a sealed memfd of exactly its size, charged
  to the tenant's shared memory like a segment, and the doorbells' socketpair), answers ``RingGranted`` with the
  client's part, and passes the worker its part with the link. No client's descriptor reaches a worker: the
  worker's end of every link (and doorbell) refuses them (``SO_PASSRIGHTS`` off, ``_refuse_rights``), and a
  sandboxed worker receives on its fd channel alone (sandbox/_seccomp.py).
- ``link_vsock_port`` (VM guests): the accepted AF_VSOCK socket goes to the worker the same way.
- ``link_listen`` (TCP): the front terminates TLS (mTLS as the gRPC listener's) and relays bytes both ways
  between the connection and one end of a socketpair whose other end goes to the worker: a worker runs its
  tenant's code and must never hold the server's key. Without [tls] (loopback, or ``insecure``) the same relay:
  a worker takes only local sockets, whose peers the kernel names. Each TCP link has a thread of its own for
  its handshake, its hello's bytes and then the relay (``TcpRelay``, in _tcp_relay.py), off the event loop. A
  TLS link's thread runs in one of the front's TLS relay processes (_tls_relays.py): OpenSSL decrypts a record a
  call, each a turn on the process's GIL, so the relays of one process share one interpreter's pace however many
  links a client stripes a large copy over; a plaintext link's thread runs in the front.

The hello is one frame (4-byte big-endian length + a msgpack ``Hello``, gpubroker/wire/link.py: token, session,
``link: 1`` or ``segments: 1``), read under the pre-authentication limits (``hello_max_bytes``,
``hello_timeout_seconds``, the unauthenticated-connection caps) and authenticated exactly as a gRPC call (failure
delay, audit); a malformed hello (not msgpack, not a map, a field of the wrong type or size, descriptors sent with
it, cut short) is refused the same way: audited, delayed, answered; and so is a failed TLS handshake on
``link_listen`` (a wrong or absent client certificate, bytes that are no TLS: audited with OpenSSL's reason,
delayed, then closed; OpenSSL's alert is its answer). A connection closed before its first byte is no handshake, as
a bare close is no hello: it ends unaudited. A refusal is an error answer from the front;
the worker itself answers an accepted link's hello (``LinkAccepted``, its max frame). The
tenant's turns on the device are leased to the worker for its links' device work, and a revoked credential closes
the session's links (``close_links``) and retires the worker, which ran that credential's holder's code and may keep
a copy of a link that no request can make it close (``_retire.py``). The watch for that is registered with the
authentication, before the hand-off, and the worker holds a handed-off link unanswered until the front has checked
the credential once more (``serve_link``): a worker busy in a long kernel cannot let a link in after its token's
rotation (``_hand_over``).

What a link costs the front is bounded by the front, never by the worker (which runs its tenant's code and may
answer yes to every link, or never answer): a session has at most ``MAX_LINKS_PER_SESSION`` links being handed
over or relayed (a TCP link's thread and descriptors), a tenant at most ``max_links_per_tenant`` across its
sessions, and a hand-off the worker has not completed within ``link_handoff_timeout_seconds`` is refused
(UNAVAILABLE: the worker is busy, retry) and its connection closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import os
import socket
import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpubroker.broker.front._descriptors import set_passrights
from gpubroker.broker.front._handed import HandedLinks
from gpubroker.broker.front._preauth import PreAuthGate, Ticket, refuse_and_delay, refuse_malformed
from gpubroker.broker.front._segments import FdStream, SegmentService
from gpubroker.broker.front._sessions import LINK_ENVELOPE, Session
from gpubroker.broker.front._tcp_relay import HandshakeFailed, HelloCutShort, LinkRelay, ThreadRelay
from gpubroker.broker.front._tls_relays import TlsRelays
from gpubroker.broker.front.auth import Credentials, Principal, RateLimitedLog
from gpubroker.broker.front.listen import listen_tcp
from gpubroker.broker.front.listeners import Acceptor, OffLoop, Peer, PeerRate
from gpubroker.broker.front.scheduler import TurnLease
from gpubroker.broker.logs import bind_log_context
from gpubroker.wire.errors import (
    FailedPrecondition,
    GpuBrokerError,
    InvalidArgument,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
    WorkerCrashed,
)
from gpubroker.wire.frames import FRAME_HEADER, FrameTooLarge, frame_length
from gpubroker.wire.link import (
    LINK_SEND_BUFFER,
    LINK_VERSION,
    SEGMENTS_VERSION,
    Hello,
    Malformed,
    RingGranted,
    RingRequest,
    accepted,
    decode_hello,
    refusal,
)
from gpubroker.wire.ring import RING_DATA, link_spin_us, ring_caps, sealed_memfd
from gpubroker.wire.worker import MAX_LINKS_PER_SESSION, AttachLink, CloseLinks, DropLink, LinkRing, ServeLink

__all__ = ["LinkServer", "fast_path_address"]

log = logging.getLogger("gpubroker.links")
_RING_HERE = ("a shared-memory ring is the same host's: ask for it on the broker's Unix socket <socket>.fast; this "
              "link goes on without one")
REVOKED_MESSAGE = ("the token that opened this link was rotated or its tenant removed while the link was being "
                   "set up; reconnect with the current token")


def fast_path_address(unix_path: str) -> str:
    return f"{unix_path}.fast"


class _HelloRefused(Exception):
    """The hello did not arrive whole and in time (audited on its ticket); the connection just closes."""


def _penalty_key(peer: Peer) -> str:
    """Whom a failed authentication's delay is charged to: a peer the kernel names by uid (a Unix socket, TCP from
    this host) by its uid, as on gRPC, so that one local user guessing over loopback TCP delays no other; else its
    address."""
    return f"uid:{peer.uid}" if peer.uid >= 0 else f"addr:{peer.host}"


class LinkServer:
    """Every link listener of the broker, sharing one pre-authentication gate."""

    def __init__(self, service: Any, gate: PreAuthGate, segments: SegmentService, max_links_per_tenant: int = 64,
                 handoff_timeout: float = 30.0, connection_rate: PeerRate | None = None,
                 accepts: OffLoop | None = None) -> None:
        self.service = service
        self.connection_rate = connection_rate  # (how fast each peer may connect: the Acceptors')
        self.accepts = accepts  # (where the Acceptors accept: the front's acceptor process, if not on the loop)
        self.gate = gate
        self.segments = segments
        self.max_links_per_tenant = max_links_per_tenant
        self.handoff_timeout = handoff_timeout
        # How long a worker polls a link (no ring) for its client's next batch after answering one: this host's
        # spin (none on a host of 2 or 3 CPUs, where it would take the CPU the client needs), longer for a TCP
        # link's (its relay process polls as long, wire/ring.py).
        self.link_spin_us = {relayed: link_spin_us(relayed) for relayed in (False, True)}
        # Links being handed over (any listener) or relayed (TCP: a thread each), by session and by tenant.
        self._session_links: dict[str, int] = {}
        self._tenant_links: dict[str, int] = {}
        # Authenticated hellos refused (the session's link cap, a hand-off timeout): per tenant at most 20 lines in
        # 10 s, then a count. A tenant at its cap sending hellos as fast as the front answers wrote 300 KB/s.
        self._refusals = RateLimitedLog(log)
        self._listeners: list[Acceptor] = []
        self._no_links: set[str] = set()  # listeners that serve segments only (fast_path = false)
        # Written once at stop: the TCP links' relay threads poll its other end.
        self._stop_r, self._stop_w = os.pipe2(os.O_CLOEXEC)
        self._paths: list[Path] = []
        self._link_watches: dict[tuple[str, str], tuple[Principal, int]] = {}  # (session, credential) -> watch
        self._tasks: set[asyncio.Task[Any]] = set()
        self._numbers = itertools.count(1)  # each hand-off's link, as the worker holds it until it is served
        # The front's copy of each link a worker holds, shut when the worker ends (_handed.py).
        self.handed = HandedLinks()
        self.tls_relays: TlsRelays | None = None  # (the processes TLS links are relayed by: _tls_relays.py)
        service.sessions.closing_hooks.append(self._session_closing)

    # -- listeners -----------------------------------------------------------------------------------
    def listen_socket(self, sock: socket.socket, where: str, path: Path | None = None, links: bool = True) -> None:
        """Serve links on a listening Unix or vsock socket: each accepted socket is handed to a worker (a Unix
        socket's segment connections stay here). ``links`` False: segment connections only."""
        if not links:
            self._no_links.add(where)
        if path is not None:
            self._paths.append(path)
        self._listen(Acceptor(sock, where, functools.partial(self._admit_socket, where), "link", self.connection_rate,
                              self.accepts))

    async def listen_tcp(self, host: str, port: int, tls: ssl.SSLContext | None,
                         relays: TlsRelays | None = None) -> int:
        """Serve links on TCP (TLS terminated here when ``tls``: by ``relays``' processes, `start`ed here, where
        they serve, else by threads of the front); the port bound."""
        if relays is not None:
            self.tls_relays = relays
            await relays.start()
        where = f"{'tls' if tls is not None else 'tcp'}:{host}:{port}"
        loop = asyncio.get_running_loop()
        family, _, _, _, address = (await loop.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                                           flags=socket.AI_PASSIVE))[0]
        sock = listen_tcp(family, address)
        bound: int = sock.getsockname()[1]
        self._listen(Acceptor(sock, where, functools.partial(self._admit_tcp, where, tls), "link",
                              self.connection_rate, self.accepts))
        return bound

    async def stop(self) -> None:
        os.write(self._stop_w, b"x")  # every TCP link's relay thread polls this: they all end
        if self.tls_relays is not None:
            await self.tls_relays.close()  # (and so do the relay processes' links)
        for acceptor in self._listeners:
            acceptor.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.segments.close()
        self.handed.close()
        for path in self._paths:
            path.unlink(missing_ok=True)

    def _spawn(self, coro: Awaitable[Any]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _listen(self, acceptor: Acceptor) -> None:
        self._listeners.append(acceptor)
        acceptor.start()

    def _admit_socket(self, where: str, conn: socket.socket, peer: Peer) -> bool:
        local = peer.address is None
        ticket = self.gate.admit(peer, where if local else f"{where} peer={peer.accepted}")
        if ticket is None:  # past a cap on unauthenticated connections: refused (and audited) at once
            conn.close()
            return True
        # Until its hello comes, a newer connection of its peer may take its place (_preauth.py).
        ticket.sock, ticket.evict = conn, _shutter(conn)
        self._spawn(self._serve_socket(conn, ticket, peer, where not in self._no_links))
        return True

    # -- a socket handed over whole (Unix, vsock), or kept for segments (Unix) ----------------------------
    async def _serve_socket(self, conn: socket.socket, ticket: Ticket, peer: Peer, links: bool) -> None:
        # Read exactly (never more than the hello: what follows it is the worker's to read, or the segment
        # requests'), and with any descriptors sent along: a hello carries none, so they are refused.
        stream = FdStream(conn, "a link hello")
        local = peer.address is None
        penalty = _penalty_key(peer)
        try:
            session, principal, hello = await self._hello(stream.recv_exactly, stream.send, ticket, (), penalty,
                                                          segments=local, links=links)
            if hello.segments is not None:
                stream.allow_rights()  # authenticated, and kept by the front: now it may pass a segment's memfd
                await self.segments.serve(stream, ticket.peer, penalty, session, principal)
                return
            # Handed over whole: from here on it costs the front its copy of the link (kept until the link or the
            # worker ends, with its place in the counts). The worker's end refuses descriptors (see _refuse_rights).
            _refuse_rights(conn)
            # A copy's chunk or more in flight towards the client: the worker's reads go out in one send each,
            # not in pieces of the default buffer, each a wake-up of the worker's loop (as the TCP relay's pair).
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, LINK_SEND_BUFFER)
            ring = None
            if hello.ring is not None:
                if conn.family == socket.AF_UNIX:
                    ring = (hello.ring, conn)
                else:  # (vsock: another host's memory)
                    await stream.send(_frame(accepted(RingGranted(ring=0, reason=_RING_HERE))))
            if await self._hand_over(session, principal, conn.fileno(), stream.send, list(hello.compress),
                                     counted_while_kept=True, ring=ring) is not None:
                stream.handed_on = True
        except (_HelloRefused, ConnectionError, OSError):
            pass
        finally:
            ticket.done()
            stream.close()  # this process's descriptor: a link lives on in the worker

    # -- TCP (TLS terminated here): relayed to the worker by a thread of its own ----------------------------
    def _admit_tcp(self, where: str, tls: ssl.SSLContext | None, conn: socket.socket, peer: Peer) -> bool:
        # Admitted before the TLS handshake: the caps on unauthenticated connections count handshakes too.
        ticket = self.gate.admit(peer, f"{where} peer={peer.accepted}")
        if ticket is None:
            conn.close()
            return True
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # a launch + sync: never held by Nagle
        # Evictable from now on (a newer connection may take its place until its hello comes: _preauth.py), not
        # only once its task runs: connections that reconnect as fast as they are evicted must not be the only
        # ones that cannot be. The gate peeks at a descriptor of its own (the thread's socket may be wrapped in TLS
        # meanwhile); until the relay exists, eviction shuts the connection itself.
        try:
            ticket.sock = socket.socket(fileno=os.dup(conn.fileno()))
        except OSError:  # (out of descriptors: this one is not evicted)
            pass
        else:
            ticket.evict = _shutter(conn)
        self._spawn(self._serve_tcp(conn, ticket, peer, tls))
        return True

    async def _serve_tcp(self, conn: socket.socket, ticket: Ticket, peer: Peer, tls: ssl.SSLContext | None) -> None:
        """The link's thread does the handshake and reads the hello (within hello_timeout_seconds: at the deadline
        the connection is shut, which ends any read); the hello is judged here, as on every listener; then the
        thread answers a refusal, or relays between the connection and a socketpair whose other end is the
        worker's."""
        loop = asyncio.get_running_loop()
        relay: LinkRelay | None = None
        if tls is not None and self.tls_relays is not None:
            relay = self.tls_relays.relay(conn, self.gate.hello_max_bytes, self.gate.hello_timeout)
        if relay is None:
            relay = ThreadRelay(conn, tls, self.gate.hello_max_bytes, self.gate.hello_timeout, self._stop_r, loop)
        peek = ticket.sock
        if peek is not None:
            ticket.evict = relay.abort  # (it shuts whichever socket the thread holds, TLS-wrapped or not)
            ticket.progressed = lambda: relay.started
        relay.start()

        def late() -> str:
            what = "TLS handshake" if tls is not None and not relay.progressed else "hello"
            return f"no {what} within hello_timeout_seconds ({self.gate.hello_timeout:g} s)"

        def too_late() -> None:
            ticket.refuse(late())  # (audited before the client sees its connection end)
            relay.abort()

        deadline = loop.call_later(self.gate.hello_timeout, too_late)
        frames: list[bytes] = []
        worker_end: socket.socket | None = None
        tenant = ""  # (whose link it is, once handed over)
        try:
            try:
                data, names, issued = await relay.hello
            except HandshakeFailed as exc:
                # Refused like a malformed hello: an audit line and the failure delay (a wrong certificate is a
                # failed authentication), then the thread closes the connection (OpenSSL sent its alert). Not
                # after an abort: the deadline or an eviction audited that end.
                if ticket.open and not relay.aborted:
                    await refuse_and_delay(ticket, self.service.auth.penalty, _penalty_key(peer),
                                           f"TLS handshake failed: {exc}")
                return
            except HelloCutShort as exc:  # audited as .fast audits it (not after the deadline's or an eviction's end)
                if ticket.open and not relay.aborted:
                    await refuse_malformed(ticket, self.service.auth.penalty, _penalty_key(peer), str(exc))
                return
            except (ssl.SSLError, OSError, EOFError) as exc:  # the deadline, a bare close
                if isinstance(exc, TimeoutError) and not relay.aborted:  # (the thread's clock ran out first)
                    ticket.refuse(late())
                return
            finally:
                deadline.cancel()
            received = bytearray(data)

            async def recv_exactly(n: int) -> bytes:
                if len(received) < n:
                    raise ConnectionError("closed during the hello")
                part = bytes(received[:n])
                del received[:n]
                return part

            async def send(frame: bytes) -> None:
                frames.append(frame)  # (the thread writes them, before it relays or closes)

            session, principal, hello = await self._hello(recv_exactly, send, ticket, names, _penalty_key(peer),
                                                          segments=False, links=True, certificate_issued=issued)
            if hello.ring is not None:  # (a ring is shared memory: the same host's, on its Unix socket)
                await send(_frame(accepted(RingGranted(ring=0, reason=_RING_HERE))))
            ours: socket.socket | None
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            for end in (ours, theirs):  # a copy's chunk or more in flight each way: fewer wake-ups per byte
                end.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, LINK_SEND_BUFFER)
            _refuse_rights(theirs)  # (only the relay writes to it; refused all the same, as on every link)
            try:
                release = await self._hand_over(session, principal, theirs.fileno(), send, list(hello.compress),
                                                relayed=True)
                if release is not None:  # counted until the relay's thread ends
                    relay.on_end = functools.partial(loop.call_soon_threadsafe, release)
                    worker_end, ours, tenant = ours, None, session.tenant
            finally:
                theirs.close()
                if ours is not None:
                    ours.close()
        except (_HelloRefused, ConnectionError, OSError):
            pass
        finally:
            ticket.done()
            if peek is not None:
                peek.close()
            relay.decide(frames, worker_end, tenant)

    # -- the hello and the hand-off --------------------------------------------------------------------
    async def _hello(self, recv_exactly: Callable[[int], Awaitable[bytes]], send: Callable[[bytes], Awaitable[None]],
                     ticket: Ticket, certificate_names: tuple[str, ...], penalty: str, *, segments: bool,
                     links: bool, certificate_issued: float | None = None) -> tuple[Session, Principal, Hello]:
        """The first frame, authenticated as a gRPC call would be; refusals are answered and raise _HelloRefused.
        ``segments``: this listener may serve segment connections (a Unix socket, where descriptors pass);
        ``links``: batch links (not on ``<socket>.fast`` with fast_path = false)."""
        limit = self.gate.hello_max_bytes
        auth = self.service.auth
        length = -1
        try:
            async with asyncio.timeout(self.gate.hello_timeout):
                header = await recv_exactly(FRAME_HEADER.size)
                try:
                    length = frame_length(header, limit)
                except FrameTooLarge as exc:
                    length, payload = exc.length, b""  # (too long: not a byte of it read; refused below)
                else:
                    payload = await recv_exactly(length)
        except TimeoutError:
            ticket.refuse(f"no hello within hello_timeout_seconds ({self.gate.hello_timeout:g} s)")
            raise _HelloRefused from None
        except InvalidArgument as exc:  # descriptors sent with the hello (closed at once): malformed
            await refuse_malformed(ticket, auth.penalty, penalty, exc.message)
            await send(_frame(refusal(exc)))
            raise _HelloRefused from None
        except ConnectionError:
            # A header, then an end: a hello cut short (a bare close is no hello at all; an evicted connection's
            # end was audited when it was evicted).
            if length >= 0 and ticket.open:
                await refuse_malformed(ticket, auth.penalty, penalty,
                                       f"cut short: the peer closed before the {length} bytes its header announced")
            raise
        if length > limit:
            await refuse_malformed(ticket, auth.penalty, penalty,
                                   f"hello of {length} bytes exceeds hello_max_bytes ({limit})")
            await send(_frame(refusal(InvalidArgument(f"a link hello is at most {limit} bytes, got {length}"))))
            raise _HelloRefused
        try:
            hello = decode_hello(payload)
        except Malformed as exc:
            await refuse_malformed(ticket, auth.penalty, penalty, str(exc))
            await send(_frame(refusal(InvalidArgument(
                f"malformed link hello ({exc}): it is one msgpack map "
                '{"token": str, "session": str, "link": 1} (or "segments": 1 for shared memory)'))))
            raise _HelloRefused from None
        # Before authentication: the answer depends on the listener's setting alone, and says nothing of a token.
        if hello.link is not None and not links:
            await send(_frame(refusal(Unavailable(
                "this broker serves no links on its Unix socket (fast_path = false): commands go by gRPC; the "
                "socket takes shared-memory segments only"))))
            raise _HelloRefused
        token = hello.token.strip() if hello.token else None  # (as a gRPC call's "Bearer" value is read)
        ticket.judging = True  # (a hello in hand: not to be evicted while it is judged)
        try:
            await auth.tokens.prepare(token)
            try:
                principal = auth.authenticate(Credentials(token, certificate_names, ticket.peer, certificate_issued),
                                              "link/hello",
                                              penalty_key=penalty)
            except Unauthenticated:
                ticket.judging = False
                await ticket.sit_out_failure()
                raise
            if hello.segments is not None:
                if hello.link is not None:
                    raise InvalidArgument("a hello asks for a link or for segments, not both")
                if hello.segments != SEGMENTS_VERSION:
                    raise InvalidArgument(f"this broker speaks segments version {SEGMENTS_VERSION}, the hello asked "
                                          f"for {hello.segments!r}")
                if not segments:
                    raise FailedPrecondition("shared-memory segments pass file descriptors: register them on the "
                                             "broker's Unix socket <socket>.fast, on its host")
            elif hello.link != LINK_VERSION:
                raise InvalidArgument(f"this broker speaks link version {LINK_VERSION}, the hello asked for "
                                      f"{hello.link!r}")
            session = self.service.sessions.get(hello.session or "", principal.tenant)
            # (a link or a segment connection is work the worker does for this credential: at its revocation
            # the worker is retired, _retire.py)
            self.service.credentials.used(session.check_alive(), principal)
        except GpuBrokerError as exc:
            await send(_frame(refusal(exc)))
            raise _HelloRefused from None
        finally:
            ticket.judging = False
        ticket.done()
        bind_log_context(tenant=session.tenant, session=session.id)
        return session, principal, hello

    async def _hand_over(self, session: Session, principal: Principal, fd: int,
                         send: Callable[[bytes], Awaitable[None]], compress: list[str], *,
                         counted_while_kept: bool = False, relayed: bool = False,
                         ring: tuple[RingRequest, socket.socket] | None = None) -> Callable[[], None] | None:
        """Give the connection (``fd``) to the session's worker, which answers the hello and serves it from then
        on; a worker that cannot take it gets the client the reason instead. Returns the link's place in the
        session's and tenant's counts (to be released once the front holds nothing of it), or None: refused.

        The counts are the front's own (the worker's cap is its tenant's to break): past them the hello is
        refused before the worker is asked; and a worker that takes longer than link_handoff_timeout_seconds
        (asleep in its tenant's kernel, or never answering) gets the link refused.

        The worker may be busy for seconds (a long kernel) before it takes the link, and a rotation or removal
        may come meanwhile. So the authentication and its revocation watch are one step: the watch is registered
        before the first await (a revocation from then on closes the session's links, this one included, as the
        worker reads its requests in order), and the worker only holds the link until the front, once the
        hand-off is done, finds the credential still valid and says ``serve_link``: no frame of a revoked
        credential's link is ever read.

        Once served, the front keeps a copy of the link's descriptor until the link ends or the worker does, when it
        shuts it: that ends every copy the tenant's code may have passed elsewhere (_handed.py). With
        ``counted_while_kept`` the link's place in the counts goes with that copy (the release returned does
        nothing); else the caller releases it.

        ``ring``: the hello asked for a shared-memory ring, on this Unix connection: the front makes it
        (``_make_ring``), answers RingGranted with the client's part, and passes the worker its part with the link.
        Its charge to the tenant's shared memory goes with the link's place in the counts. ``relayed``: a TCP
        link, the worker's end a relay's socketpair (its worker polls longer for the next batch)."""
        self._watch_links(session, principal)
        number = next(self._numbers)
        release: Callable[[], None] | None = None
        made: _Ring | None = None
        dup = os.dup(fd)
        try:
            release = self._claim_link(session)
            worker = session.check_alive()
            if ring is not None:
                try:
                    made = await self._grant_ring(session, *ring)
                except OSError as exc:  # the client went while the front answered: its place goes back (below)
                    raise Unavailable(f"the link closed while its ring was granted: {exc.strerror}") from None
                if made is not None:
                    release = _both(release, made.release)
            self._lease(session)
            fds = [dup] if made is None else [dup, made.memfd, made.bell.fileno()]
            try:
                async with asyncio.timeout(self.handoff_timeout):
                    await worker.call(AttachLink(compress, number, ring=made.spec if made is not None else None,
                                                 spin_us=0 if made is not None else self.link_spin_us[relayed]),
                                      session.id, fds)
                    if not self.service.auth.valid(principal.tenant, principal.credential):
                        # Revoked while the worker took it: the watch has asked the worker to close the session's
                        # links.
                        raise Unauthenticated(REVOKED_MESSAGE)
                    await worker.call(ServeLink(number), session.id)
                self.handed.keep(worker, dup, release if counted_while_kept else _nothing)
                dup = -1  # (the handed links' now)
                if counted_while_kept:
                    release = _nothing  # (its place goes back with the kept copy)
            except TimeoutError:
                # The worker may still take the link when it wakes: it is told to drop it, and the link keeps its
                # place in the counts until it has (or has died), so timed-out hand-offs cannot pile up either.
                self._spawn(self._drop_held(worker, session, number, release))
                release = None
                raise Unavailable(f"the session's worker did not take the link within link_handoff_timeout_seconds "
                                  f"({self.handoff_timeout:g} s): it is busy (a long kernel or compile); retry once "
                                  "its work is done", retry_after_seconds=1.0) from None
        except GpuBrokerError as exc:
            if not isinstance(exc, WorkerCrashed):
                self._refusals.log(logging.INFO, f"refused links of tenant {session.tenant}",
                                   "no link for session %s: %s", session.id, exc)  # (a worker's message: escaped)
            if release is not None:
                release()
            await send(_frame(refusal(exc)))
            return None
        finally:
            if dup >= 0:
                os.close(dup)  # the worker holds its own copy (or none: refused)
            if made is not None:
                made.close()  # (the worker has its own)
        return release

    async def _grant_ring(self, session: Session, request: RingRequest, conn: socket.socket) -> _Ring | None:
        """Make the ring a hello asked for, charge it, and answer RingGranted with the client's part (the memfd,
        its doorbell); or answer why not (RingGranted 0: the link goes on as a plain one) and return None."""
        made: _Ring | None = None
        try:
            max_frame = self.service.config.chunk_bytes + LINK_ENVELOPE  # (the worker's, set_limits)
            cap = ring_caps(request.window, max_frame)
            release = self.segments.charge(session, RING_DATA + 2 * cap)
            try:
                made = _make_ring(cap, request.spin_us, release)
            except OSError as exc:
                release()
                raise Unavailable(f"no memory for a ring: {exc.strerror}") from None
            grant = accepted(RingGranted(ring=1, commands=cap, acks=cap))
            # (the connection's first bytes from here: a client that reads nothing still has room for them; one
            # that never reads gets no longer than a hand-off, TimeoutError being an OSError)
            async with asyncio.timeout(self.handoff_timeout):
                await _send_with_fds(conn, _frame(grant), [made.memfd, made.client_bell.fileno()])
        except GpuBrokerError as exc:
            if made is not None:
                made.release()
                made.close()
            async with asyncio.timeout(self.handoff_timeout):
                await _send_all(conn, _frame(accepted(RingGranted(ring=0, reason=exc.message[:1024]))))
            return None
        except BaseException:
            if made is not None:
                made.release()
                made.close()
            raise
        made.client_bell.close()  # (the client has its own)
        return made

    async def _drop_held(self, worker: Any, session: Session, number: int, release: Callable[[], None]) -> None:
        try:
            await worker.call(DropLink(number), session.id)
        except GpuBrokerError:
            pass  # (the worker died, or the session ended: the link went with it)
        finally:
            release()

    def _claim_link(self, session: Session) -> Callable[[], None]:
        """A place for one more link of ``session`` in the front's counts; ResourceExhausted past them. The
        callable returned gives it back (once)."""
        held = self._session_links.get(session.id, 0)
        if held >= MAX_LINKS_PER_SESSION:
            raise ResourceExhausted(f"this session already has {held} links open or being set up, the limit; close "
                                    "one (or wait for its hand-off to finish) before opening another")
        tenant_held = self._tenant_links.get(session.tenant, 0)
        if tenant_held >= self.max_links_per_tenant:
            raise ResourceExhausted(f"tenant {session.tenant!r} already has {tenant_held} links open or being set "
                                    "up across its sessions (max_links_per_tenant); close some before opening more")
        self._session_links[session.id] = held + 1
        self._tenant_links[session.tenant] = tenant_held + 1
        released = False

        def release() -> None:
            nonlocal released
            if released:
                return
            released = True
            for counts, key in ((self._session_links, session.id), (self._tenant_links, session.tenant)):
                left = counts.get(key, 0) - 1
                if left > 0:
                    counts[key] = left
                else:
                    counts.pop(key, None)

        return release

    def _lease(self, session: Session) -> None:
        """The worker's turns on the device for its links' device work come from this device's scheduler."""
        worker = session.worker
        if worker.on_control is None:
            lease = TurnLease(self.service.schedulers[session.device], session.tenant, worker.send_control)
            worker.on_control = lease.on_message
            worker.on_death.append(lease.close)

    def _watch_links(self, session: Session, principal: Principal) -> None:
        """A link lives in the worker: at a revocation, the front tells the worker to close the session's links
        (the client reconnects with the current token). One watch per session and credential. (The same revocation
        retires the worker, _retire.py: its end is what ends a link whose descriptor the tenant's code dup'd, and
        the front's copy of each link, shut then, what ends one the code passed out: _handed.py.)"""
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
                await session.worker.call(CloseLinks(), session.id)

    async def _session_closing(self, session: Session) -> None:
        for key in [k for k in self._link_watches if k[0] == session.id]:
            principal, watch = self._link_watches.pop(key)
            self.service.auth.revocations.unwatch(principal, watch)


def _nothing() -> None:
    """A release with nothing left to give back."""


def _both(first: Callable[[], None], second: Callable[[], None]) -> Callable[[], None]:
    def release() -> None:
        first()
        second()
    return release


def _refuse_rights(sock: socket.socket) -> None:
    """The worker's end of a link takes no descriptor from the client (SO_PASSRIGHTS off, Linux >= 6.16: the
    client's sendmsg with SCM_RIGHTS fails with EPERM). A worker runs its tenant's code: a memfd it received from
    the tenant's client would be shared memory outside every bound (only the front's, checked and charged, may
    reach it). The worker cannot turn it back on (its filter refuses that setsockopt, sandbox/_seccomp.py), and
    where the kernel is older the same filter refuses recvmsg on every socket but the front's fd channel."""
    set_passrights(sock, False)


@dataclass(eq=False)
class _Ring:
    """A ring the front made for a link: its memfd, both doorbells (each refusing descriptors), its shape for
    the worker, and its charge to the tenant's shared memory."""

    memfd: int
    client_bell: socket.socket
    bell: socket.socket  # the worker's
    spec: LinkRing
    release: Callable[[], None]

    def close(self) -> None:
        """The front's own copies (the client and the worker hold theirs)."""
        if self.memfd >= 0:
            os.close(self.memfd)
            self.memfd = -1
        self.client_bell.close()
        self.bell.close()


def _make_ring(cap: int, spin_us: int, release: Callable[[], None]) -> _Ring:
    """A sealed memfd holding the index page and two rings of ``cap`` bytes (exactly: sealed against growing and
    shrinking), and a SOCK_SEQPACKET socketpair for the doorbells; OSError if the host has none to give."""
    size = RING_DATA + 2 * cap
    memfd = sealed_memfd("gpubroker-ring", size)  # (sparse: pages come as the client and the worker touch them)
    try:
        client_bell, bell = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    except BaseException:
        os.close(memfd)
        raise
    for end in (client_bell, bell):
        set_passrights(end, False)  # no descriptor either way through a doorbell
    return _Ring(memfd, client_bell, bell, LinkRing(cap, cap, spin_us), release)


async def _send_all(sock: socket.socket, data: bytes) -> None:
    loop = asyncio.get_running_loop()
    await loop.sock_sendall(sock, data)


async def _send_with_fds(sock: socket.socket, frame: bytes, fds: list[int]) -> None:
    """A frame with ``fds`` attached to its first bytes; the rest, if the socket took only part, after."""
    loop = asyncio.get_running_loop()
    while True:
        try:
            sent = socket.send_fds(sock, [frame], fds)
            break
        except BlockingIOError:  # (only a client that sent its hello and stopped reading fills a buffer this early)
            room = loop.create_future()
            loop.add_writer(sock.fileno(), room.set_result, None)
            try:
                await room
            finally:
                loop.remove_writer(sock.fileno())
    if sent < len(frame):
        await _send_all(sock, frame[sent:])


def _shutter(conn: socket.socket) -> Callable[[], None]:
    """Ends a connection from outside its task: its pending read sees the end, and the task closes it."""
    def shut() -> None:
        with contextlib.suppress(OSError):
            conn.shutdown(socket.SHUT_RDWR)
    return shut


def _frame(payload: bytes) -> bytes:
    return FRAME_HEADER.pack(len(payload)) + payload

