"""Links: a client's framed connection served by its worker directly, with no hop through the front.

The front authenticates a link's hello (on ``<socket>.fast``, TCP behind the front's TLS, or vsock), then hands
the connection to the session's worker (``attach_link``), which answers the hello itself
(``[0, 0, {"link": 1, "max_frame": n}]``, a msgpack frame). From then on every client frame's payload is an
encoded protocol Batch, answered by one frame holding its encoded Ack, in order. Only link commands may come this
way (a module load goes through the front, which bounds its compile time); a malformed frame is answered by an
Ack with id 0 and its error, then the link is closed.

Device work needs the tenant's turn on the device, which only the front's scheduler gives: the worker asks for a
lease (``want``), runs link batches while it holds one, and hands it back when the front revokes it (another
tenant's turn, or the scheduler's periodic accounting). While others wait, each batch is one turn.

On the same host the client may upgrade its link, in the link's first frame, to a shared-memory ring
(``_ring.py``): the same batches and acks, through memory, with socket doorbells. A ring's batches are taken
only while the worker holds the turn (else they stay in the ring, which bounds them, and the worker asks for the
turn); after answering one the worker polls the ring briefly for the next, only while it holds an uncontended
turn, so a spin never delays another tenant and never runs a batch without the turn.
"""

from __future__ import annotations

import logging
import socket
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec

from gpubroker.client import GpuBrokerError, InvalidArgument, ResourceExhausted
from gpubroker.client._protocol import Ack, Batch, CommandError, decode_batch, encode

from ._executor import Executor
from ._frames import FrameClosed, FrameTooLarge, recv_payload, send_frame, send_payload, unpack_frame
from ._ring import RingBroken, WorkerRing, open_ring, recv_payload_fds

__all__ = ["CONTROL", "DEFAULT_MAX_FRAME", "MAX_LINKS_PER_SESSION", "Links"]

log = logging.getLogger("gpubroker.worker")

# The request id of lease messages between the front and the worker (replies to requests have ids >= 1).
CONTROL = -1
# A client that stops reading its acks, or sends half a frame, loses its link after this long.
_LINK_TIMEOUT = 10.0
# Each link is served in order, one batch at a time; past this many, new links stay with the front.
MAX_LINKS_PER_SESSION = 8
# How long the worker runs one ring's batches (and spins for more) before it looks at the front and its other
# links: a "yield" or "revoke" is read this late at most, besides the batch in hand.
_RING_SLICE = 500e-6
# The largest frame a link takes: a copy chunk (the config's chunk_bytes, 1 MiB unless the front's set_limits
# says otherwise) plus 64 KiB for the batch around it.
DEFAULT_MAX_FRAME = 1024 * 1024 + 64 * 1024


@dataclass(slots=True)
class _Link:
    sock: socket.socket
    session: str
    waiting: int = 0  # its batches queued for the lease: acks go out in order, so its end waits for them
    ended: bool = False  # no more frames will be read (the client closed, or a malformed frame): drop once answered
    fresh: bool = True  # no frame read yet: the first may be a ring upgrade (with fds attached)
    ring: WorkerRing | None = None


def _refusal(message: str) -> bytes:
    """The Ack for a frame that is no batch: id 0, nothing done, INVALID_ARGUMENT."""
    return encode(Ack(0, 0, CommandError(0, "batch", InvalidArgument.code, message, InvalidArgument.__name__)))


class Links:
    """The worker's client links and its lease on the device."""

    def __init__(self, executor: Executor, send_front: Callable[[list[Any]], None]) -> None:
        self._executor = executor
        self._send_front = send_front
        self.max_frame = DEFAULT_MAX_FRAME
        self.links: dict[int, _Link] = {}
        self._rings: dict[int, _Link] = {}  # by the fd of the ring's commands doorbell
        self._resuming: dict[int, _Link] = {}  # rings to pump again after the serve loop's next look around
        # Whether the front has written something not yet read (the serve loop sets it: a zero-timeout poll).
        self.front_waiting: Callable[[], bool] = lambda: False
        self.version = 0  # bumped whenever a link comes or goes, so the serve loop re-reads the set
        self.holding = False  # the front granted this worker the tenant's turn
        self.contended = False  # others wait for the device: give the turn back after each batch
        self._asked = False
        # Batches waiting for the lease, in arrival order; a str is a refusal that must follow its link's batches.
        self._waiting: deque[tuple[_Link, Batch | str]] = deque()

    # -- links -------------------------------------------------------------------------------------
    def attach(self, sock: socket.socket, session: str) -> None:
        """Serve ``sock`` for ``session``: answer the client's hello, then take its batches."""
        if sum(1 for link in self.links.values() if link.session == session) >= MAX_LINKS_PER_SESSION:
            raise ResourceExhausted(f"this session already has {MAX_LINKS_PER_SESSION} links, the limit")
        sock.settimeout(_LINK_TIMEOUT)
        send_frame(sock, [0, 0, {"link": 1, "max_frame": self.max_frame}])
        self.links[sock.fileno()] = _Link(sock, session)
        self.version += 1

    def readers(self) -> dict[int, socket.socket]:
        """The links to read frames from (not those whose end came while batches of theirs still wait), and the
        doorbells of their rings."""
        readers: dict[int, socket.socket] = {
            fd: link.sock for fd, link in self.links.items() if not link.ended}
        for fd, link in self._rings.items():
            assert link.ring is not None
            readers[fd] = link.ring.bell
        return readers

    def close_session(self, session: str) -> None:
        for fd, link in list(self.links.items()):
            if link.session == session:
                self._drop(fd)
        self._waiting = deque(w for w in self._waiting if w[0].session != session)

    def _drop(self, fd: int) -> None:
        link = self.links.pop(fd, None)
        if link is not None:
            self.version += 1
            self._resuming.pop(fd, None)
            if link.ring is not None:
                self._rings.pop(link.ring.bell.fileno(), None)
                link.ring.close()
                link.ring = None
            link.sock.close()

    # -- the lease ---------------------------------------------------------------------------------
    def on_control(self, op: str) -> None:
        if op == "grant":
            self.holding, self._asked, self.contended = True, False, False
            while self._waiting and self.holding and not self._executor.fatal:
                link, item = self._waiting.popleft()
                link.waiting -= 1
                self._serve(link, item)
            for link in list(self._rings.values()):
                if self.holding:
                    self._pump(link)
        elif op == "yield":
            self.contended = True
            if not self._waiting:
                self._release()
        elif op == "revoke":
            self._release()
        if not self.holding and (self._waiting or self._rings_pending()):
            self._ask()

    def _release(self) -> None:
        if self.holding:
            self.holding = False
            self._send_front([CONTROL, "released", None])

    def _ask(self) -> None:
        if not self._asked:
            self._asked = True
            self._send_front([CONTROL, "want", None])

    # -- batches -----------------------------------------------------------------------------------
    def readable(self, fd: int) -> None:
        """A frame is arriving on a link: run it now if this worker holds the turn, else queue it and ask."""
        ring_link = self._rings.get(fd)
        if ring_link is not None:
            assert ring_link.ring is not None
            try:
                ring_link.ring.drain()  # then look: a batch published after this rings again
            except RingBroken as exc:
                self._end_ring(ring_link, f"broken ring: {exc}")
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
            if link.fresh:
                link.fresh = False
                payload, fds = recv_payload_fds(link.sock, self.max_frame)
                if fds:
                    self._upgrade(link, payload, fds)
                    return
            else:
                payload = recv_payload(link.sock, self.max_frame)
            item = decode_batch(payload)
        except (FrameClosed, OSError):  # the client's end (or a half frame past the timeout): nothing to answer
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
                self._drop(fd)
            return
        if not self.holding or self._waiting:
            self._queue(link, item)
            return
        self._serve(link, item)
        if self.contended:
            self._release()  # others wait: each batch is one turn, as it would be through the front

    # -- rings -------------------------------------------------------------------------------------
    def _upgrade(self, link: _Link, payload: bytearray, fds: list[int]) -> None:
        """Map the ring the client offers in its link's first frame and answer on the link; a refusal leaves
        a plain link."""
        try:
            try:
                request = unpack_frame(payload)
            except Exception:  # (any of msgpack's errors)
                request = None
            ring = open_ring(request, fds, self.max_frame)
        except GpuBrokerError as exc:
            reply = [0, 1, exc.to_wire()]
        except OSError as exc:
            reply = [0, 1, InvalidArgument(f"the ring could not be mapped: {exc}").to_wire()]
        else:
            link.ring = ring
            self._rings[ring.bell.fileno()] = link
            self.version += 1
            reply = [0, 0, {"ring": 1}]
        try:
            send_frame(link.sock, reply)
        except OSError:
            self._drop(link.sock.fileno())

    @property
    def resuming(self) -> bool:
        """Rings whose batches were cut off by their time slice: the serve loop polls, then calls ``resume``."""
        return bool(self._resuming)

    def resume(self) -> None:
        resuming, self._resuming = self._resuming, {}
        for link in resuming.values():
            if link.ring is not None:
                self._pump(link)

    def _rings_pending(self) -> bool:
        return any(link.ring is not None and link.ring.commands.ready() for link in self._rings.values())

    def _pump(self, link: _Link) -> None:
        """Run the ring's batches while this worker holds the turn; once one is answered, poll briefly for the
        next (an uncontended turn only). Without the turn they stay in the ring: ask for it."""
        ring, fd = link.ring, link.sock.fileno()
        assert ring is not None
        served = False
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
                    ack = encode(self._executor.run(link.session, decode_batch(payload), link=True))
                except msgspec.DecodeError as exc:  # (ValidationError too): as a malformed frame on a link
                    self._end_ring(link, f"malformed batch: {exc}")
                    return
                ring.answer(ack)
            except RingBroken as exc:
                self._end_ring(link, f"broken ring: {exc}")
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
        self._drop(link.sock.fileno())

    def _queue(self, link: _Link, item: Batch | str) -> None:
        link.waiting += 1
        self._waiting.append((link, item))
        self._ask()

    def _end(self, fd: int, link: _Link) -> None:
        """No more frames from this link: drop it now, or once the batches it sent before are answered."""
        if link.waiting:
            link.ended = True
            self.version += 1
        else:
            self._drop(fd)

    def _serve(self, link: _Link, item: Batch | str) -> None:
        """Answer one batch (run it) or refusal (Ack id 0); drop the link after its last answer or a failed send."""
        fd = link.sock.fileno()
        if self.links.get(fd) is not link:
            return  # dropped while its batch waited
        if type(item) is str:
            payload = _refusal(item[:1024])
        else:
            assert isinstance(item, Batch)
            payload = encode(self._executor.run(link.session, item, link=True))
        try:
            send_payload(link.sock, payload)
        except OSError:
            self._drop(fd)
            return
        if link.ended and not link.waiting:
            self._drop(fd)
