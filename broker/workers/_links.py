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
"""

from __future__ import annotations

import logging
import socket
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec

from gpubroker.client import InvalidArgument, ResourceExhausted
from gpubroker.client._protocol import Ack, Batch, CommandError, decode_batch, encode

from ._executor import Executor
from ._frames import FrameClosed, FrameTooLarge, recv_payload, send_frame, send_payload

__all__ = ["CONTROL", "DEFAULT_MAX_FRAME", "MAX_LINKS_PER_SESSION", "Links"]

log = logging.getLogger("gpubroker.worker")

# The request id of lease messages between the front and the worker (replies to requests have ids >= 1).
CONTROL = -1
# A client that stops reading its acks, or sends half a frame, loses its link after this long.
_LINK_TIMEOUT = 10.0
# Each link is served in order, one batch at a time; past this many, new links stay with the front.
MAX_LINKS_PER_SESSION = 8
# The largest frame a link takes: a copy chunk (the config's chunk_bytes, 1 MiB unless the front's set_limits
# says otherwise) plus 64 KiB for the batch around it.
DEFAULT_MAX_FRAME = 1024 * 1024 + 64 * 1024


@dataclass(slots=True)
class _Link:
    sock: socket.socket
    session: str
    waiting: int = 0  # its batches queued for the lease: acks go out in order, so its end waits for them
    ended: bool = False  # no more frames will be read (the client closed, or a malformed frame): drop once answered


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
        """The links to read frames from (not those whose end came while batches of theirs still wait)."""
        return {fd: link.sock for fd, link in self.links.items() if not link.ended}

    def close_session(self, session: str) -> None:
        for fd, link in list(self.links.items()):
            if link.session == session:
                self._drop(fd)
        self._waiting = deque(w for w in self._waiting if w[0].session != session)

    def _drop(self, fd: int) -> None:
        link = self.links.pop(fd, None)
        if link is not None:
            self.version += 1
            link.sock.close()

    # -- the lease ---------------------------------------------------------------------------------
    def on_control(self, op: str) -> None:
        if op == "grant":
            self.holding, self._asked, self.contended = True, False, False
            while self._waiting and self.holding and not self._executor.fatal:
                link, item = self._waiting.popleft()
                link.waiting -= 1
                self._serve(link, item)
        elif op == "yield":
            self.contended = True
            if not self._waiting:
                self._release()
        elif op == "revoke":
            self._release()
        if self._waiting and not self.holding:
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
        link = self.links.get(fd)
        if link is None:
            return
        item: Batch | str
        try:
            item = decode_batch(recv_payload(link.sock, self.max_frame))
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
