"""The front's one accept loop: every raw listener of the broker (the gRPC gate's Unix and TCP listeners, the
link's ``<socket>.fast``, vsock and TCP ports, the vsock relay to gRPC) accepts through an `Acceptor`.

An acceptor takes what its listening socket has queued in batches, then lets the loop serve what it accepted
before taking more; each connection goes to the listener's ``admit`` (which counts it, refuses it or serves it).
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
from typing import Any, Final

from gpubroker.broker.front.auth import RateLimitedLog

__all__ = ["ACCEPT_BACKOFF", "ACCEPT_BACKOFF_MAX", "ACCEPT_BATCH", "Acceptor", "Admit", "out_of_descriptors"]

log = logging.getLogger("gpubroker.server")
audit = logging.getLogger("gpubroker.audit")

# Connections accepted per wakeup of a listener: then the loop serves what it accepted before accepting more.
ACCEPT_BATCH: Final = 64
# Out of descriptors: the acceptor stops accepting for this long, doubling while it lasts (up to the most).
ACCEPT_BACKOFF: Final = 0.05
ACCEPT_BACKOFF_MAX: Final = 1.0
_OUT_OF_DESCRIPTORS: Final = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
_GONE: Final = (errno.ECONNABORTED, errno.EPROTO, errno.EPERM)

# (the accepted socket, the address accept returned) -> whether to go on accepting now (False: the admitter ran
# out of descriptors itself and called `Acceptor.back_off`).
Admit = Callable[[socket.socket, Any], bool]

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
                if not self._admit(conn, address):
                    return
            except Exception as exc:  # one connection's failure must not stop the listener
                conn.close()
                log.error("%s listener %s: admitting a connection failed: %r", self.kind, self.name, exc)
