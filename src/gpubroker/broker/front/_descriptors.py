"""Descriptors sent to the front (SCM_RIGHTS): refused where none is expected, never closed on the event loop.

The last close of a descriptor can block for as long as whoever made it likes: a TCP socket with unsent data and
``SO_LINGER`` waits for its peer's acknowledgement, a file on a FUSE mount for the FUSE daemon. Any process that can
connect to one of the front's Unix sockets could send one along with a byte, close its own copy, and leave the
front holding the last reference: closed by the front, or by the kernel discarding what a plain ``recv`` did not
take (in the receiving thread), it would stop the event loop, and every tenant with it.

So every Unix socket the front listens on refuses descriptors (``SO_PASSRIGHTS`` = 0, Linux >= 6.16: inherited
by the connections it accepts, checked as the peer sends, whose ``sendmsg`` fails with EPERM); a ``.fast``
connection takes them only once its hello has authenticated it for segments (a segment's memfd; a batch link's
socket, handed to the worker, never does), and the front's ends of its workers' channels never do. What the
front still receives and does not keep is closed here (``discard``): a memfd at once, a socket unlingered first,
anything else on a thread of its own; and a connection that took descriptors is emptied of those still queued in
it before its close (``close_receiving``).
"""

from __future__ import annotations

import fcntl
import logging
import os
import socket
import struct
import threading
from collections.abc import Iterable

__all__ = ["PASSRIGHTS_SUPPORTED", "close_receiving", "discard", "set_passrights"]

log = logging.getLogger("gpubroker.server")

SO_PASSRIGHTS = getattr(socket, "SO_PASSRIGHTS", 83)  # (include/uapi/asm-generic/socket.h; Python names it later)


def set_passrights(sock: socket.socket, allow: bool) -> bool:
    """Whether ``sock`` (a Unix socket) accepts descriptors from its peer; False where the kernel cannot refuse."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, SO_PASSRIGHTS, int(allow))
    except OSError:
        return False
    return True


def _probe() -> bool:
    a, b = socket.socketpair()
    with a, b:
        return set_passrights(a, False)


PASSRIGHTS_SUPPORTED = _probe()


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


def _is_shmem(fd: int) -> bool:
    """A memfd (or another shared-memory file), whose close never waits on anyone. Asked with F_GET_SEALS, which
    no filesystem answers (an fstat of a FUSE file is a request to its server, which may never answer)."""
    try:
        fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:
        return False
    return True


_NO_LINGER = struct.pack("ii", 1, 0)


def _unlinger(fd: int) -> None:
    """A socket's close then resets it at once rather than waiting to send what it holds (SO_LINGER {1, 0}); a
    descriptor that is no socket is left as it is."""
    try:
        sock = socket.socket(fileno=fd)
    except OSError:
        return
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _NO_LINGER)
    except OSError:
        pass
    finally:
        sock.detach()


def discard(fds: Iterable[int]) -> None:
    """Close descriptors the front received and does not keep, without ever waiting on their last close: a memfd
    at once, a socket unlingered (its last close then waits for nothing), and whatever else on a thread."""
    slow: list[int] = []
    for fd in fds:
        if _is_shmem(fd):
            _close_all([fd])
        else:
            _unlinger(fd)
            slow.append(fd)
    if slow:
        threading.Thread(target=_close_all, args=(slow,), name="gpubroker discard fds", daemon=True).start()


# How many queued messages a closing socket's drain reads at most (each holds a few descriptors at most, and the
# socket's receive buffer bounds them anyway): past it, the socket itself is closed on a thread.
_DRAIN_MAX = 4096


def close_receiving(sock: socket.socket) -> None:
    """Close a Unix socket that took descriptors and was not handed on: the descriptors still queued in it would be
    dropped by the kernel at its last close, in the closing thread, each one's own last close included (a lingering
    TCP socket waits as long as its sender likes). So: no more of them (SO_PASSRIGHTS off), those queued taken out
    and discarded, then the close, which has nothing left to wait for."""
    set_passrights(sock, False)
    taken: list[int] = []
    try:
        for _ in range(_DRAIN_MAX):
            try:
                data, fds, _, _ = socket.recv_fds(sock, 65536, 64, socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                break
            taken += fds
            if not data and not fds:
                break
        else:  # (a peer still sending: what it queues next goes with the socket, closed off the loop)
            discard(taken)
            discard([sock.detach()])
            return
    except OSError:
        pass
    discard(taken)
    sock.close()
