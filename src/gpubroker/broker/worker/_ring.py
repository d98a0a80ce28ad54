"""The worker's end of a same-host ring: a link upgraded to shared memory (``gpubroker/client/_transports/_ring.py`` has
the layout and the client's side).

The front makes the ring's memfd and the doorbells' socketpair (front/_links.py: sealed, exactly the rings' size,
charged to the tenant's shared memory, both doorbell ends refusing descriptors) and passes the worker its part with
the link (``AttachLink``); the checks below still hold it to that shape. The client maps the same memfd and holds
the other doorbell, and may write anything into them at any time: every
index and length read from the shared page is checked before use (``ByteRing``), a record is copied out before
it is decoded, the memfd must be sealed against shrinking (a mapping past its end would SIGBUS), both rings are
bounded by the link's frame size, and nothing here ever blocks on the doorbell, whatever the client does to its
flags (it shares the file description: it created it), its queues or its buffers: every send and recv on it says
MSG_DONTWAIT for itself, a ring with no room is dropped (the client has a wake-up pending), and a drain takes a
bounded number of records. The doorbell must be a connected AF_UNIX SOCK_SEQPACKET socket with an unnamed peer
(a socketpair's end): no pipe, no eventfd, nothing connected to a listener elsewhere. A ring found broken gets
an Ack with id 0 (when its ack ring can take one), then the link is closed, as for a malformed frame on a plain
link; so does a doorbell whose other end is gone or shut.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import socket
import time
from typing import Final

from gpubroker.wire.errors import InvalidArgument
from gpubroker.wire.ring import (
    ACK_HEAD,
    ACK_TAIL,
    CLIENT_AWAKE,
    CMD_HEAD,
    CMD_TAIL,
    MAX_RING_WINDOW,
    MAX_SPIN_US,
    RING_DATA,
    WORKER_AWAKE,
    ByteRing,
    RingBroken,
    drain_bell,
    rest,
    ring_caps,
    ring_unless_awake,
)

__all__ = ["RING_FDS", "RingBroken", "RingClosed", "WorkerRing", "open_ring"]

# After answering a batch the worker polls the ring for the next before going back to its select, as long as
# the client asked (``spin_us``: 0 where its host has no spare CPU), at most MAX_SPIN_US: a synchronous client's
# next command is usually a few microseconds behind its ack. Short, so the front's messages (a revoked turn)
# and other links wait at most this long.
_SPIN_POLLS: Final = 16
RING_FDS: Final = 2  # the memfd, the worker's end of the doorbells' socketpair


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)


def _doorbell(fd: int) -> socket.socket:
    """The worker's end of the client's socketpair, checked as far as this side can see; InvalidArgument
    otherwise. Takes ``fd`` (closed here on failure)."""
    try:
        bell = socket.socket(fileno=fd)  # (reads the family and type from the fd itself)
    except OSError:
        os.close(fd)
        raise InvalidArgument("a ring's doorbell must be a socket (a SOCK_SEQPACKET socketpair's end)") from None
    try:
        kind = bell.getsockopt(socket.SOL_SOCKET, socket.SO_TYPE)
        if bell.family != socket.AF_UNIX or kind != socket.SOCK_SEQPACKET:
            raise InvalidArgument(f"a ring's doorbell must be an AF_UNIX SOCK_SEQPACKET socket, got family "
                                  f"{int(bell.family)} type {kind}")
        try:
            peer = bell.getpeername()
        except OSError:
            raise InvalidArgument("a ring's doorbell must be connected (a socketpair's end)") from None
        if peer not in ("", b"") or bell.getsockname() not in ("", b""):
            # A named peer is some listener's, not the client's own end: the worker would ring a stranger.
            raise InvalidArgument("a ring's doorbell must be a socketpair's end (no names)")
        # No timeout: Python then makes each call once, MSG_DONTWAIT and all; with one it would first wait for
        # the socket to be ready (a default timeout, socket.setdefaulttimeout, would give it one).
        bell.settimeout(None)
    except BaseException:
        bell.close()
        raise
    return bell


class RingClosed(RingBroken):
    """The client's end of the ring is gone: the way a ring ends when its client closes, not a fault."""


class WorkerRing:
    """A mapped ring: batches to take (``commands``), acks to give (``answer``), the doorbell to watch (``bell``:
    readable when the client rang, or when its end is gone)."""

    def __init__(self, mm: mmap.mmap, bell: socket.socket, commands: int, acks: int, max_frame: int,
                 spin: float) -> None:
        self._mm = mm
        self.spin_seconds = spin
        self._words = memoryview(mm).cast("Q")
        self.bell = bell
        self.commands = ByteRing(mm, self._words, RING_DATA, commands, CMD_HEAD * 8, CMD_TAIL * 8, max_frame)
        self.acks = ByteRing(mm, self._words, RING_DATA + commands, acks, ACK_HEAD * 8, ACK_TAIL * 8, acks)

    def drain(self) -> None:
        """Take the client's wake-ups; RingClosed when its end is gone or shut (no more would come: the client
        closed its session or went away)."""
        if not drain_bell(self.bell):
            raise RingClosed("the client closed it")

    def spin(self) -> bool:
        """Poll for the next batch for a short while; whether one came."""
        if not self.spin_seconds:
            return False
        commands = self.commands
        end = time.perf_counter() + self.spin_seconds
        while time.perf_counter() < end:
            for _ in range(_SPIN_POLLS):
                if commands.ready():
                    return True
            os.sched_yield()  # a polite spin: the client (or anything else) that wants this CPU runs
        return False

    def answer(self, payload: bytes) -> None:
        """Publish one ack and ring the client's doorbell, unless the client said it looks at the ring before it
        blocks. RingBroken when the client does not read its acks (the window it was given always fits) or its
        index is impossible, or its doorbell's end is gone or shut."""
        if not self.acks.put(payload):
            raise RingBroken("the client does not read its acks (its ring is full)")
        try:
            ring_unless_awake(self._words, CLIENT_AWAKE, self.bell)
        except OSError:
            raise RingClosed("the client closed it") from None

    def awake(self) -> None:
        """This worker will look at the ring before it next blocks: the client need not ring for a batch."""
        self._words[WORKER_AWAKE] = 1

    def rest(self) -> bool:
        """This worker may block from now on (the client rings for each batch); whether a batch came meanwhile
        (then the worker takes it rather than block)."""
        return rest(self._words, WORKER_AWAKE, self.commands)

    def close(self) -> None:
        self._words.release()
        self._mm.close()
        self.bell.close()


def open_ring(commands: int, acks: int, spin: int, fds: list[int], max_frame: int) -> WorkerRing:
    """Map the ring the front made for a link (a sealed memfd and the worker's doorbell, a SOCK_SEQPACKET
    socketpair's end); InvalidArgument naming what is wrong. Takes the fds: closed here on failure, by the ring
    after."""
    try:
        if len(fds) != RING_FDS:
            raise InvalidArgument(f"a ring comes with {RING_FDS} fds (memfd, doorbell), got {len(fds)}")
        low, high = max_frame + 4, ring_caps(MAX_RING_WINDOW, max_frame)
        for size in (commands, acks):
            if not low <= size <= high:
                raise InvalidArgument(f"a ring's size must be {low} to {high} bytes, got {size!r}")
        if not 0 <= spin <= MAX_SPIN_US:
            raise InvalidArgument(f"a ring's spin must be 0 to {MAX_SPIN_US} us, got {spin!r}")
        memfd, bell_fd = fds
        try:
            seals = fcntl.fcntl(memfd, fcntl.F_GET_SEALS)
        except OSError:
            raise InvalidArgument("the ring's memory is not a memfd") from None
        # Sealed against shrinking (touching a page past a shrunk end would SIGBUS) and growing, and exactly the
        # ring's size: what the front charged.
        if seals & (fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW) != fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW:
            raise InvalidArgument("the ring's memfd is not sealed against shrinking and growing "
                                  "(F_SEAL_SHRINK | F_SEAL_GROW)")
        size = RING_DATA + commands + acks
        if os.fstat(memfd).st_size != size:
            raise InvalidArgument(f"the ring's memfd holds {os.fstat(memfd).st_size} bytes, not {size}")
        mm = mmap.mmap(memfd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        _close_all(fds)
        raise
    os.close(memfd)  # the mapping keeps the memory
    try:
        bell = _doorbell(bell_fd)  # (last: it takes the fd)
    except BaseException:
        mm.close()
        raise
    return WorkerRing(mm, bell, commands, acks, max_frame, spin * 1e-6)
