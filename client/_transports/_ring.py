"""RingTransport: same-host batches through shared memory, with a socket doorbell each way.

A Unix link (``FramedLink``) is upgraded once its hello is answered: the client creates a sealed memfd holding
two single-producer/single-consumer byte rings (batches client -> worker, acks worker -> client) and a
connected ``SOCK_SEQPACKET`` socketpair (the doorbells: a one-byte record each way), and sends the memfd and the
worker's end of the pair over the link in one frame, ``{"ring": 1, "commands": n, "acks": m, "spin_us": s}``
with the two fds attached (SCM_RIGHTS); the worker maps them (``broker/workers/_ring.py``)
and answers on the link ``[0, 0, {"ring": 1}]``, or ``[0, 1, error]`` and the link stays a plain link. From then
on each batch is one record in the command ring and each ack one record in the ack ring, in order; the link
socket stays open and says when the other side is gone (its close ends the ring).

Each side spins for the other's answer (polls of the ring's index, where the host has CPUs to spare) before
blocking on its doorbell: a launch + sync then costs no wake-up across processes. The worker spins briefly
(``spin_us``) for the client's next batch; the client spins for the answer to the last batch it sent (a call, a
sync) for up to WAIT_SPIN_US, so a call that keeps the device busy for milliseconds costs no wake-up either:
waiting for room in the window it blocks at once, since the worker has a window of batches to run first. A
doorbell is always rung after a record is published, so a side that stopped spinning is never missed; a side
that was spinning finds a record waiting on its socket and drains it before it next blocks.

Doorbells are sockets, not eventfds, because the client shares the worker's end's open file description (it
created it) and may change its flags (O_NONBLOCK) or fill its queues at any time: with a socket each call says
``MSG_DONTWAIT`` for itself, so no doorbell operation ever blocks, whatever the file's flags. A ring that finds
no room to ring drops the wake-up: a full queue means the other side has one pending already.

Layout (little-endian, all indices byte counts that only grow; a record is a 4-byte length then its bytes,
wrapping around the ring's end): the first page holds four u64 indices, each on its own cache line (command
head written by the client, command tail by the worker, ack head by the worker, ack tail by the client); the
command ring follows, then the ack ring. Each side keeps its own indices privately and only publishes them: an
index read from the shared page is the other side's, and is checked before it is used.

Ordering: the producer copies a record in, then publishes the head with one aligned 8-byte store (a
``memoryview`` cast to "Q"); the consumer reads the head, then the record. That order holds on x86-64 (stores
are not reordered with stores, loads with loads); Python gives no fences, so weaker memory models are not
supported by this transport.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import select
import socket
import struct
import time
from typing import Final

from .._errors import GpuBrokerError, Unavailable, error_from_wire
from .._frames import pack_frame, recv_payload, unpack_frame
from ._core import Lost
from ._link import HELLO_REPLY_MAX, Connector, FramedLink

__all__ = ["ACK_HEAD", "ACK_TAIL", "CMD_HEAD", "CMD_TAIL", "MAX_SPIN_US", "RING_DATA", "RING_SEALS",
           "RING_SUPPORTED", "SPIN_ENV", "ByteRing", "RingBroken", "RingTransport", "drain_bell", "ring_bell",
           "ring_caps", "spin_us", "wait_spin_us"]

# Where each index lives, in u64 words of the first page (a cache line apart: no false sharing between sides).
CMD_HEAD: Final = 0
CMD_TAIL: Final = 8
ACK_HEAD: Final = 16
ACK_TAIL: Final = 24
RING_DATA: Final = 4096  # the command ring starts after the index page
# The worker refuses a memfd that could shrink under its mapping (touching it would SIGBUS).
RING_SUPPORTED: Final = (hasattr(os, "memfd_create") and hasattr(socket, "send_fds") and hasattr(fcntl, "F_SEAL_SHRINK")
                         and hasattr(socket, "SOCK_SEQPACKET") and hasattr(socket, "MSG_NOSIGNAL"))
RING_SEALS: Final = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL if RING_SUPPORTED else 0
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
_SPIN_POLLS: Final = 32  # polls between two reads of the clock
_LEN: Final = struct.Struct("<I")


class _Declined(Exception):
    """The worker answered the ring upgrade with a refusal (``error``), or none was offered: the link is intact."""

    def __init__(self, error: GpuBrokerError) -> None:
        super().__init__(error.message)
        self.error = error


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


def wait_spin_us() -> int:
    """How long this process polls for the answer to its last batch before blocking, in microseconds."""
    if os.environ.get(SPIN_ENV) is not None:
        return spin_us()
    return WAIT_SPIN_US if len(os.sched_getaffinity(0)) >= _SPIN_MIN_CPUS else 0


def ring_caps(window: int, max_frame: int) -> int:
    """The byte size of each ring for ``window`` records of at most ``max_frame`` bytes (whole pages)."""
    need = min(window, MAX_RING_WINDOW) * (max_frame + _LEN.size)
    return -(-need // mmap.PAGESIZE) * mmap.PAGESIZE


# The most wake-ups one drain takes: a flood of them (a hostile client's) then only makes the next poll return at
# once, instead of keeping the drain going for as long as the flood lasts.
_DRAIN_MAX: Final = 64
_RING: Final = b"\x01"


def ring_bell(bell: socket.socket) -> None:
    """Wake the other side, never blocking: MSG_DONTWAIT is per call, so the file's O_NONBLOCK (which the other
    side, sharing the file description, may clear) does not matter. No room (EAGAIN, ENOBUFS) means wake-ups
    are queued already: this one is dropped. OSError when the other end is gone or shut."""
    try:
        bell.send(_RING, socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL)
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
            if not bell.recv(16, socket.MSG_DONTWAIT):
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
        n = _LEN.size + len(payload)
        if n > self.cap - used:
            return False
        pos = self._index % self.cap
        self._copy_in(pos, _LEN.pack(len(payload)))
        self._copy_in((pos + _LEN.size) % self.cap, payload)
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
        if not _LEN.size <= avail <= self.cap:
            raise RingBroken(f"the producer's index is {avail} bytes ahead in a ring of {self.cap}")
        pos = self._index % self.cap
        (length,) = _LEN.unpack(self._copy_out(pos, _LEN.size))
        if length > self._limit or _LEN.size + length > avail:
            raise RingBroken(f"a record of {length} bytes (limit {self._limit}, {avail - _LEN.size} published)")
        payload = self._copy_out((pos + _LEN.size) % self.cap, length)
        self._index += _LEN.size + length
        self._words[self._tail_word] = self._index  # the bytes are ours now: the producer may overwrite them
        return payload

    def _copy_out(self, pos: int, n: int) -> bytes:
        start = self._base + pos
        if pos + n <= self.cap:
            return self._mm[start:start + n]
        first = self.cap - pos
        return self._mm[start:start + first] + self._mm[self._base:self._base + n - first]


class RingTransport(FramedLink):
    """A same-host Unix link upgraded to the shared-memory ring; opened (hello and upgrade answered) on
    construction. With ``fallback`` a worker that refuses the upgrade leaves a plain link (``kind`` "unix");
    without it the refusal is raised (Unavailable)."""

    def __init__(self, connect: Connector, token: str, session: str, *, timeout: float | None, fallback: bool,
                 window: int = 4, batch_size: int = 256) -> None:
        self._fallback = fallback
        self._mm: mmap.mmap | None = None
        self._words: memoryview | None = None
        self._bell: socket.socket | None = None  # this side's end of the doorbells' socketpair
        self._commands: ByteRing | None = None
        self._acks: ByteRing | None = None
        self._poller: select.poll | None = None  # the doorbell and the link socket
        self._ring_window = min(window, MAX_RING_WINDOW)
        self._spin = wait_spin_us() * 1e-6
        super().__init__(connect, token, session, kind="ring", timeout=timeout, window=self._ring_window,
                         batch_size=batch_size)

    def _open(self) -> None:
        super()._open()
        try:
            self._upgrade()
            self.kind = "ring"
            return
        except _Declined as declined:  # answered: the link is as it was
            self._unmap()
            if self._fallback:
                self.kind = "unix"
                return
            super()._shut()
            raise declined.error from None
        except GpuBrokerError:  # unanswered or garbled: the link is in no known state
            self._unmap()
            super()._shut()
            if not self._fallback:
                raise
        super()._open()  # a plain link, then
        self.kind = "unix"

    def _upgrade(self) -> None:
        """Offer the worker a ring on the open link; _Declined when it answers no, Unavailable otherwise."""
        if not RING_SUPPORTED:
            raise _Declined(Unavailable("shared-memory rings need Linux (memfd, sealing, SOCK_SEQPACKET)"))
        sock = self._sock
        assert sock is not None
        cap = ring_caps(self._ring_window, self.max_frame)
        size = RING_DATA + 2 * cap
        try:
            fd = os.memfd_create(f"gpubroker-ring-{os.getpid()}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        except OSError as exc:
            raise _Declined(Unavailable(f"no memory for a ring: {exc}")) from None
        try:
            os.ftruncate(fd, size)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, RING_SEALS)
            self._mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            self._bell, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            self._bell.settimeout(None)  # each call made once (no wait for readiness first, as a timeout has)
        except OSError as exc:  # (nothing sent yet: the link is untouched)
            os.close(fd)
            raise _Declined(Unavailable(f"no memory for a ring: {exc}")) from None
        try:
            frame = pack_frame({"ring": 1, "commands": cap, "acks": cap, "spin_us": spin_us()})
            sent = socket.send_fds(sock, [frame], [fd, theirs.fileno()])
            sock.sendall(frame[sent:])
            reply = unpack_frame(recv_payload(sock, HELLO_REPLY_MAX))
        except (OSError, EOFError, ValueError) as exc:
            raise Unavailable(f"the worker did not answer the ring upgrade: {exc}") from None
        finally:
            os.close(fd)  # mapped, and the worker has its own: the fds themselves are not needed any more
            theirs.close()
        try:
            _, status, result = reply
            if status != 0:
                raise _Declined(error_from_wire(str(result["code"]), str(result["message"]), result.get("type"),
                                                result.get("details")))
            if result.get("ring") != 1:
                raise Unavailable(f"the worker answered the ring upgrade with {result!r}")
        except (TypeError, ValueError, KeyError, AttributeError):
            raise Unavailable(f"the worker answered the ring upgrade with {reply!r}") from None
        words = memoryview(self._mm).cast("Q")
        self._words = words
        self._commands = ByteRing(self._mm, words, RING_DATA, cap, CMD_HEAD * 8, CMD_TAIL * 8, self.max_frame)
        self._acks = ByteRing(self._mm, words, RING_DATA + cap, cap, ACK_HEAD * 8, ACK_TAIL * 8,
                              cap - _LEN.size)
        self._poller = select.poll()
        self._poller.register(self._bell, select.POLLIN)
        self._poller.register(sock, select.POLLIN | select.POLLRDHUP)

    def _unmap(self) -> None:
        self._commands = self._acks = None
        self._poller = None
        if self._words is not None:
            self._words.release()
            self._words = None
        if self._mm is not None:
            self._mm.close()
            self._mm = None
        if self._bell is not None:
            self._bell.close()
            self._bell = None

    def _send(self, payload: bytes) -> None:
        if self._commands is None:
            super()._send(payload)
            return
        assert self._bell is not None
        try:
            if not self._commands.put(payload):  # the window bounds what is in flight: the worker stopped reading
                raise Lost("the worker stopped taking batches from the ring")
            ring_bell(self._bell)
        except RingBroken as exc:
            raise Lost(f"the command ring is broken: {exc}") from None
        except OSError as exc:
            raise Lost(f"ringing the worker failed: {exc}") from None

    def _receive(self, timeout: float | None) -> bytes | bytearray:
        acks = self._acks
        if acks is None:
            return super()._receive(timeout)
        try:
            payload = acks.get()
            if payload is not None:
                return payload
            if len(self._unacked) > 1 or not self._spin:
                # Back-pressure or a drain: what is awaited is not the last batch, and the rest is behind it;
                # spinning would only burn the client's CPU (and the CPU the worker and its device may need).
                return self._block(acks, timeout)
            spin_end = time.perf_counter() + self._spin
            while time.perf_counter() < spin_end:
                for _ in range(_SPIN_POLLS):
                    if acks.ready():
                        payload = acks.get()
                        if payload is not None:
                            return payload
                os.sched_yield()  # a polite spin: whatever else wants this CPU (the worker, its device) runs
            return self._block(acks, timeout)
        except RingBroken as exc:
            raise Lost(f"the ack ring is broken: {exc}") from None

    def _block(self, acks: ByteRing, timeout: float | None) -> bytes:
        """Wait on the doorbell (and the link socket, whose hang-up says the worker is gone) for the next ack.
        The bell is drained after each wake-up and before the ring is looked at again: an ack published after
        that look rings it anew, so none is missed."""
        assert self._bell is not None and self._sock is not None and self._poller is not None
        bell, sock = self._bell, self._sock.fileno()
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic()) * 1000
            events = self._poller.poll(left)
            if not events:
                raise TimeoutError
            gone = any(fd == sock for fd, _ in events) or not drain_bell(bell)
            payload = acks.get()  # (after a hang-up too: an ack written just before the worker closed the link)
            if payload is not None:
                return payload
            if gone:
                raise Lost("the worker closed the link")

    def _shut(self) -> None:
        self._unmap()
        super()._shut()
