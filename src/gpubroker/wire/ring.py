"""The ring's shared layout, both sides': byte rings in one sealed memfd and a socket doorbell each way.

The client's ring carrier (``gpubroker/client/_transports/_ring.py``, whose docstring tells the protocol) and the
worker's WorkerRing (``gpubroker/broker/worker/_ring.py``) map the same memfd through ``ByteRing``: where the
indices live, how a record is laid out, how long each side spins and how a doorbell rings are defined here once.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import socket
import struct
import threading
from typing import Final

__all__ = ["ACK_HEAD", "ACK_TAIL", "CLIENT_AWAKE", "CMD_HEAD", "CMD_TAIL", "MAX_RING_WINDOW", "MAX_SPIN_US",
           "RING_DATA", "RING_SEALS", "RECORD_LENGTH", "RING_SUPPORTED", "SPIN_ENV", "SPIN_POLLS", "WAIT_SPIN_US",
           "WORKER_AWAKE", "ByteRing", "RingBroken", "drain_bell", "full_fence", "rest", "ring_bell",
           "ring_unless_awake", "sealed_memfd", "ring_caps", "spin_us", "link_spin_us", "wait_spin_us"]

# Where each index lives, in u64 words of the first page (a cache line apart: no false sharing between sides).
CMD_HEAD: Final = 0
CMD_TAIL: Final = 8
ACK_HEAD: Final = 16
ACK_TAIL: Final = 24
# Whether each side will look at the ring again before it blocks (1), or may be blocked on its doorbell (0), each
# word written by its side only: a producer rings the doorbell only when the consumer may be blocked, so a round
# trip while both sides poll costs no system call. (A side that never writes its word, an older one, is taken
# as blocked: rung every time, as before. A word the other side scribbles over only costs that side its bells.)
WORKER_AWAKE: Final = 32
CLIENT_AWAKE: Final = 40
RING_DATA: Final = 4096  # the command ring starts after the index page
# The worker refuses a memfd that could shrink under its mapping (touching it would SIGBUS).
RING_SUPPORTED: Final = (hasattr(os, "memfd_create") and hasattr(socket, "send_fds") and hasattr(fcntl, "F_SEAL_SHRINK")
                         and hasattr(socket, "SOCK_SEQPACKET") and hasattr(socket, "MSG_NOSIGNAL"))
RING_SEALS: Final = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL if RING_SUPPORTED else 0


def sealed_memfd(name: str, size: int) -> int:
    """A memfd of exactly ``size`` bytes (sparse: pages come as they are touched), sealed with ``RING_SEALS``
    against growing, shrinking and further seals: how every process of gpubroker makes the shared memory it hands
    to another (a ring, a segment, CopyPeer's staging), which can then neither SIGBUS a mapping nor grow past
    what was counted. ``name`` shows in /proc's maps and fd links; OSError (its fd closed) if the host gives none."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, RING_SEALS)
    except BaseException:
        os.close(fd)
        raise
    return fd


# A ring holds a window of the largest records: an ack never waits for room, and a batch only when the window
# is full (the core reads an ack first). Windows above this are cut to it for the ring.
MAX_RING_WINDOW: Final = 8
# How long each side polls for the other's answer before blocking on its doorbell: about the turnaround of a
# small launch + sync; past it a wake-up costs little against what the command takes. Only where spare CPUs
# are: on a host of 2 or 3 the spinning side takes the CPU that the other side (and PoCL's device threads)
# needs, and is slower than a wake-up. GPUBROKER_RING_SPIN_US sets it (0: never spin); the worker spins what
# the client asks, up to MAX_SPIN_US.
SPIN_ENV: Final = "GPUBROKER_RING_SPIN_US"
MAX_SPIN_US: Final = 200
_SPIN_US: Final = 50
# How long the client polls for the answer to its own last batch (a call, a sync), where it spins by default:
# far longer than the worker's spin, because a wake-up is not cheap everywhere. In a VM a blocked client's idle
# vCPU halts, and the worker's doorbell then costs an interrupt through the hypervisor, measured at 0.1-0.2 ms
# on an H200 VM: every blocking call after a few ms of device work (a ~5 ms kernel and its sync, a 64 MiB copy)
# paid it, and so did the worker, whose own spin for the next batch had ended meanwhile. Native CUDA spins the
# same way (cudaDeviceScheduleAuto with spare CPUs). Past this a call blocks: a wake-up is small against it.
# Where SPIN_ENV is set, the client's wait spins just that long (0: never).
WAIT_SPIN_US: Final = 20_000
_SPIN_MIN_CPUS: Final = 4
SPIN_POLLS: Final = 32  # polls between two reads of the clock
RECORD_LENGTH: Final = struct.Struct("<I")


class RingBroken(Exception):
    """An index or record length read from shared memory is impossible: the other side wrote nonsense."""


def spin_us() -> int:
    """This process's spin for a new ring, in microseconds (see SPIN_ENV)."""
    value = os.environ.get(SPIN_ENV)
    if value is not None:
        try:
            return max(0, min(int(value), MAX_SPIN_US))
        except ValueError:
            pass
    return _SPIN_US if len(os.sched_getaffinity(0)) >= _SPIN_MIN_CPUS else 0


def link_spin_us(relayed: bool) -> int:
    """How long a worker polls a link without a ring for its client's next batch after answering one, and a TCP
    link's relay polls each way for the next bytes, in microseconds: this host's spin (SPIN_ENV where set). A TCP
    link's round trip has its relay's hop and TLS both ways besides, so its client's next batch comes later after
    an answer: where this host spins at all and SPIN_ENV says nothing, those poll up to MAX_SPIN_US (on an H200
    host, launch + sync with async_commands over TCP + TLS took 99-120 us so, 136-179 us polling 50 us)."""
    spin = spin_us()
    return MAX_SPIN_US if relayed and spin and os.environ.get(SPIN_ENV) is None else spin


def wait_spin_us() -> int:
    """How long this process polls for the answer to its last batch before blocking, in microseconds."""
    if os.environ.get(SPIN_ENV) is not None:
        return spin_us()
    return WAIT_SPIN_US if len(os.sched_getaffinity(0)) >= _SPIN_MIN_CPUS else 0


def ring_caps(window: int, max_frame: int) -> int:
    """The byte size of each ring for ``window`` records of at most ``max_frame`` bytes (whole pages)."""
    need = min(window, MAX_RING_WINDOW) * (max_frame + RECORD_LENGTH.size)
    return -(-need // mmap.PAGESIZE) * mmap.PAGESIZE


# The most wake-ups one drain takes: a flood of them (a hostile client's) then only makes the next poll return at
# once, instead of keeping the drain going for as long as the flood lasts.
_DRAIN_MAX: Final = 64
_RING: Final = b"\x01"
# (plain ints: or-ing the socket module's flag enums costs a microsecond at every ring)
_RING_FLAGS: Final = int(socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL) if hasattr(socket, "MSG_NOSIGNAL") else 0
_DONTWAIT: Final = int(socket.MSG_DONTWAIT) if hasattr(socket, "MSG_DONTWAIT") else 0


_FENCE: Final = threading.Lock()


def full_fence() -> None:
    """Order this thread's stores before its later loads. x86-64 keeps every other order but may let a load pass
    an earlier store to another word: a producer that published a record and then read the consumer's awake word
    could read it stale while the consumer, having cleared it, reads the producer's index stale, and both would
    miss. A locked instruction orders them, and taking an uncontended lock is one (CPython has no fence)."""
    _FENCE.acquire()
    _FENCE.release()


def ring_unless_awake(words: memoryview, awake: int, bell: socket.socket) -> None:
    """After publishing a record: ring the consumer's doorbell unless it said it will look at the ring again
    (``words[awake]`` is 1). ``ring_bell``'s errors."""
    full_fence()
    if words[awake] != 1:
        ring_bell(bell)


def rest(words: memoryview, awake: int, ring: ByteRing) -> bool:
    """Before blocking on its doorbell: say so (``words[awake]`` = 0), then look once more; whether a record
    came meanwhile (then the caller takes it instead of blocking, and says it is awake again)."""
    words[awake] = 0
    full_fence()
    return ring.ready()


def ring_bell(bell: socket.socket) -> None:
    """Wake the other side, never blocking: MSG_DONTWAIT is per call, so the file's O_NONBLOCK (which the other
    side, sharing the file description, may clear) does not matter. No room (EAGAIN, ENOBUFS) means wake-ups
    are queued already: this one is dropped. OSError when the other end is gone or shut."""
    try:
        bell.send(_RING, _RING_FLAGS)
    except BlockingIOError:
        pass
    except OSError as exc:
        if exc.errno != errno.ENOBUFS:
            raise


def drain_bell(bell: socket.socket) -> bool:
    """Take the wake-ups waiting (at most _DRAIN_MAX), never blocking (MSG_DONTWAIT per call); False when the
    other end is gone or shut (end of file, or an error): no wake-up will come any more."""
    for _ in range(_DRAIN_MAX):
        try:
            if not bell.recv(16, _DONTWAIT):
                return False
        except BlockingIOError:
            return True
        except OSError:
            return False
    return True


class ByteRing:
    """One direction of a ring, as its producer or its consumer sees it: this side's index kept privately,
    the other side's read from shared memory and checked."""

    def __init__(self, mm: mmap.mmap, words: memoryview, base: int, cap: int, head: int, tail: int,
                 limit: int) -> None:
        self._mm = mm
        self._words = words  # the index page as u64s: each read or write is one aligned 8-byte access
        self._base = base
        self.cap = cap
        self._head_word = head // 8
        self._tail_word = tail // 8
        self._limit = limit  # the largest record this side takes
        self._index = 0  # the producer's head or the consumer's tail: never read back from shared memory

    # -- producer ----------------------------------------------------------------------------------
    def put(self, payload: bytes | bytearray) -> bool:
        """Copy one record in and publish it; False when it does not fit now. RingBroken for a bad tail."""
        used = self._index - self._words[self._tail_word]
        if not 0 <= used <= self.cap:
            raise RingBroken(f"the consumer's index is {used} bytes behind in a ring of {self.cap}")
        n = RECORD_LENGTH.size + len(payload)
        if n > self.cap - used:
            return False
        pos = self._index % self.cap
        if pos + n <= self.cap:  # (the usual case, a record that does not wrap: its length and bytes at once)
            start = self._base + pos
            RECORD_LENGTH.pack_into(self._mm, start, len(payload))
            self._mm[start + RECORD_LENGTH.size:start + n] = payload
        else:
            self._copy_in(pos, RECORD_LENGTH.pack(len(payload)))
            self._copy_in((pos + RECORD_LENGTH.size) % self.cap, payload)
        self._index += n
        self._words[self._head_word] = self._index  # published: after the record's bytes
        return True

    def _copy_in(self, pos: int, data: bytes | bytearray) -> None:
        first = min(len(data), self.cap - pos)
        start = self._base + pos
        mm = self._mm
        if first == len(data):
            mm[start:start + first] = data
        else:
            view = memoryview(data)
            mm[start:start + first] = view[:first]
            mm[self._base:self._base + len(data) - first] = view[first:]

    # -- consumer ----------------------------------------------------------------------------------
    def ready(self) -> bool:
        """Whether a record may be waiting (one 8-byte read: what a spin polls)."""
        return self._words[self._head_word] != self._index

    def get(self) -> bytes | None:
        """The next record, copied out of shared memory (the producer may reuse its bytes after this), or None.
        RingBroken for an impossible head or length; nothing is consumed then."""
        avail = self._words[self._head_word] - self._index
        if avail == 0:
            return None
        if not RECORD_LENGTH.size <= avail <= self.cap:
            raise RingBroken(f"the producer's index is {avail} bytes ahead in a ring of {self.cap}")
        pos = self._index % self.cap
        if pos + RECORD_LENGTH.size <= self.cap:  # (the usual case: read in place)
            (length,) = RECORD_LENGTH.unpack_from(self._mm, self._base + pos)
        else:
            (length,) = RECORD_LENGTH.unpack(self._copy_out(pos, RECORD_LENGTH.size))
        if length > self._limit or RECORD_LENGTH.size + length > avail:
            published = avail - RECORD_LENGTH.size
            raise RingBroken(f"a record of {length} bytes (limit {self._limit}, {published} published)")
        payload = self._copy_out((pos + RECORD_LENGTH.size) % self.cap, length)
        self._index += RECORD_LENGTH.size + length
        self._words[self._tail_word] = self._index  # the bytes are ours now: the producer may overwrite them
        return payload

    def _copy_out(self, pos: int, n: int) -> bytes:
        start = self._base + pos
        if pos + n <= self.cap:
            return self._mm[start:start + n]
        first = self.cap - pos
        return self._mm[start:start + first] + self._mm[self._base:self._base + n - first]
