"""The front's one accept loop: every raw listener of the broker (the gRPC gate's Unix and TCP listeners, the
link's ``<socket>.fast``, vsock and TCP ports, the vsock relay to gRPC) accepts through an `Acceptor`.

An acceptor takes what its listening socket has queued in batches, then lets the loop serve what it accepted
before taking more; each connection goes to the listener's ``admit`` with its `Peer` (who is at the other end, in
the same terms whichever the scheme), which counts it, refuses it or serves it.
Out of descriptors or memory (EMFILE, ENFILE, ENOBUFS, ENOMEM) it stops accepting for a moment, doubling while that
lasts, rather than spinning on a listener it cannot serve: connections wait in the backlog meanwhile (or the
kernel refuses them once it is full). A connection that is gone before it was taken (ECONNABORTED, EPROTO, EPERM)
is skipped; any other failure ends the listener, with a log line saying so.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

from gpubroker.broker.front.auth import RateLimitedLog, peer_credentials
from gpubroker.wire.addresses import TcpAddress, VsockAddress

__all__ = ["ACCEPT_BACKOFF", "ACCEPT_BACKOFF_MAX", "ACCEPT_BATCH", "Acceptor", "Admit", "Peer", "out_of_descriptors",
           "peer_of"]

log = logging.getLogger("gpubroker.server")
audit = logging.getLogger("gpubroker.audit")

# Connections accepted per wakeup of a listener: then the loop serves what it accepted before accepting more.
ACCEPT_BATCH: Final = 64
# Out of descriptors: the acceptor stops accepting for this long, doubling while it lasts (up to the most).
ACCEPT_BACKOFF: Final = 0.05
ACCEPT_BACKOFF_MAX: Final = 1.0
_OUT_OF_DESCRIPTORS: Final = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
_GONE: Final = (errno.ECONNABORTED, errno.EPROTO, errno.EPERM)



@dataclass(frozen=True)
class Peer:
    """Who is at the other end of an accepted connection, as far as the kernel tells: on a Unix socket the peer
    process's pid and uid (SO_PEERCRED, which a peer cannot forge; -1 if unknown) and no address; on TCP and vsock
    its address (pid and uid -1: a remote peer's are unknown here, a local TCP peer's owner is the gRPC gate's
    own lookup)."""

    pid: int
    uid: int
    address: TcpAddress | VsockAddress | None
    accepted: Any  # the address as accept() gave it, as audit lines show it

    @property
    def host(self) -> str:
        """A TCP peer's host, a vsock peer's CID ("" on a Unix socket)."""
        if isinstance(self.address, TcpAddress):
            return self.address.host
        return str(self.address.cid) if self.address is not None else ""


def peer_of(conn: socket.socket, accepted: Any) -> Peer:
    """The `Peer` of ``conn``, which accept() returned with the address ``accepted``."""
    if conn.family == socket.AF_UNIX:
        pid, uid = peer_credentials(conn)
        return Peer(pid, uid, None, accepted)
    if conn.family == getattr(socket, "AF_VSOCK", None):
        return Peer(-1, -1, VsockAddress(int(accepted[0]), int(accepted[1])), accepted)
    return Peer(-1, -1, TcpAddress(str(accepted[0]), int(accepted[1])), accepted)


# (the accepted socket, its peer) -> whether to go on accepting now (False: the admitter ran out of descriptors
# itself and called `Acceptor.back_off`).
Admit = Callable[[socket.socket, Peer], bool]

_audit = RateLimitedLog(audit)


def out_of_descriptors(exc: OSError) -> bool:
    """Whether ``exc`` says the process (or host) is out of descriptors or memory: a moment later may do."""
    return exc.errno in _OUT_OF_DESCRIPTORS


class Acceptor:
    """Accepts on one listening socket (non-blocking from here on), on the loop `start` is given.

    ``name``: the listener as audit lines name it; ``kind``: which listener family it is (``grpc``, ``link``,
    ``relay``), the rate-limited audit line's kind."""

    def __init__(self, sock: socket.socket, name: str, admit: Admit, kind: str) -> None:
        self.sock, self.name, self.kind = sock, name, kind
        self._admit = admit
        self.failures = 0  # accept() out of descriptors (or memory): each time, the acceptor backs off
        self.backoff = 0.0
        self.closed = False
        self._loop: asyncio.AbstractEventLoop | None = None
        sock.setblocking(False)

    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Accept on ``loop`` (the running one by default), from its thread."""
        self._loop = loop or asyncio.get_running_loop()
        self._loop.add_reader(self.sock.fileno(), self._accept)

    def close(self) -> None:
        """Stop accepting and close the listening socket (on the loop's thread, once started)."""
        if self.closed:
            return
        self.closed = True
        if self._loop is not None and self.sock.fileno() >= 0:
            self._loop.remove_reader(self.sock.fileno())
        self.sock.close()

    def back_off(self, exc: OSError) -> None:
        """Out of descriptors (or memory): accept nothing for a moment; connections wait in the backlog."""
        assert self._loop is not None
        self.backoff = min(ACCEPT_BACKOFF_MAX, max(ACCEPT_BACKOFF, self.backoff * 2))
        _audit.warning(f"{self.kind} accept", "action=pause-accept listener=%s reason=accept failed (%s): accepting "
                       "again in %.2f s (connections wait in the backlog)", self.name, exc.strerror, self.backoff)
        self._loop.remove_reader(self.sock.fileno())
        self._loop.call_later(self.backoff, self._resume)

    def _resume(self) -> None:
        if not self.closed and self.sock.fileno() >= 0:
            assert self._loop is not None
            self._loop.add_reader(self.sock.fileno(), self._accept)

    def _accept(self) -> None:
        for _ in range(ACCEPT_BATCH):
            try:
                conn, address = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if out_of_descriptors(exc):
                    self.failures += 1
                    self.back_off(exc)
                    return
                if exc.errno in _GONE:
                    continue  # (that connection is gone; the next one may be fine)
                log.error("%s listener %s: accept failed, no longer accepting: %s", self.kind, self.name, exc)
                assert self._loop is not None
                self._loop.remove_reader(self.sock.fileno())
                return
            self.backoff = 0.0
            try:
                conn.setblocking(False)  # (as asyncio's sock_accept leaves it: every admitter serves it on a loop)
                if not self._admit(conn, peer_of(conn, address)):
                    return
            except Exception as exc:  # one connection's failure must not stop the listener
                conn.close()
                log.error("%s listener %s: admitting a connection failed: %r", self.kind, self.name, exc)
