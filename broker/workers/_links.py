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
        self._waiting: deque[tuple[_Link, Batch]] = deque()

    # -- links -------------------------------------------------------------------------------------
    def attach(self, sock: socket.socket, session: str) -> None:
        """Serve ``sock`` for ``session``: answer the client's hello, then take its batches."""
        if sum(1 for link in self.links.values() if link.session == session) >= MAX_LINKS_PER_SESSION:
            raise ResourceExhausted(f"this session already has {MAX_LINKS_PER_SESSION} links, the limit")
        sock.settimeout(_LINK_TIMEOUT)
        send_frame(sock, [0, 0, {"link": 1, "max_frame": self.max_frame}])
        self.links[sock.fileno()] = _Link(sock, session)
        self.version += 1

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
                link, batch = self._waiting.popleft()
                self._serve(link, batch)
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
        try:
            payload = recv_payload(link.sock, self.max_frame)
            batch = decode_batch(payload)
        except (FrameClosed, OSError):
            self._drop(fd)
            return
        except FrameTooLarge as exc:
            self._refuse(link, f"a frame of {exc.length} bytes, over the link's limit of {exc.limit}")
            return
        except msgspec.DecodeError as exc:  # (ValidationError too) a frame that is no batch
            self._refuse(link, f"malformed batch: {exc}")
            return
        if not self.holding or self._waiting:
            self._waiting.append((link, batch))
            self._ask()
            return
        self._serve(link, batch)
        if self.contended:
            self._release()  # others wait: each batch is one turn, as it would be through the front

    def _refuse(self, link: _Link, message: str) -> None:
        """Answer a malformed frame with Ack id 0, then close the link: what follows cannot be framed."""
        try:
            send_payload(link.sock, _refusal(message[:1024]))
        except OSError:
            pass
        self._drop(link.sock.fileno())

    def _serve(self, link: _Link, batch: Batch) -> None:
        if link.sock.fileno() not in self.links:
            return  # dropped while its batch waited
        ack = self._executor.run(link.session, batch, link=True)
        try:
            send_payload(link.sock, encode(ack))
        except OSError:
            self._drop(link.sock.fileno())
