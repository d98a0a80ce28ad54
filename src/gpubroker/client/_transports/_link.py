"""The framed link: the client's commands on one stream socket straight to its session's worker (the
``FramedSocket`` carrier under a BatchingTransport, made by ``framed_link``).

The same frames on every kind of socket (4-byte big-endian length, then the payload): a ``Hello`` to the front
(gpubroker/wire/link.py: token, session, ``link: 1``), which authenticates it as it does a gRPC call and hands the
connection to the session's worker; the worker answers ``LinkAccepted`` (its max frame; a refusal comes from the
front as an error). After that every frame is an encoded protocol Batch one way and its Ack the other, in order.

Where the socket comes from is the only difference between transports: the broker's ``<socket>.fast`` Unix
socket on the same host, its ``link_listen`` TCP port (with the gRPC listener's TLS, which the front
terminates), or its vsock port from a VM guest.
"""

from __future__ import annotations

import os
import select
import socket
import ssl
import time
from collections import deque
from collections.abc import Callable
from typing import Final

import msgspec

from gpubroker.client._tls import TlsOptions
from gpubroker.client._transports._core import ENVELOPE, BatchingTransport, Landed, Lost, Stripes
from gpubroker.wire.commands import READ_HEAD_MAX, read_ack_head
from gpubroker.wire.errors import GpuBrokerError, Unavailable
from gpubroker.wire.frames import (
    FRAME_HEADER,
    FrameClosed,
    FrameDecoder,
    FrameRefused,
    recv_payload,
    send_payload,
)
from gpubroker.wire.link import (
    LINK_SEND_BUFFER,
    LINK_VERSION,
    Hello,
    LinkAccepted,
    Malformed,
    RingGranted,
    RingRequest,
    encode,
    open_answer,
)
from gpubroker.wire.ring import wait_spin_us

__all__ = ["HELLO_REPLY_MAX", "STRIPE_MIN", "TCP_STRIPES", "VMADDR_CID_HOST", "Connector", "FramedSocket",
           "framed_link", "peer_hung_up", "tcp_connector", "tcp_stripes", "unix_connector", "vsock_connector"]

# The front's or worker's answer to a hello: a few hundred bytes, or an error message cut at 4 KiB.
HELLO_REPLY_MAX: Final = 64 * 1024
VMADDR_CID_HOST: Final = 2  # a VM guest reaches its host at this vsock CID
_RDHUP = getattr(select, "POLLRDHUP", 0x2000)  # the peer shut its end (Linux)
_JOIN_MAX = 64 * 1024
_RECORD = 16 * 1024  # a TLS record's most plaintext

# A connected socket within ``timeout`` seconds (OSError if not).
Connector = Callable[[float | None], socket.socket]


def peer_hung_up(sock: socket.socket) -> bool:
    """Whether the broker closed this idle connection (its idle timeout, a revoked token): nothing is waiting to
    be read on a connection between batches, so a hang-up there means it is gone, and a batch not yet sent can
    go on a new one instead of failing. (A zero-timeout poll: a recv would wait out the socket's timeout.)"""
    if sock.fileno() == -1:
        return True
    poller = select.poll()
    poller.register(sock, select.POLLIN | _RDHUP)
    return any(events & (_RDHUP | select.POLLHUP | select.POLLERR | select.POLLNVAL) for _, events in poller.poll(0))


def unix_connector(path: str) -> Connector:
    def connect(timeout: float | None) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(timeout)
            # (the front gives the worker's end as much towards us)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, LINK_SEND_BUFFER)
            sock.connect(path)
        except BaseException:
            sock.close()
            raise
        return sock

    return connect


def tcp_connector(host: str, port: int, tls: TlsOptions | None) -> Connector:
    """TCP to the broker's link port: TLS (and a client certificate) as for its gRPC listener, unless the
    client's options say plaintext (``insecure``) or there are none (a loopback listener without TLS)."""
    context = _tls_context(tls) if tls is not None and not tls.insecure else None
    server_name = (tls.server_name if tls is not None else None) or host

    def connect(timeout: float | None) -> socket.socket:
        sock = socket.create_connection((host, port), timeout=timeout)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # a batch is one small write: send it now
            if context is not None:
                return context.wrap_socket(sock, server_hostname=server_name)
        except BaseException:
            sock.close()
            raise
        return sock

    return connect


def vsock_connector(port: int, cid: int = VMADDR_CID_HOST) -> Connector:
    def connect(timeout: float | None) -> socket.socket:
        sock = socket.socket(socket.AF_VSOCK, socket.SOCK_STREAM)
        try:
            sock.settimeout(timeout)
            sock.connect((cid, port))
        except BaseException:
            sock.close()
            raise
        return sock

    return connect


def _tls_context(tls: TlsOptions) -> ssl.SSLContext:
    root, key, cert = tls.materials()
    context = ssl.create_default_context(cadata=root.decode() if root is not None else None)
    if key is not None and cert is not None:
        # load_cert_chain reads only files: hand it the PEM through memfds, so no key lands on a disk.
        fds = [_memfd("gpubroker-cert", cert), _memfd("gpubroker-key", key)]
        try:
            context.load_cert_chain(f"/proc/self/fd/{fds[0]}", f"/proc/self/fd/{fds[1]}")
        finally:
            for fd in fds:
                os.close(fd)
    return context


def _memfd(name: str, data: bytes) -> int:
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    os.write(fd, data)
    return fd


class _Frames:
    """Reads frames from a socket with as few system calls as it can, through the one frame decoder: between large
    payloads, one recv of up to _JOIN_MAX usually brings a whole small ack (and any that follow it); the rest of a
    large payload is received straight into its own buffer."""

    def __init__(self, sock: socket.socket, limit: int) -> None:
        self._sock = sock
        self._decoder = FrameDecoder(limit, bytearray)
        self._ready: deque[bytearray] = deque()
        self._chunk = memoryview(bytearray(_JOIN_MAX))
        self._peeks = not isinstance(sock, ssl.SSLSocket)  # (a TLS socket's recv takes no flags)
        self._poller = select.poll()
        self._poller.register(sock, select.POLLIN)

    def await_spinning(self, seconds: float) -> float:
        """Poll for the next frame's bytes for up to ``seconds`` before a read blocks on them (as the ring's client
        does, wire/ring.py: in a VM the wake-up of a blocked reader goes through the hypervisor); how long it
        polled. Returns at once where a frame is here already (or TLS holds bytes the socket no longer shows)."""
        sock = self._sock
        if self._ready or (not self._peeks and sock.pending()):  # type: ignore[attr-defined]
            return 0.0
        poll = self._poller.poll
        start = now = time.perf_counter()
        end = start + seconds
        while not poll(0) and now < end:
            os.sched_yield()  # a polite spin: whatever else wants this CPU runs
            now = time.perf_counter()
        return now - start

    def next(self, into: memoryview | None = None) -> bytearray | Landed:
        """The next frame's payload; ``into``: see ``_land``."""
        ready = self._ready
        if into is not None and not ready and len(into) >= _JOIN_MAX and not self._decoder.reading:
            landed = self._land(into) if self._peeks else self._land_taking(into)
            if landed is not None:
                return landed
        while not ready:
            into = self._decoder.buffer()
            if len(into) > _JOIN_MAX:
                return self._rest(into)
            k = self._sock.recv_into(self._chunk)
            if k == 0:
                raise FrameClosed("peer closed the connection")
            ready.extend(self._decoder.feed(self._chunk[:k]))
        return ready.popleft()

    def _land(self, into: memoryview) -> Landed | None:
        """Where the next frame is an Ack to a raw Read of ``len(into)`` bytes, sent as encode_ack_parts sends it
        (its head, then the bytes): the head is read, checked and rewritten with an empty result (``Landed``), and
        the bytes received straight into ``into``, with no buffer of their own and no copy. Looked at first
        without taking anything (MSG_PEEK): anything else, or a head not all here yet, is left for the usual
        reading (None). Waits for the frame's first bytes as a receive does (TimeoutError, nothing taken); once
        the head is taken, bytes that stop coming lose the link (its frames would be out of step)."""
        n = len(into)
        peeked = self._sock.recv(FRAME_HEADER.size + READ_HEAD_MAX, socket.MSG_PEEK)
        if len(peeked) < FRAME_HEADER.size:
            return None
        end = FRAME_HEADER.size + FRAME_HEADER.unpack_from(peeked)[0] - n  # (where the bytes would start)
        if not FRAME_HEADER.size < end <= len(peeked):
            return None
        encoded = read_ack_head(peeked[FRAME_HEADER.size:end], n)
        if encoded is None:
            return None
        try:
            _recv_exactly(self._sock, self._chunk[:end])  # (what was peeked, taken)
            _recv_exactly(self._sock, into)
        except TimeoutError:
            raise FrameClosed("a read's bytes stopped coming halfway") from None
        return Landed(encoded)

    def _land_taking(self, into: memoryview) -> Landed | None:
        """``_land`` where nothing can be looked at without taking it (a TLS socket): the frame's header is taken
        first (one recv of its 4 bytes, which waits as a receive does: nothing taken on a timeout), then the head
        it announces, then, where the head is a raw Read's Ack of ``len(into)`` bytes, the bytes into ``into``.
        Anything else goes to the frame decoder as taken, and the frame is read as usual (None)."""
        n, chunk, size = len(into), self._chunk, FRAME_HEADER.size
        k = self._sock.recv_into(chunk[:size], size)
        if k == 0:
            raise FrameClosed("peer closed the connection")
        end = size + FRAME_HEADER.unpack_from(chunk)[0] - n if k == size else 0  # (where the bytes would start)
        encoded = None
        if size < end <= size + READ_HEAD_MAX:
            try:
                _recv_exactly(self._sock, chunk[size:end])
            except TimeoutError:
                raise FrameClosed("a frame stopped coming halfway") from None
            encoded = read_ack_head(chunk[size:end], n)
            k = end
        if encoded is None:
            self._ready.extend(self._decoder.feed(chunk[:k]))
            return None
        try:
            _recv_exactly(self._sock, into)
        except TimeoutError:
            raise FrameClosed("a read's bytes stopped coming halfway") from None
        return Landed(encoded)

    def _rest(self, into: memoryview) -> bytearray:
        """A large payload's rest, received in place (no copy) until whole. Over TLS each recv brings one record
        (16 KiB): the loop does no more per record than the recv, and tells the decoder once (also when a recv
        fails: what came is the decoder's)."""
        recv_into, got, want = self._sock.recv_into, 0, len(into)
        try:
            while got < want:
                # (the size said: an SSL socket's recv_into otherwise opens a memoryview to measure the buffer,
                # per 16 KiB record)
                k = recv_into(into[got:], want - got)
                if k == 0:
                    raise FrameClosed("peer closed the connection")
                got += k
        finally:
            payload = self._decoder.advance(got) if got else None
        assert payload is not None  # (``into`` was the payload's whole rest)
        return payload


def _recv_exactly(sock: socket.socket, into: memoryview) -> None:
    """Fill ``into`` from ``sock``; FrameClosed at the peer's end."""
    got, want = 0, len(into)
    while got < want:
        k = sock.recv_into(into[got:], want - got)
        if k == 0:
            raise FrameClosed("peer closed the connection")
        got += k


# A copy this large over TCP is striped over several links of the session: one TLS connection is one core's
# encryption here and one relay thread's decryption in the front, fewer bytes a second than a device takes.
STRIPE_MIN: Final = 8 << 20
# Links a striped copy uses at most, its own included (the worker serves at most 8 per session).
TCP_STRIPES: Final = 4


def tcp_stripes() -> int:
    """Links a copy over TCP stripes over here: one per two cores this process may use, as each link's share
    is encrypted by a thread of its own (and, on loopback, decrypted by another in the front). A 2-core host
    gains nothing: its cores are all busy with one link already."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(TCP_STRIPES, cores // 2))


def framed_link(connect: Connector, token: str, session: str, *, kind: str, timeout: float | None,
                window: int = 4, batch_size: int = 256, compress: str = "") -> BatchingTransport:
    """A transport whose batches go on a framed stream socket to the session's worker; opened (hello answered)
    here. A TCP link stripes large copies over further links of the session (``tcp_stripes``, opened at the
    first such copy).

    Raises the front's refusal (Unauthenticated, NotFound for another tenant's session, ...) as its error, and
    Unavailable when nothing answers (no link there: the caller may fall back to gRPC).
    """
    carrier = FramedSocket(connect, token, session, kind=kind, timeout=timeout, compress=compress)
    stripes = Stripes(tcp_stripes(), STRIPE_MIN, carrier.another) if kind == "tcp" else None
    transport = BatchingTransport(carrier, timeout=timeout, window=window, batch_size=batch_size, stripes=stripes)
    transport.open()
    return transport


def _close_fds(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)


def _close_grant(granted: tuple[RingGranted, list[int]] | None) -> None:
    if granted is not None:
        _close_fds(granted[1])


def _recv_payload_with_fds(sock: socket.socket, limit: int, max_fds: int = 2) -> tuple[bytearray, list[int]]:
    """One frame's payload and the descriptors that came with it (at most ``max_fds``: the kernel closes any
    more); nothing past the frame's end is read."""
    frames = FrameDecoder(limit, bytearray)
    fds: list[int] = []
    try:
        while True:
            into = frames.buffer()
            data, got, _, _ = socket.recv_fds(sock, len(into), max_fds - len(fds) or 1)
            fds += got
            if not data:
                raise FrameClosed("peer closed the connection")
            into[:len(data)] = data
            payload = frames.advance(len(data))
            if payload is not None:
                return payload, fds
    except BaseException:
        _close_fds(fds)
        raise


class FramedSocket:
    """The carrier of batches on a framed stream socket to the session's worker: the hello at each open, then
    one frame per batch one way and per ack the other."""

    def __init__(self, connect: Connector, token: str, session: str, *, kind: str, timeout: float | None,
                 compress: str = "", ring: RingRequest | None = None) -> None:
        self.kind = kind  # (set by a ring upgrading this link: "ring", or "unix" where the worker declined)
        self.max_data = 0  # (the worker's max frame less ENVELOPE, once a hello is answered)
        self.max_frame = 0
        self.codec = ""  # what the worker took of ``compress`` ("" none)
        self.sock: socket.socket | None = None
        self._connect = connect
        self._timeout = timeout  # the hello's answer and each ack are waited for this long
        self._hello = Hello(token=token, session=session, link=LINK_VERSION, compress=(compress,) if compress else (),
                            ring=ring)
        self._compress = compress  # asked for in the hello
        self._frames: _Frames | None = None
        # How long a wait for the answer to the last batch sent polls before it blocks (wire/ring.py).
        self._spin = wait_spin_us() * 1e-6
        # What the front and the worker said of the ring the hello asked for, at the last open: granted and mapped
        # (the grant, with the memfd and this side's doorbell: the ring carrier's to take), or why not.
        self.ring: tuple[RingGranted, list[int]] | None = None
        self.ring_declined = ""

    def another(self) -> FramedSocket:
        """A further link of the same session, not yet open (for striped copies)."""
        return FramedSocket(self._connect, self._hello.token or "", self._hello.session or "", kind=self.kind,
                            timeout=self._timeout, compress=self._compress)

    def open(self) -> None:
        self.sock, max_frame = self._handshake(ring=True)
        self._frames = _Frames(self.sock, max_frame)
        self.max_data, self.max_frame = max_frame - ENVELOPE, max_frame

    def _handshake(self, ring: bool = False) -> tuple[socket.socket, int]:
        """A connection whose hello the worker answered, and its max frame; or the refusal, raised. With ``ring``
        the hello asks for the ring this carrier was made with (if any): the front's RingGranted comes first."""
        self._drop_ring()
        hello = self._hello if ring else msgspec.structs.replace(self._hello, ring=None)
        try:
            sock = self._connect(self._timeout)
        except OSError as exc:
            raise Unavailable(f"no {self.kind} link to the broker: {exc}") from None
        granted: tuple[RingGranted, list[int]] | None = None
        try:
            sock.settimeout(self._timeout)  # the hello's answer and each ack are waited for this long
            send_payload(sock, encode(hello))
            if hello.ring is not None:
                reply, fds = _recv_payload_with_fds(sock, HELLO_REPLY_MAX)
                granted = self._take_grant(sock, reply, fds)
            reply = recv_payload(sock, HELLO_REPLY_MAX)
        except (OSError, EOFError, ValueError) as exc:  # closed unanswered: refused before authentication, a cap
            sock.close()
            _close_grant(granted)
            raise Unavailable(f"the broker's {self.kind} link did not answer its hello: {exc}") from None
        except BaseException:
            _close_grant(granted)
            raise
        try:
            answer = open_answer(reply, LinkAccepted)  # (the front's refusal raised as its error)
            max_frame, codec = answer.max_frame, answer.compress
            if answer.link != LINK_VERSION or max_frame <= ENVELOPE or codec not in ("", self._compress):
                raise Unavailable(f"the broker's {self.kind} link answered its hello with {answer!r}")
            self.codec = codec
        except Malformed as exc:
            sock.close()
            _close_grant(granted)
            raise Unavailable(f"the broker's {self.kind} link answered its hello with {bytes(reply[:200])!r} "
                              f"({exc})") from None
        except GpuBrokerError:
            sock.close()
            _close_grant(granted)
            raise
        if granted is not None and not answer.ring:
            _close_grant(granted)
            granted, self.ring_declined = None, "the worker could not map the ring the broker made (see its log)"
        self.ring = granted
        return sock, max_frame

    def _take_grant(self, sock: socket.socket, reply: bytearray,
                    fds: list[int]) -> tuple[RingGranted, list[int]] | None:
        """The front's answer to the hello's ring: the grant and its fds (the memfd, this side's doorbell), or None
        (``ring_declined`` says why). A refusal of the hello itself is raised (and the fds closed)."""
        try:
            grant = open_answer(reply, RingGranted)
        except Malformed as exc:
            _close_fds(fds)
            sock.close()
            raise Unavailable(f"the broker's {self.kind} link answered its ring with {bytes(reply[:200])!r} "
                              f"({exc})") from None
        except GpuBrokerError:
            _close_fds(fds)
            sock.close()
            raise
        if grant.ring != 1 or len(fds) != 2:
            _close_fds(fds)
            self.ring_declined = grant.reason or f"the broker answered the ring with {grant!r}"
            return None
        return grant, fds

    def _drop_ring(self) -> None:
        _close_grant(self.ring)
        self.ring, self.ring_declined = None, ""

    def send(self, payload: bytes) -> None:
        sock = self.sock
        assert sock is not None
        try:
            if isinstance(sock, ssl.SSLSocket) and len(payload) > _JOIN_MAX:  # TLS has no sendmsg
                # The header with the first record's worth of the payload (one copy of 16 KiB, not of the
                # payload), then the rest: whole records while the frame streams, and a short one at its end
                # (which the front's relay takes as the frame's end, server/_links.py).
                head = _RECORD - FRAME_HEADER.size
                view = memoryview(payload)
                sock.sendall(FRAME_HEADER.pack(len(payload)) + view[:head])
                sock.sendall(view[head:])
            else:
                send_payload(sock, payload)
        except OSError as exc:  # (a timeout too: part of a frame may have gone, so the stream is out of step)
            raise Lost(f"sending failed: {exc}") from None

    def receive(self, timeout: float | None, in_flight: int, into: memoryview | None = None) -> bytes | bytearray:
        # (the socket's own timeout is the hello's: a call with a bound of its own sets it for this wait alone; a
        # recv it cuts short leaves the frame decoder where it was, so the next receive goes on with that frame)
        assert self._frames is not None and self.sock is not None
        if in_flight <= 1 and self._spin:
            # The answer to the last batch sent: polled for before the read blocks (``in_flight`` > 1 is back-
            # pressure or a drain: the rest is behind what is awaited, and a spin would only take CPU), within
            # the call's bound, which counts the poll.
            spent = self._frames.await_spinning(self._spin if timeout is None else min(self._spin, timeout))
            if timeout is not None:
                timeout = max(timeout - spent, 1e-4)  # (never 0: that would make the socket non-blocking)
        own = timeout != self._timeout
        if own:
            self.sock.settimeout(timeout)
        try:
            return self._frames.next(into)
        except TimeoutError:
            raise
        except (OSError, EOFError, FrameRefused) as exc:
            raise Lost(str(exc) or type(exc).__name__) from None
        finally:
            if own and self.sock is not None:
                self.sock.settimeout(self._timeout)

    def arrived(self) -> bytes | bytearray | None:
        return None  # (a socket's next frame may be partly here: asked only by blocking reads)

    @property
    def sees_acks(self) -> bool:
        return False

    def shut(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None

    def hung_up(self) -> bool:
        return self.sock is None or peer_hung_up(self.sock)

    def why_lost(self, reason: str) -> GpuBrokerError:  # (a hello that asks for no ring)
        """The front knows why a link dropped (the session's worker died, the session ended): ask it with a new
        hello; one that is answered means the session lives and only the connection was lost."""
        try:
            self._handshake()[0].close()
        except GpuBrokerError as refusal:
            if not isinstance(refusal, Unavailable):
                return refusal
        return Unavailable(f"the {self.kind} link to the broker was lost: {reason}")
