"""Links: a client's framed connection served by its worker directly, with no hop through the front.

The front authenticates a link's hello (on ``<socket>.fast``, TCP behind the front's TLS, or vsock), then hands
the connection to the session's worker (``attach_link``), which answers the hello itself
(``LinkAccepted``, gpubroker/wire/link.py). From then on every client frame's payload is an
encoded protocol Batch, answered by one frame holding its encoded Ack, in order. Only link commands may come this
way (a module load goes through the front, which bounds its compile time); a malformed frame is answered by an
Ack with id 0 and its error, then the link is closed.

Device work needs the tenant's turn on the device, which only the front's scheduler gives: the worker asks for a
lease (``want``), runs link batches while it holds one, and hands it back when the front revokes it (another
tenant's turn, or the scheduler's periodic accounting). While others wait, each batch is one turn.

On the same host the client may ask in its hello for a shared-memory ring (``_ring.py``), which the front makes
and passes with the link: the same batches and acks, through memory, with socket doorbells. No descriptor comes
from a client: the front turned SO_PASSRIGHTS off on the worker's end of every link, and the sandbox's filter
refuses recvmsg on anything but the front's fd channel. A ring's batches are taken
only while the worker holds the turn (else they stay in the ring, which bounds them, and the worker asks for the
turn); after answering one the worker polls the ring briefly for the next, only while it holds an uncontended
turn, so a spin never delays another tenant and never runs a batch without the turn. While its serve loop runs,
the worker's awake word in each ring says it will look at the ring before it blocks, so clients need not ring;
before it blocks it lowers them and looks once more (``rest_rings``), and once more a millisecond later. A link
without a ring is polled the same way after its answer (``spinning``: the serve loop's select does not wait), for as
long as the front said (``AttachLink.spin_us``), and only while the turn is held uncontended.

Nothing a client does (or fails to do) on its link may hold the worker, whose loop serves every session of the
tenant on the device and may hold the tenant's turn, for which other tenants wait: every link's socket is
non-blocking. A frame is read as it arrives into the link's own buffer (bounded by the link's max frame, checked
on the header before its payload is allocated) and runs only once whole; an ack the socket does not take at once
waits in the link's outbox, in order, and goes out when the socket is writable. A link whose frame stays half
sent, or whose outbox does not move, for the link timeout is dropped (the serve loop's select wakes up for that
deadline), as is one whose outbox outgrows its bound (the client does not read its acks).
"""

from __future__ import annotations

import contextlib
import logging
import selectors
import socket
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec

from gpubroker.broker.worker._executor import Executor, Paused
from gpubroker.broker.worker._pacing import Pacer
from gpubroker.broker.worker._ring import RingBroken, RingClosed, WorkerRing
from gpubroker.wire.commands import CODECS, Ack, Batch, Bytes, CommandError, decode_batch, encode, encode_ack_parts
from gpubroker.wire.errors import InvalidArgument, ResourceExhausted
from gpubroker.wire.frames import FRAME_HEADER, FrameDecoder
from gpubroker.wire.link import LINK_VERSION, LinkAccepted, accepted
from gpubroker.wire.ring import MAX_SPIN_US
from gpubroker.wire.worker import (
    CONTROL,
    MAX_LINKS_PER_SESSION,
    FrameClosed,
    FrameTooLarge,
    Grant,
    LeaseToFront,
    LeaseToWorker,
    Released,
    Revoke,
    Want,
    Yield,
)

__all__ = ["CONTROL", "DEFAULT_MAX_FRAME", "MAX_LINKS_PER_SESSION", "Links"]

log = logging.getLogger("gpubroker.worker")

# A client that leaves a frame half sent, or stops taking its acks, loses its link after this long: a deadline the
# serve loop keeps (no read or write ever waits), so meanwhile the worker serves everything else.
_LINK_TIMEOUT = 10.0
# Acks a link's socket has not taken yet wait in its outbox, up to this many of the largest frames (a client's
# window of Reads fits many times over): past it the client is not reading its acks and loses its link.
_OUTBOX_FRAMES = 16
# Buffers handed to one sendmsg when an outbox drains.
_SEND_BUFFERS = 64
# How long the worker runs one ring's batches (and spins for more) before it looks at the front and its other
# links: a "yield" or "revoke" is read this late at most, besides the batch in hand.
_RING_SLICE = 500e-6
# After the worker said its rings may be rung (``rest_rings``, before it blocks), it looks at them again this much
# later: the client rings only a worker that said so (wire/ring.py's awake words), and were that ever missed, a
# batch waits this long, never forever.
_RECHECK = 1e-3
# The largest frame a link takes: a copy chunk (the config's chunk_bytes, 1 MiB unless the front's set_limits
# says otherwise) plus 64 KiB for the batch around it.
DEFAULT_MAX_FRAME = 1024 * 1024 + 64 * 1024


@dataclass(slots=True, eq=False)
class _Link:
    sock: socket.socket
    session: str
    fd: int  # the socket's number, kept (a closed socket has none): the link's key
    waiting: int = 0  # its batches queued for the lease: acks go out in order, so its end waits for them
    ended: bool = False  # no more frames will be read (the client closed, or a malformed frame): drop once answered
    closing: bool = False  # nothing more to answer: dropped once its outbox is out
    ring: WorkerRing | None = None
    # The frame being read, into a buffer ``Links._frame_buffer`` gives it
    frames: FrameDecoder[bytearray | memoryview] = field(
        default_factory=lambda: FrameDecoder(DEFAULT_MAX_FRAME, bytearray))
    started: float = 0.0  # when its first byte came (monotonic)
    # Frames (header and payload apart) the socket has not taken yet, in order, and their bytes.
    outbox: deque[memoryview] = field(default_factory=deque)
    queued: int = 0
    writing: bool = False  # the selector watches it for room (its outbox is not empty)
    progress: float = 0.0  # when the socket last took bytes of a waiting outbox (monotonic)
    codec: str = ""  # what its hello negotiated for Read results ("" none)
    spin: float = 0.0  # seconds the serve loop polls for its next frame after answering one (no ring: ``attach``)

    @property
    def reading(self) -> bool:
        """A frame is half read."""
        return self.frames.reading

    def deadline(self) -> float | None:
        """When this link is dropped if nothing moves (a frame half sent, an outbox not drained), or None."""
        times = [t for t, pending in ((self.started, self.reading), (self.progress, self.writing)) if pending]
        return min(times) + _LINK_TIMEOUT if times else None


@dataclass(slots=True, eq=False)
class _PausedBatch:
    """A link's batch that stopped before a paced command (worker/_pacing.py): it goes on before anything else."""

    link: _Link
    batch: Batch
    progress: Paused


def _refusal(message: str) -> bytes:
    """The Ack for a frame that is no batch: id 0, nothing done, INVALID_ARGUMENT."""
    return encode(Ack(0, 0, CommandError.of(0, "batch", InvalidArgument(message))))


def _ended(exc: RingBroken) -> str:
    """Why a ring ends, for its client and the log: its client closed it (the ordinary end), or it broke."""
    return str(exc) if isinstance(exc, RingClosed) else f"broken ring: {exc}"


class Links:
    """The worker's client links and its lease on the device."""

    def __init__(self, executor: Executor, send_front: Callable[[LeaseToFront], None]) -> None:
        self._executor = executor
        self._send_front = send_front
        self.links: dict[int, _Link] = {}
        self._held: dict[int, _Link] = {}  # links taken but not yet answered, by the front's number (``attach``)
        self._max_frame = DEFAULT_MAX_FRAME
        self._rings: dict[int, _Link] = {}  # by the fd of the ring's commands doorbell
        self._resuming: dict[int, _Link] = {}  # rings to pump again after the serve loop's next look around
        self._timed: dict[int, _Link] = {}  # links that may have a deadline (a half frame, an outbox waiting)
        self._pumped = False  # a ring was served since the last rest_rings
        self._spin_until = 0.0  # the serve loop polls until then (perf_counter) for a link's next frame: ``spinning``
        self._recheck_at: float | None = None  # when rest_rings' look again is due (monotonic)
        # Whether the front has written something not yet read (the serve loop sets it: a zero-timeout poll).
        self.front_waiting: Callable[[], bool] = lambda: False
        self.version = 0  # bumped whenever a link comes or goes, so the serve loop re-reads the set
        self.holding = False  # the front granted this worker the tenant's turn
        self.contended = False  # others wait for the device: give the turn back after each batch
        self._asked = False
        # Batches waiting for the lease, in arrival order; a str is a refusal that must follow its link's batches.
        self._waiting: deque[tuple[_Link, Batch | str]] = deque()
        # While others want the device, link batches are paced, and one may stop for the front's message.
        self._pacer = Pacer.for_backend(executor.backend, lambda: self.front_waiting())
        self._paused: _PausedBatch | None = None

    @property
    def max_frame(self) -> int:
        """The largest frame a link takes (the front's set_limits, at start and on every reload)."""
        return self._max_frame

    @max_frame.setter
    def max_frame(self, value: int) -> None:
        self._max_frame = value
        for link in (*self.links.values(), *self._held.values()):
            link.frames.limit = value  # (the links open now too: their next header is held to it)

    # -- links -------------------------------------------------------------------------------------
    def attach(self, sock: socket.socket, session: str, compress: object = None, held: int | None = None,
               ring: WorkerRing | None = None, spin_us: int = 0) -> None:
        """Serve ``sock`` for ``session``: answer the client's hello, then take its batches. ``compress`` is the
        hello's list of codecs the client takes, in its order of preference (as the front relayed it: unchecked):
        the first this worker knows is the link's, named in the answer; none known, the answer names none.

        With ``held`` (the front's number for it) the link is only taken: neither answered nor read until the
        front says ``serve(held)``, after it has checked that the credential which opened it still holds (this
        worker may have been busy for seconds, a rotation or removal meanwhile); ``close_session`` drops it.
        ``ring``: the link's ring (mapped from what the front made), served once the link is answered.
        ``spin_us``: how long to poll a link without a ring for its next frame after answering one (``spinning``)."""
        links = [link for link in (*self.links.values(), *self._held.values()) if link.session == session]
        if len(links) >= MAX_LINKS_PER_SESSION:
            raise ResourceExhausted(f"this session already has {MAX_LINKS_PER_SESSION} links, the limit")
        if held is not None and held in self._held:
            raise InvalidArgument(f"a link numbered {held} is already held")
        sock.setblocking(False)
        link = _Link(sock, session, sock.fileno(), ring=ring, frames=FrameDecoder(self.max_frame, self._frame_buffer))
        if ring is None and type(spin_us) is int:
            link.spin = max(0, min(spin_us, MAX_SPIN_US)) * 1e-6
        if type(compress) is list:
            link.codec = next((c for c in compress[:16] if type(c) is str and c in CODECS), "")
        if held is not None:
            self._held[held] = link
            return
        self._answer(link)

    def serve(self, held: int, session: str) -> None:
        """Answer and serve the link taken under ``held`` (the front found its credential still valid)."""
        link = self._held.get(held)
        if link is None or link.session != session:
            raise InvalidArgument(f"no link numbered {held} is held (its session ended, or its links were closed)")
        del self._held[held]
        self._answer(link)

    def drop(self, held: int, session: str) -> None:
        """Close the link taken under ``held`` unanswered: the front gave up its hand-off (this worker took too
        long) and refused the client. None held under that number (never taken, or gone with its session): nothing
        to do."""
        link = self._held.get(held)
        if link is not None and link.session == session:
            del self._held[held]
            _end_held(link)

    def _answer(self, link: _Link) -> None:
        self.links[link.fd] = link
        self.version += 1
        if link.ring is not None:
            self._rings[link.ring.bell.fileno()] = link
        if not self._send(link, accepted(LinkAccepted(link=LINK_VERSION, max_frame=self.max_frame,
                                                      compress=link.codec, ring=int(link.ring is not None)))):
            self._drop(link.fd)  # (its ring too)
            raise OSError("the client closed its link before the hello's answer")

    def watch(self) -> dict[int, tuple[socket.socket, int]]:
        """What the serve loop's selector watches: the links to read frames from (not those whose end came) or
        whose outbox waits for room, with the selector's events, and the doorbells of their rings."""
        watch: dict[int, tuple[socket.socket, int]] = {}
        for fd, link in self.links.items():
            events = (0 if link.ended else selectors.EVENT_READ) | (selectors.EVENT_WRITE if link.writing else 0)
            if events:
                watch[fd] = (link.sock, events)
        for fd, link in self._rings.items():
            assert link.ring is not None
            watch[fd] = (link.ring.bell, selectors.EVENT_READ)
        return watch

    # -- deadlines ---------------------------------------------------------------------------------
    def timeout(self) -> float | None:
        """Seconds until the earliest link deadline or the rings' recheck (the serve loop's select waits no
        longer), or None."""
        if not self._timed:
            return None if self._recheck_at is None else max(0.0, self._recheck_at - time.monotonic())
        deadlines = [] if self._recheck_at is None else [self._recheck_at]
        for fd, link in list(self._timed.items()):
            deadline = link.deadline()
            if deadline is None:
                del self._timed[fd]
            else:
                deadlines.append(deadline)
        return max(0.0, min(deadlines) - time.monotonic()) if deadlines else None

    def expire(self) -> None:
        """Drop the links whose half frame or waiting outbox did not move for the link timeout; look at the rings
        again once rest_rings' recheck is due."""
        if self._recheck_at is not None and self._recheck_at <= time.monotonic():
            self._recheck_at = None
            self.look_at_rings()
        if not self._timed:
            return
        now = time.monotonic()
        for fd, link in list(self._timed.items()):
            deadline = link.deadline()
            if deadline is None:
                del self._timed[fd]
            elif deadline <= now:
                log.info("dropping a link of session %s: %s for %.0f s", link.session,
                         "a frame half sent" if link.reading else "its acks not read", _LINK_TIMEOUT)
                self._drop(fd)

    def close_session(self, session: str) -> None:
        for number, link in list(self._held.items()):
            if link.session == session:
                del self._held[number]
                _end_held(link)
        for fd, link in list(self.links.items()):
            if link.session == session:
                self._drop(fd)
        self._waiting = deque(w for w in self._waiting if w[0].session != session)

    def _drop(self, fd: int) -> None:
        link = self.links.pop(fd, None)
        if link is not None:
            self.version += 1
            self._resuming.pop(fd, None)
            if self._paused is not None and self._paused.link is link:
                self._paused = None
            self._timed.pop(fd, None)
            link.outbox.clear()
            if link.ring is not None:
                self._rings.pop(link.ring.bell.fileno(), None)
                link.ring.close()
                link.ring = None
            _end(link.sock)

    # -- the lease ---------------------------------------------------------------------------------
    def on_control(self, message: LeaseToWorker) -> None:
        if isinstance(message, Grant):
            self.holding, self._asked, self.contended = True, False, False
            if self._go_on():
                self._serve_waiting()
                for link in list(self._rings.values()):
                    if self.holding and self._paused is None:
                        self._pump(link)
        elif isinstance(message, Yield):
            self.contended = True
            if self._pacer is not None:
                self._pacer.others_waited()
            if not self._waiting and self._paused is None:
                self._release()
        elif isinstance(message, Revoke):
            self._release()
        if not self.holding and (self._waiting or self._paused is not None or self._rings_pending()):
            self._ask()

    def _serve_waiting(self) -> None:
        """Run the batches that waited for the turn, in order, while it is held (and none stopped)."""
        while self._waiting and self.holding and self._paused is None and not self._executor.fatal:
            link, item = self._waiting.popleft()
            link.waiting -= 1
            self._serve(link, item)

    def _release(self) -> None:
        if self.holding:
            self.holding = False
            self._send_front(Released())

    def _ask(self) -> None:
        if not self._asked:
            self._asked = True
            self._send_front(Want())

    # -- batches -----------------------------------------------------------------------------------
    def readable(self, fd: int) -> None:
        """A frame is arriving on a link: run it now if this worker holds the turn, else queue it and ask."""
        ring_link = self._rings.get(fd)
        if ring_link is not None:
            assert ring_link.ring is not None
            try:
                ring_link.ring.drain()  # then look: a batch published after this rings again
            except RingBroken as exc:
                self._end_ring(ring_link, _ended(exc))
                return
            self._pump(ring_link)
            return
        link = self.links.get(fd)
        if link is None:
            return
        if link.ring is not None:  # a ring's link carries nothing more: its close (or anything) ends the ring
            self._drop(fd)
            return
        item: Batch | str
        try:
            payload = self._receive(link)
            if payload is None:
                return  # the rest of the frame is still on its way
            item = decode_batch(payload)
        except (FrameClosed, OSError):  # the client's end (a half frame with it): nothing to answer
            self._end(fd, link)
            return
        except FrameTooLarge as exc:
            item = f"a frame of {exc.length} bytes, over the link's limit of {exc.limit}"
        except msgspec.DecodeError as exc:  # (ValidationError too) a frame that is no batch
            item = f"malformed batch: {exc}"
        if type(item) is str:  # what follows a bad frame cannot be framed: answer it, read no more
            if link.waiting:
                self._queue(link, item)  # after the batches before it
                self._end(fd, link)
            else:
                self._serve(link, item)
                self._finish(link)
            return
        if not self.holding or self._waiting or self._paused is not None:
            self._queue(link, item)
            return
        self._serve(link, item)
        if self.contended and self._paused is None:
            self._release()  # others wait: each batch is one turn, as it would be through the front
        elif link.spin and self.holding:
            # A synchronous client's next batch is usually a few microseconds behind its answer: the serve loop
            # polls for it a while (a wake-up from a blocking poll goes through the hypervisor in a VM), while
            # the turn is held and nobody else wants it, as a ring's pump does.
            self._spin_until = time.perf_counter() + link.spin

    def spinning(self) -> bool:
        """Whether the serve loop polls (select without waiting) for a link's next frame, rather than blocking:
        for a link's spin after its answer, while this worker holds an uncontended turn."""
        if self._spin_until:
            if self.holding and not self.contended and time.perf_counter() < self._spin_until:
                return True
            self._spin_until = 0.0
        return False

    def writable(self, fd: int) -> None:
        """A link's socket has room for its waiting outbox."""
        link = self.links.get(fd)
        if link is not None and not self._flush(link):
            self._drop(fd)

    def _frame_buffer(self, size: int) -> bytearray | memoryview:
        """Where a link's next frame lands: the executor's host buffer (page-locked on CUDA: a Write's chunk then
        goes to the device in one DMA, as it is decoded as a view of its frame) while this worker holds the turn and
        no batch waits, so the frame most likely runs as soon as it is whole and gives its buffer back; plain memory
        for one that would wait in the queue (which page-locked memory must not grow)."""
        if self.holding and not self._waiting and self._paused is None:
            return self._executor.host_buffer(size)
        return bytearray(size)

    def _receive(self, link: _Link) -> bytearray | memoryview | None:
        """Read what the link's socket holds of its next frame, never waiting for more: the payload once whole,
        else None. FrameClosed at the client's end, FrameTooLarge (before the payload is read) past the max frame.
        A plain recv: it takes no descriptor (nor could a recvmsg here, in a sandbox: sandbox/_seccomp.py)."""
        sock, frames = link.sock, link.frames
        while True:
            view = frames.buffer()  # (never past the frame's end: the next frame's bytes stay in the socket)
            first = not frames.reading  # (the frame's first bytes come now)
            try:
                n = sock.recv_into(view)
            except (BlockingIOError, InterruptedError):
                if link.reading:  # half a frame: the rest has the link timeout (from its first byte) to come
                    self._timed[link.fd] = link
                return None
            if n == 0:
                raise FrameClosed("peer closed the connection")
            if first:
                link.started = time.monotonic()
            payload = frames.advance(n)  # (FrameTooLarge past the max frame, from its header)
            if payload is not None:
                return payload
            # Else the rest of the header or payload: most likely not there yet (the next read says so).

    def _send(self, link: _Link, payload: bytes, tail: Bytes = b"") -> bool:
        """Queue one frame (``payload``, then ``tail``) on the link's outbox and send what its socket takes now;
        False when the link must be dropped (its socket failed, or its outbox outgrew its bound: the client does
        not read its acks)."""
        was_empty = not link.outbox
        size = len(payload) + len(tail)
        link.outbox.append(memoryview(FRAME_HEADER.pack(size)))
        link.outbox.append(memoryview(payload))
        if tail:
            link.outbox.append(memoryview(tail))
        link.queued += FRAME_HEADER.size + size
        if was_empty and not self._flush(link):
            return False
        if link.queued > _OUTBOX_FRAMES * self.max_frame:
            log.info("dropping a link of session %s: %d bytes of acks not read", link.session, link.queued)
            return False
        return True

    def _flush(self, link: _Link) -> bool:
        """Send what the link's socket takes of its outbox; False when the socket failed. Keeps the selector's
        interest in room (and the link's deadline) in step; a closing link is dropped once its outbox is out."""
        outbox = link.outbox
        while outbox:
            buffers = [outbox[k] for k in range(min(len(outbox), _SEND_BUFFERS))]
            try:
                sent = link.sock.sendmsg(buffers)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                return False
            link.queued -= sent
            if link.writing:
                link.progress = time.monotonic()
            while sent:
                head = outbox[0]
                if sent >= len(head):
                    sent -= len(head)
                    outbox.popleft()
                else:
                    outbox[0] = head[sent:]
                    sent = 0
        if outbox and not link.writing:
            link.writing, link.progress = True, time.monotonic()
            self._timed[link.fd] = link
            self.version += 1
        elif not outbox and link.writing:
            link.writing = False
            self.version += 1
        if not outbox and link.closing:
            self._drop(link.fd)
        return True

    def _finish(self, link: _Link) -> None:
        """Nothing more to answer on this link: close it once its outbox is out."""
        if self.links.get(link.fd) is not link:
            return
        if link.outbox:
            link.closing, link.ended = True, True
            self.version += 1
        else:
            self._drop(link.fd)

    # -- rings -------------------------------------------------------------------------------------
    @property
    def resuming(self) -> bool:
        """Rings whose batches were cut off by their time slice, or a paced batch that stopped for the front's
        message while the turn is held: the serve loop polls, then calls ``resume``."""
        return bool(self._resuming) or (self._paused is not None and self.holding)

    def resume(self) -> None:
        if not self._go_on():
            return
        self._serve_waiting()  # (what came on socket links while a batch was stopped)
        resuming, self._resuming = self._resuming, {}
        for link in resuming.values():
            if link.ring is not None:
                self._pump(link)

    def rest_rings(self) -> None:
        """The serve loop is about to block: every ring's client rings from now on; a batch published before
        that is found here (the ring is resumed, or the turn asked for), and once more _RECHECK later."""
        for link in self._rings.values():
            assert link.ring is not None
            link.ring.rest()
        self.look_at_rings()
        if self._pumped:
            self._pumped = False
            self._recheck_at = time.monotonic() + _RECHECK

    def wake_rings(self) -> None:
        """The serve loop is running: it looks at every ring before it blocks again (rest_rings), so clients
        need not ring."""
        for link in self._rings.values():
            assert link.ring is not None
            link.ring.awake()

    def look_at_rings(self) -> None:
        """A batch waiting in a ring is resumed (or the turn asked for): while the serve loop polls, ring clients
        do not ring."""
        for fd, link in self._rings.items():
            assert link.ring is not None
            if link.ring.commands.ready():
                if self.holding:
                    self._resuming[fd] = link
                else:
                    self._ask()  # (every ring is pumped at the grant)

    def _rings_pending(self) -> bool:
        return any(link.ring is not None and link.ring.commands.ready() for link in self._rings.values())

    def _pump(self, link: _Link) -> None:
        """Run the ring's batches while this worker holds the turn; once one is answered, poll briefly for the
        next (an uncontended turn only). Without the turn they stay in the ring: ask for it."""
        ring, fd = link.ring, link.fd
        assert ring is not None
        if self._paused is not None:  # a batch that stopped goes on first (``resume``, or the grant)
            if self.holding:
                self._resuming[fd] = link
            else:
                self._ask()
            return
        served = False
        self._pumped = True
        end = time.perf_counter() + _RING_SLICE
        while self.links.get(fd) is link and not self._executor.fatal:
            if time.perf_counter() > end:
                # The front (a yield, a revoke) and the other links get their turn in the serve loop, which
                # comes back here (``resume``): nothing waits on this ring's doorbell, already drained.
                self._resuming[fd] = link
                return
            if not self.holding:
                if ring.commands.ready():
                    self._ask()
                return
            try:
                payload = ring.commands.get()
                if payload is None:
                    if served and not self.contended and ring.spin():
                        continue
                    ring.drain()
                    if ring.commands.ready():
                        continue
                    return
                try:
                    batch = decode_batch(payload)
                except msgspec.DecodeError as exc:  # (ValidationError too): as a malformed frame on a link
                    self._end_ring(link, f"malformed batch: {exc}")
                    return
            except RingBroken as exc:
                self._end_ring(link, _ended(exc))
                return
            if not self._run_batch(link, batch):
                return  # stopped for the front's message: the serve loop reads it, then goes on (``resume``)
            if self.links.get(fd) is not link:
                return
            served = True
            if self.contended:
                self._release()  # others wait: each batch is one turn; what is left waits for the next grant
                if ring.commands.ready():
                    self._ask()
                return
            if self.front_waiting():
                # A "yield" may be in it (sent just after the grant): read before another batch runs, as a
                # link's next frame would be. (One poll per batch.)
                self._resuming[fd] = link
                return

    def _end_ring(self, link: _Link, message: str) -> None:
        """A ring that cannot go on: its client is told why (when its ack ring takes it), then the link closes."""
        assert link.ring is not None
        log.info("closing a ring of session %s: %s", link.session, message)
        try:
            link.ring.answer(_refusal(message[:1024]))
        except RingBroken:
            pass
        self._drop(link.fd)

    def _queue(self, link: _Link, item: Batch | str) -> None:
        link.waiting += 1
        self._waiting.append((link, item))
        self._ask()

    def _end(self, fd: int, link: _Link) -> None:
        """No more frames from this link: drop it now, or once the batches it sent before are answered."""
        link.frames.reset()  # (a half frame ends here: nothing more comes)
        if link.waiting:
            link.ended = True
            self.version += 1
        else:
            self._finish(link)

    def _serve(self, link: _Link, item: Batch | str) -> None:
        """Answer one batch (run it) or refusal (Ack id 0); drop the link after its last answer or a failed send."""
        if self.links.get(link.fd) is not link:
            return  # dropped while its batch waited
        if type(item) is str:
            self._answer_link(link, _refusal(item[:1024]))
        else:
            assert isinstance(item, Batch)
            self._run_batch(link, item)

    def _run_batch(self, link: _Link, batch: Batch, resume: Paused | None = None) -> bool:
        """Run (or go on with) one of a link's batches and answer it, on its ring or its socket; False when it
        stopped for the front's message (``_paused``: it goes on first, at ``resume`` or the next grant)."""
        # (a ring's Read results stay raw: nothing to gain from compressing through memory)
        outcome = self._executor.run_link(link.session, batch, "" if link.ring is not None else link.codec, resume,
                                          self._pacer)
        if isinstance(outcome, Paused):
            link.waiting += 1  # (its link's end waits for its answer, as for a queued batch)
            self._paused = _PausedBatch(link, batch, outcome)
            return False
        if link.ring is None:
            self._answer_link(link, *encode_ack_parts(outcome))  # (a Read's bytes sent as they are, not copied)
        else:
            try:
                link.ring.answer(encode(outcome))
            except RingBroken as exc:
                self._end_ring(link, _ended(exc))
        self._executor.answered()  # (while the client reads its answer)
        return True

    def _answer_link(self, link: _Link, payload: bytes, tail: Bytes = b"") -> None:
        """Send one answer (``payload`` then ``tail``: one frame) on a link's socket; drop the link after its last
        answer or a failed send."""
        if not self._send(link, payload, tail):
            self._drop(link.fd)
        elif link.ended and not link.waiting:
            self._finish(link)

    def _go_on(self) -> bool:
        """Go on with the batch that stopped for the front's message, while the turn is held; whether none is left
        stopped (False: it stopped again, or waits for the turn)."""
        paused = self._paused
        if paused is None:
            return True
        if not self.holding or self._executor.fatal or self.front_waiting():
            return False  # (the front's message first: the batch stopped for it, and it may be a revoke)
        self._paused = None
        link = paused.link
        link.waiting -= 1
        if self.links.get(link.fd) is not link:
            return True  # dropped meanwhile
        if not self._run_batch(link, paused.batch, paused.progress):
            return False
        if link.ring is not None and self.links.get(link.fd) is link:
            self._resuming[link.fd] = link  # its ring's next batches, in turn
        if self.contended:
            self._release()  # others wait: each batch is one turn
        return True


def _end(sock: socket.socket) -> None:
    """Close a link's socket, shut first: the front keeps a copy of every link it hands over (to end every copy
    of it when this worker ends, front/_handed.py), so a close alone would leave the client's end open."""
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    sock.close()


def _end_held(link: _Link) -> None:
    """Close a link that was taken but never answered, and its ring."""
    if link.ring is not None:
        link.ring.close()
        link.ring = None
    _end(link.sock)
