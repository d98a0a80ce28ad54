"""The worker's end of a same-host ring: a link upgraded to shared memory (``client/_transports/_ring.py`` has
the layout and the client's side).

The client owns the memfd and the eventfds, and may write anything into them at any time: every index and
length read from the shared page is checked before use (``ByteRing``), a record is copied out before it is
decoded, the memfd must be sealed against shrinking (a mapping past its end would SIGBUS), both rings are
bounded by the link's frame size, and nothing here ever blocks on a doorbell: reads use RWF_NOWAIT (per call:
the client shares the file description and could clear O_NONBLOCK), and an ack's doorbell is rung only while
the eventfd is non-blocking. A ring found broken gets an Ack with id 0 (when its ack ring can take one), then
the link is closed, as for a malformed frame on a plain link.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import stat
import time
from typing import Any, Final

from gpubroker.client import InvalidArgument, Unavailable
from gpubroker.client._transports._ring import (
    ACK_HEAD,
    ACK_TAIL,
    CMD_HEAD,
    CMD_TAIL,
    MAX_RING_WINDOW,
    MAX_SPIN_US,
    RING_DATA,
    ByteRing,
    RingBroken,
    drain_bell,
    ring_caps,
)

__all__ = ["RING_FDS", "Doorbell", "RingBroken", "WorkerRing", "open_ring"]

# After answering a batch the worker polls the ring for the next before going back to its select, as long as
# the client asked (``spin_us``: 0 where its host has no spare CPU), at most MAX_SPIN_US: a synchronous client's
# next command is usually a few microseconds behind its ack. Short, so the front's messages (a revoked turn)
# and other links wait at most this long.
_SPIN_POLLS: Final = 16
RING_FDS: Final = 3  # the memfd, the commands' doorbell, the acks' doorbell (on a link's first frame)


class Doorbell:
    """An eventfd in the worker's selector (anything with ``fileno``)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def fileno(self) -> int:
        return self.fd


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)


def _is_eventfd(fd: int) -> bool:
    try:
        return os.readlink(f"/proc/self/fd/{fd}") == "anon_inode:[eventfd]"
    except OSError:  # no /proc in this sandbox: an anonymous inode at least (no file type), not a pipe or file
        return stat.S_IFMT(os.fstat(fd).st_mode) == 0


class WorkerRing:
    """A mapped ring: batches to take (``commands``), acks to give (``answer``), the doorbell to watch."""

    def __init__(self, mm: mmap.mmap, bells: tuple[int, int], commands: int, acks: int, max_frame: int,
                 spin: float) -> None:
        self._mm = mm
        self.spin_seconds = spin
        self._words = memoryview(mm).cast("Q")
        self._bells = bells
        self.bell = Doorbell(bells[0])
        self.commands = ByteRing(mm, self._words, RING_DATA, commands, CMD_HEAD * 8, CMD_TAIL * 8, max_frame)
        self.acks = ByteRing(mm, self._words, RING_DATA + commands, acks, ACK_HEAD * 8, ACK_TAIL * 8, acks)

    def drain(self) -> None:
        drain_bell(self._bells[0])

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
        """Publish one ack and ring the client's doorbell. RingBroken when the client does not read its acks
        (the window it was given always fits) or its index is impossible."""
        bell = self._bells[1]
        if not fcntl.fcntl(bell, fcntl.F_GETFL) & os.O_NONBLOCK:
            raise RingBroken("the acks' doorbell was made blocking")
        if not self.acks.put(payload):
            raise RingBroken("the client does not read its acks (its ring is full)")
        try:
            os.eventfd_write(bell, 1)
        except BlockingIOError:
            pass  # the counter is saturated: the client has a wake-up pending anyway

    def close(self) -> None:
        self._words.release()
        self._mm.close()
        _close_all(list(self._bells))


def open_ring(request: Any, fds: list[int], max_frame: int) -> WorkerRing:
    """Map the ring a client offers (``{"ring": 1, "commands": n, "acks": m, "spin_us": s}`` with a sealed memfd and two
    eventfds); InvalidArgument naming what is wrong. Takes the fds: closed here on failure, by the ring after."""
    try:
        if len(fds) != RING_FDS:
            raise InvalidArgument(f"a ring upgrade carries {RING_FDS} fds (memfd, two eventfds), got {len(fds)}")
        if not isinstance(request, dict) or request.get("ring") != 1:
            raise InvalidArgument("a frame with fds attached must be a ring upgrade {'ring': 1, ...}")
        low, high = max_frame + 4, ring_caps(MAX_RING_WINDOW, max_frame)
        sizes: list[int] = []
        for key in ("commands", "acks"):
            size = request.get(key)
            if type(size) is not int or not low <= size <= high:
                raise InvalidArgument(f"a ring's size must be {low} to {high} bytes, got {size!r}")
            sizes.append(size)
        commands, acks = sizes
        spin = request.get("spin_us", 0)
        if type(spin) is not int or not 0 <= spin <= MAX_SPIN_US:
            raise InvalidArgument(f"a ring's spin must be 0 to {MAX_SPIN_US} us, got {spin!r}")
        memfd, *bells = fds
        try:
            seals = fcntl.fcntl(memfd, fcntl.F_GET_SEALS)
        except OSError:
            raise InvalidArgument("the ring's memory is not a memfd") from None
        if not seals & fcntl.F_SEAL_SHRINK:
            raise InvalidArgument("the ring's memfd is not sealed against shrinking (F_SEAL_SHRINK)")
        size = RING_DATA + commands + acks
        if os.fstat(memfd).st_size < size:
            raise InvalidArgument(f"the ring's memfd holds {os.fstat(memfd).st_size} bytes, not {size}")
        for bell in bells:
            if not _is_eventfd(bell):
                raise InvalidArgument("a ring's doorbells must be eventfds")
            fcntl.fcntl(bell, fcntl.F_SETFL, fcntl.fcntl(bell, fcntl.F_GETFL) | os.O_NONBLOCK)
        try:
            drain_bell(bells[0])  # eventfds read with RWF_NOWAIT need Linux 5.12
        except OSError as exc:
            if exc.errno in (errno.EOPNOTSUPP, errno.EINVAL):
                raise Unavailable("this kernel cannot read an eventfd without blocking: no ring") from None
            raise
        mm = mmap.mmap(memfd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        _close_all(fds)
        raise
    os.close(memfd)  # the mapping keeps the memory
    return WorkerRing(mm, (bells[0], bells[1]), commands, acks, max_frame, spin * 1e-6)

