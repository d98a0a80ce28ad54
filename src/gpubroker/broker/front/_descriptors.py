"""Descriptors sent to the front (SCM_RIGHTS): refused where none is expected, never closed on the event loop.

The last close of a descriptor can block for as long as whoever made it likes: a TCP socket with unsent data and
``SO_LINGER`` waits for its peer's acknowledgement, a file on a FUSE mount for the FUSE daemon. Any process that can
connect to one of the front's Unix sockets could send one along with a byte, close its own copy, and leave the
front holding the last reference: closed by the front, or by the kernel discarding what a plain ``recv`` did not
take (in the receiving thread), it would stop the event loop, and every tenant with it.

So every Unix socket the front listens on refuses descriptors (``SO_PASSRIGHTS`` = 0, Linux >= 6.16: inherited
by the connections it accepts, checked as the peer sends, whose ``sendmsg`` fails with EPERM); a ``.fast``
connection takes them only once its hello has authenticated it (a link's ring upgrade, a segment's memfd), and the
front's ends of its workers' channels never do. What the front still receives and does not keep is closed here:
a regular file (a memfd) at once, anything else on a thread of its own.
"""

from __future__ import annotations

import logging
import os
import socket
import stat
import threading
from collections.abc import Iterable

__all__ = ["PASSRIGHTS_SUPPORTED", "discard", "set_passrights"]

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


def discard(fds: Iterable[int]) -> None:
    """Close descriptors the front received and does not keep, without ever waiting on their last close."""
    slow: list[int] = []
    for fd in fds:
        try:
            regular = stat.S_ISREG(os.fstat(fd).st_mode)  # a memfd or a file: its close never waits on anyone
        except OSError:
            regular = False
        if regular:
            _close_all([fd])
        else:
            slow.append(fd)
    if slow:
        threading.Thread(target=_close_all, args=(slow,), name="gpubroker discard fds", daemon=True).start()
