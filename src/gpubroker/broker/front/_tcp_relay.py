"""A TCP link's thread: the TLS handshake (when the link does TLS) and the hello's bytes, then the relay between
the connection and the worker's end of a socketpair (the front keeps the server's key; a worker takes only local
sockets). `front/_links.py` judges the hello on its loop and tells the thread what to do (`LinkRelay.decide`).

The thread runs in the front (`ThreadRelay`: plaintext TCP, or TLS where no relay process serves) or in one of
the front's TLS relay processes (`_tls_relays.py`: there the same `TcpRelay` runs, told and heard through typed
messages); `front/_links.py` sees either as a `LinkRelay`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import queue
import select
import socket
import ssl
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from gpubroker.broker.front.auth import peer_certificate_issued, peer_certificate_names
from gpubroker.wire.frames import FRAME_HEADER, FrameDecoder, FrameTooLarge

__all__ = ["HandshakeFailed", "Hello", "HelloCutShort", "LinkRelay", "SpinShare", "TcpRelay", "ThreadRelay"]

# A hello as the relay read it: its frame (header and body, or only the header of one past the limit), and its
# verified client certificate's names (gRPC's order) and notBefore: (), None without one.
Hello = tuple[bytes, tuple[str, ...], float | None]


class HandshakeFailed(Exception):
    """The TLS handshake failed (a wrong or absent client certificate, bytes that are no TLS, the peer closing or
    resetting mid-handshake); its message says why in OpenSSL's fixed words, never in any text of the peer's."""


class HelloCutShort(EOFError):
    """The peer closed after some of its hello and before the rest (a bare close, before any byte of it, is no
    hello at all); the message says how far it got."""


class LinkRelay(Protocol):
    """A TCP link as the front's loop sees it, whichever process relays it: `start` it; its `hello` comes (or
    the exception saying why none: HandshakeFailed, HelloCutShort, TimeoutError, EOFError, OSError); the front
    judges it and `decide`s; `abort` at the hello's deadline or an eviction. ``on_end``, set before `decide`, is
    called (from any thread) once the relay is over."""

    hello: asyncio.Future[Hello]
    on_end: Callable[[], Any] | None

    @property
    def aborted(self) -> bool: ...

    @property
    def progressed(self) -> bool:
        """The handshake is done or a byte of the hello came (a late one is audited as a late hello)."""

    @property
    def started(self) -> bool:
        """A byte of the handshake or of the hello came: the connection is not idle (never evicted)."""

    def start(self) -> None: ...

    def abort(self) -> None: ...

    def decide(self, frames: list[bytes], worker: socket.socket | None, tenant: str = "") -> None:
        """Write ``frames`` (a refusal or the hand-off's answers), then relay to ``worker`` (taken) or close.
        ``tenant``: whose link it is (its relay's polls are the tenant's share of its process's)."""


class ThreadRelay:
    """A `LinkRelay` run by a thread of the front."""

    def __init__(self, conn: socket.socket, tls: ssl.SSLContext | None, hello_limit: int, timeout: float,
                 stop_fd: int, loop: asyncio.AbstractEventLoop) -> None:
        self.hello: asyncio.Future[Hello] = loop.create_future()
        hello = self.hello

        def report(outcome: Hello | BaseException) -> None:
            loop.call_soon_threadsafe(_settle, hello, outcome)

        self._relay = TcpRelay(conn, tls, hello_limit, timeout, stop_fd, report)

    @property
    def on_end(self) -> Callable[[], Any] | None:
        return self._relay.on_end

    @on_end.setter
    def on_end(self, call: Callable[[], Any] | None) -> None:
        self._relay.on_end = call

    @property
    def aborted(self) -> bool:
        return self._relay.aborted

    @property
    def progressed(self) -> bool:
        return self._relay.progressed

    @property
    def started(self) -> bool:
        return self._relay.started

    def start(self) -> None:
        try:
            threading.Thread(target=self._relay.run, name="gpubroker-link", daemon=True).start()
        except RuntimeError as exc:  # (no thread to be had: the host's or the broker's task limit)
            self._relay.never_ran()
            _settle(self.hello, OSError(f"no thread to relay the link: {exc}"))

    def abort(self) -> None:
        self._relay.abort()

    def decide(self, frames: list[bytes], worker: socket.socket | None, tenant: str = "") -> None:
        self._relay.decide(frames, worker, tenant)


class TcpRelay:
    """One TCP link, in a thread of its own: the TLS handshake and the hello (``report``ed, to be judged by the
    front on its loop), then the relay between the connection and the worker's socketpair.

    A thread, not an event loop, because the relay is the link's whole cost: decrypting and encrypting every
    byte, and copying it. The ssl and socket calls let go of the GIL, and none of it delays the front's gRPC calls
    and scheduler. One thread does both directions: an SSL object is not safe for two threads at once.
    """

    def __init__(self, conn: socket.socket, tls: ssl.SSLContext | None, hello_limit: int, timeout: float,
                 stop_fd: int, report: Callable[[Hello | BaseException], None],
                 on_progress: Callable[[bool], None] | None = None,
                 spin_share: Callable[[str], SpinShare] | None = None) -> None:
        self.sock: socket.socket = conn
        # What the relay may poll for more after moving bytes, before it blocks (``_relay``): its tenant's share of
        # the process's polls (none: it never polls).
        self._spin_share = spin_share
        self.aborted = False
        # Set by the thread once the handshake is done or a byte of the hello has come (the audit's words for a
        # late one), and once the handshake's first byte has come: the connection is not idle (the gate never
        # evicts it to make room), whatever its socket still holds.
        self.progressed = False
        self.started = False
        self._report = report
        self._on_progress = on_progress
        self._tls = tls
        self._limit = hello_limit
        self._timeout = timeout
        self._stop_fd = stop_fd
        self._lock = threading.Lock()  # abort (the loop) against the thread's wrap and close of the socket
        self._closed = False
        self._late = False  # the thread stopped waiting for the verdict
        self._verdict: queue.SimpleQueue[tuple[list[bytes], socket.socket | None, str]] = queue.SimpleQueue()
        # Called (from the thread) once the relay is over: gives the link's place back in the front's counts.
        self.on_end: Callable[[], Any] | None = None

    def abort(self) -> None:
        """The hello's deadline: shut the connection, which ends the thread's read (the thread closes it)."""
        with self._lock:
            if not self._closed:
                self.aborted = True
                with contextlib.suppress(OSError):
                    self.sock.shutdown(socket.SHUT_RDWR)

    def never_ran(self) -> None:
        """Its thread could not start: the connection is closed, and `decide` answers for the thread."""
        with self._lock:
            self._late = True
        self._close()

    def decide(self, frames: list[bytes], worker: socket.socket | None, tenant: str = "") -> None:
        """What the thread does after the hello: write ``frames`` (a refusal), then relay to ``worker`` (the link of
        ``tenant``) or close.
        After the thread stopped waiting for it (the front took longer than _VERDICT_WAIT): ``worker`` is closed
        and ``on_end`` called here, so that the link's place is given back all the same."""
        with self._lock:
            late = self._late
            if not late:
                self._verdict.put((frames, worker, tenant))
        if late:
            if worker is not None:
                worker.close()
            self._end()

    def _end(self) -> None:
        """Call ``on_end``, once: the thread at its end and a late `decide` may both get here (``on_end`` set
        between the thread's timeout and its end: the link's place must not be given back twice)."""
        with self._lock:
            on_end, self.on_end = self.on_end, None
        if on_end is not None:
            with contextlib.suppress(RuntimeError):  # (the loop closed: the broker stopped)
                on_end()

    # -- the thread ----------------------------------------------------------------------------------
    def run(self) -> None:
        try:
            hello: Hello | BaseException = self._read_hello()
        except Exception as exc:  # (ssl.SSLError, OSError, EOFError: the loop's side sorts them out)
            hello = exc
            self.started = False  # (a failed handshake waits out its failure delay: a newcomer may take its place)
        self._report(hello)
        try:
            frames, worker, tenant = self._verdict.get(timeout=_VERDICT_WAIT)
        except queue.Empty:  # (the broker stopping before it judged the hello)
            with self._lock:
                self._late = True  # (a verdict after this is answered by decide itself)
            try:
                frames, worker, tenant = self._verdict.get_nowait()
            except queue.Empty:
                frames, worker, tenant = [], None, ""
        try:
            if not isinstance(hello, BaseException):
                self.sock.settimeout(self._timeout)
                for frame in frames:
                    self.sock.sendall(frame)
                if worker is not None:
                    share = self._spin_share(tenant) if self._spin_share is not None else None
                    _relay(self.sock, worker, self._stop_fd, share)
        except OSError:
            pass
        finally:
            if worker is not None:
                worker.close()
            self._close()
            # (also after a failed hello: in a relay process the link is forgotten, and the front told, only so)
            self._end()

    def _start(self) -> None:
        if not self.started:
            self.started = True
            if self._on_progress is not None:
                self._on_progress(False)

    def _progress(self) -> None:
        if not self.progressed:
            self.started = self.progressed = True
            if self._on_progress is not None:
                self._on_progress(True)

    def _read_hello(self) -> Hello:
        """The handshake and the hello's frame (only its header if that announces more than the limit)."""
        deadline = time.monotonic() + self._timeout

        def left() -> float:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or self.aborted:
                raise TimeoutError("no hello in time")
            return remaining

        cert: Any = None
        if self._tls is not None:
            # A connection closed before its first byte is no handshake at all (a port probe), as a bare close is
            # no hello on the other listeners: it ends without an audit line. (The deadline's shutdown ends this
            # wait too.)
            self.sock.settimeout(left())
            if not self.sock.recv(1, socket.MSG_PEEK):
                left()  # (the deadline's or an eviction's shutdown: audited by whoever shut it)
                raise EOFError("closed before the TLS handshake")
            # The handshake has begun: no longer an idle connection (its bytes are OpenSSL's once taken, so the
            # gate's peek would see a client still sending its certificate as idle, and evict it for a newcomer).
            # A byte of the hello counts the same on the listeners without TLS; the deadline bounds both.
            self._start()
            with self._lock:
                if self.aborted:
                    raise TimeoutError("no hello in time")
                self.sock = self._tls.wrap_socket(self.sock, server_side=True, do_handshake_on_connect=False)
            assert isinstance(self.sock, ssl.SSLSocket)
            self.sock.settimeout(left())
            try:
                self.sock.do_handshake()
            except TimeoutError:
                raise
            except (ssl.SSLError, OSError) as exc:
                left()  # (an abort shut the socket under the handshake: the abort's reason is the one)
                raise HandshakeFailed(_handshake_failure(exc)) from None
            self._progress()
            cert = self.sock.getpeercert()
        names, issued = peer_certificate_names(cert), peer_certificate_issued(cert)
        frames = FrameDecoder(self._limit, bytearray)  # (never past the hello's end: what follows is the worker's)
        got = 0
        while True:
            self.sock.settimeout(left())
            n = self.sock.recv_into(frames.buffer())
            if not n:
                if got:
                    raise HelloCutShort(f"cut short: the peer closed {got} bytes into its hello")
                raise EOFError("closed before the hello")
            got += n
            self._progress()
            try:
                payload = frames.advance(n)
            except FrameTooLarge as exc:
                return FRAME_HEADER.pack(exc.length), names, issued  # (refused before a byte of the body is read)
            if payload is not None:
                return FRAME_HEADER.pack(len(payload)) + payload, names, issued

    def _close(self) -> None:
        with self._lock:
            self._closed = True
            self.sock.close()


def _handshake_failure(exc: BaseException) -> str:
    """Why a handshake failed, for the audit line: OpenSSL's reason and verification message (fixed strings), or
    the socket error's name; never the exception's text, which may quote what the peer sent."""
    if isinstance(exc, ssl.SSLCertVerificationError):
        return f"{exc.reason or 'CERTIFICATE_VERIFY_FAILED'} ({exc.verify_message})"
    if isinstance(exc, (ssl.SSLEOFError, ssl.SSLZeroReturnError)):
        return "the peer closed the connection during the handshake"
    if isinstance(exc, ssl.SSLError):
        return str(exc.reason or exc.library or "TLS error")
    if isinstance(exc, OSError) and exc.errno is not None:
        return os.strerror(exc.errno)
    return type(exc).__name__


def _settle(future: asyncio.Future[Any], outcome: Any) -> None:
    if not future.done():
        if isinstance(outcome, BaseException):
            future.set_exception(outcome)
        else:
            future.set_result(outcome)


# How long a link's thread waits for the front to judge its hello (authentication's failure delay and the hand-off
# take seconds at most; only a broker stopping meanwhile leaves it waiting).
_VERDICT_WAIT = 120.0
# What a link's relay holds each way: a few TLS records' worth per read and write, at most this much of a
# client's frames in the front at a time (the rest waits in the sockets).
_RELAY_PIECE = 512 * 1024
_IN, _OUT = select.POLLIN, select.POLLOUT
# A TLS record's most plaintext. A client streaming a large frame sends full records, and its frame's last
# record is short: while full ones come, the relay gathers up to _GATHER bytes before it writes them to the
# worker, so neither it nor the worker wakes for every 16 KiB; a short record (a small batch, a frame's end) goes
# at once. _LINGER_MS bounds the wait for a frame that happens to end on a full record.
_RECORD = 16 * 1024
_GATHER = 256 * 1024
_LINGER_MS = 2


# A relay's poll is the front's CPU spent waiting on a link's peers, whose timing the tenant controls: a client
# sending a byte (or a worker an answer) every ~100 us would keep its relay polling all the time for next to
# nothing of its own (an attacker measured 7x its own CPU in a relay process, with two links). So the links of one
# tenant in a relay process share what they may poll (``SpinShare``): one of them at a time, and half their wall
# time between them (each earns that share of the wall time, up to _SPIN_BURST ahead, and spends what it polls);
# and at most _SPINNERS relays of a process poll at once, whoever's. One tenant's links then cost a relay process
# at most half a core polling, and another tenant's links poll beside them.
_SPINNERS = threading.BoundedSemaphore(2)
_SPIN_SHARE = 0.5
_SPIN_BURST = 0.002


class _SpinBudget:
    """What may still be polled (seconds): ``_SPIN_SHARE`` of the wall time since it began, at most
    ``_SPIN_BURST`` ahead, less what was polled."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.credit = _SPIN_BURST
        self._clock = clock
        self._at = clock()

    def until(self, end: float) -> float:
        """When a poll that wants to go on until ``end`` must stop (the past: none now)."""
        now = self._clock()
        self.credit = min(_SPIN_BURST, self.credit + (now - self._at) * _SPIN_SHARE)
        self._at = now
        return now + min(end - now, self.credit)

    def spent(self, seconds: float) -> None:
        self.credit -= seconds


class SpinShare:
    """What the links of one tenant in one relay process may poll: ``seconds`` after each move of bytes, one of
    them at a time (``slot``), within one budget."""

    __slots__ = ("__weakref__", "budget", "seconds", "slot")

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.slot = threading.Lock()
        self.budget = _SpinBudget()


def _spin_poll(poller: select.poll, end: float, share: SpinShare) -> dict[int, int]:
    """Poll without waiting until something is ready or ``end`` (perf_counter) passes, as far as the tenant's
    share goes; nothing (at once) where another of its links, or _SPINNERS relays of the process, poll already."""
    if not _SPINNERS.acquire(blocking=False):
        return {}
    try:
        if not share.slot.acquire(blocking=False):
            return {}
        try:
            start = time.perf_counter()
            stop = share.budget.until(end)
            try:
                while True:
                    ready = poller.poll(0)
                    if ready or time.perf_counter() >= stop:
                        return dict(ready)
                    os.sched_yield()  # a polite spin: whatever else wants this CPU runs
            finally:
                share.budget.spent(time.perf_counter() - start)
        finally:
            share.slot.release()
    finally:
        _SPINNERS.release()


class _Flow:
    """One direction of a relay: bytes from ``src`` into a bounded buffer, and from it to ``dst``; non-blocking,
    retried after poll says the side it waits for is ready."""

    def __init__(self, src: socket.socket, dst: socket.socket) -> None:
        self.src, self.dst = src, dst
        self.buf = memoryview(bytearray(_RELAY_PIECE))
        self.start = self.end = 0
        self.eof = False  # src ended (or failed)
        self.broken = False  # dst failed: what src sends from now on is dropped
        self.src_waits = 0  # the poll event src needs before the next read (0: try now)
        self.dst_waits = 0
        self._again = 0  # an SSL write that would block is repeated with the same length
        self._gathers = isinstance(src, ssl.SSLSocket)
        self._full = False  # the last read was a whole record: more of the frame is on its way
        self.flush = False  # (set when the linger is over: write what is gathered)

    @property
    def holding(self) -> bool:
        """Gathering a streamed frame's records before writing them on."""
        return (self._gathers and self._full and not self.flush and not self.eof
                and self.end - self.start < _GATHER and self.end < _RELAY_PIECE)

    def pump(self) -> bool:
        """Move what can move now; whether anything did."""
        moved = False
        while True:
            progress = False
            if not self.eof and not self.src_waits and self.end < _RELAY_PIECE:
                room = _RELAY_PIECE - self.end
                try:
                    # (the size said: an SSL socket's recv_into otherwise opens a memoryview to measure the
                    # buffer, for every 16 KiB record)
                    n = self.src.recv_into(self.buf[self.end:], room)
                except (ssl.SSLWantReadError, BlockingIOError):
                    self.src_waits = _IN
                except ssl.SSLWantWriteError:
                    self.src_waits = _OUT
                except OSError:  # (a reset, a TLS error, an end without close_notify): the side is gone
                    self.eof = True
                else:
                    if n:
                        self.end += n
                        self._full = n == _RECORD
                        progress = True
                        tls = self.src if isinstance(self.src, ssl.SSLSocket) else None
                        if n < room and not self._full and not (tls is not None and tls.pending()):
                            # Most likely all there was (a small batch, an ack): wait for poll rather than
                            # fail a read. (OpenSSL reads a record at a time, so none hides in its buffer.)
                            self.src_waits = _IN
                    else:
                        self.eof = True
            if self.start < self.end and not self.dst_waits and not self.broken and not self.holding:
                size = self._again or self.end - self.start
                try:
                    n = self.dst.send(self.buf[self.start:self.start + size])
                except (ssl.SSLWantWriteError, BlockingIOError):
                    self.dst_waits, self._again = _OUT, size
                except ssl.SSLWantReadError:
                    self.dst_waits, self._again = _IN, size
                except OSError:
                    self.broken = True
                    self.start = self.end = 0
                else:
                    self._again = 0
                    self.flush = False
                    self.start += n
                    if self.start == self.end:
                        self.start = self.end = 0
                    progress = True
            if self.broken and self.end:
                # dst takes no more: src's bytes are read and dropped, so that what goes the other way (the
                # worker's last answer) is not cut short by a reset for unread bytes.
                self.start = self.end = 0
                progress = True
            if not progress:
                return moved
            moved = True

    @property
    def drained(self) -> bool:
        return self.eof and self.start == self.end


def _relay(tcp: socket.socket, worker: socket.socket, stop_fd: int, share: SpinShare | None = None) -> None:
    """Relay until the worker's end closes (after the client's, or at a revocation) or either side fails.

    With ``share`` (its tenant's), after moving bytes it polls a while for more before it blocks: a client's batch
    is answered, and a synchronous client's next batch follows its answer, within tens of microseconds, and a
    blocked thread's wake-up in a VM goes through the hypervisor (wire/ring.py). Never while it gathers a streamed
    frame."""
    tcp.setblocking(False)
    worker.setblocking(False)
    up, down = _Flow(tcp, worker), _Flow(worker, tcp)
    poller = select.poll()
    poller.register(stop_fd, _IN)
    registered: dict[int, int] = {}
    shut = False
    spin_end = 0.0
    while True:
        moved = up.pump()
        if (down.pump() or moved) and share is not None:
            spin_end = time.perf_counter() + share.seconds
        if down.broken or down.drained:
            return  # (the worker ended the link, or the client's side failed: the connection closes)
        if up.drained and not shut:
            shut = True
            with contextlib.suppress(OSError):
                worker.shutdown(socket.SHUT_WR)  # the client's end: the worker answers what it has, then closes
        wants = {tcp.fileno(): 0, worker.fileno(): 0}
        for flow in (up, down):
            if not flow.eof and flow.end < _RELAY_PIECE:
                wants[flow.src.fileno()] |= flow.src_waits
            if flow.start < flow.end:
                wants[flow.dst.fileno()] |= flow.dst_waits
        for fd, events in wants.items():
            if events == registered.get(fd, 0):
                continue
            registered[fd] = events
            if events:
                poller.register(fd, events)  # (again: modifies)
            else:  # not even for a hang-up, which poll would report at once, again and again
                poller.unregister(fd)
        holding = [flow for flow in (up, down) if flow.holding]
        ready = _spin_poll(poller, spin_end, share) if share is not None and spin_end and not holding else {}
        if not ready:
            spin_end = 0.0
            ready = dict(poller.poll(_LINGER_MS if holding else None))
        if stop_fd in ready:
            return
        if not ready:
            for flow in holding:
                flow.flush = True
        for flow in (up, down):  # whatever became ready is tried again
            if flow.src.fileno() in ready:
                flow.src_waits = 0
            if flow.dst.fileno() in ready:
                flow.dst_waits = 0
