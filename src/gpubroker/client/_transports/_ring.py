"""The ring: same-host batches through shared memory, with a socket doorbell each way (the ``RingUpgrade``
carrier under a BatchingTransport, made by ``ring_transport``).

A Unix link (a ``FramedSocket``, which the ring carrier holds) asks for a ring in its hello (a ``RingRequest``,
``gpubroker/wire/link.py``: its window and the worker's spin). The front makes it: a sealed memfd holding two
single-producer/single-consumer byte rings (batches client -> worker, acks worker -> client), charged to the
tenant's shared memory, and a connected ``SOCK_SEQPACKET`` socketpair (the doorbells: a one-byte record each way);
it answers ``RingGranted`` with the memfd and this side's doorbell attached (SCM_RIGHTS), and passes the worker the
rest with the link (``gpubroker/broker/worker/_ring.py``), whose ``LinkAccepted`` says it mapped them. (The
client never sends a descriptor: the worker runs its tenant's code, and a memfd of the client's would be memory
outside every bound; the worker's end of the link refuses them.) A ring declined (the tenant's shared memory is
full, say) leaves a plain link. From then on each batch is one record in the command ring and each ack one record
in the ack ring, in order; the link socket stays open and says when the other side is gone (its close ends the
ring).

Each side spins for the other's answer (polls of the ring's index, where the host has CPUs to spare) before
blocking on its doorbell: a launch + sync then costs no wake-up across processes. The worker spins briefly
(``spin_us``) for the client's next batch; the client spins for the answer to the last batch it sent (a call, a
sync) for up to WAIT_SPIN_US, so a call that keeps the device busy for milliseconds costs no wake-up either:
waiting for room in the window it blocks at once, since the worker has a window of batches to run first. A
doorbell is always rung after a record is published, so a side that stopped spinning is never missed; a side
that was spinning finds a record waiting on its socket and drains it before it next blocks. A side that will
look at the ring again before it blocks says so in its awake word (the worker while its serve loop runs, the
client except in its blocking wait), and the other side rings only when that word is down: a round trip while
both poll costs no system call. Going to block, a side lowers its word, orders that store before its loads
(``full_fence``), and looks at the ring once more; its first wait is short (a millisecond), then it looks again:
a missed ring would cost that much, never a hang.

Doorbells are sockets, not eventfds, because a client could share the worker's end's open file description (an
older one created it) and may change its flags (O_NONBLOCK) or fill its queues at any time: with a socket each call says
``MSG_DONTWAIT`` for itself, so no doorbell operation ever blocks, whatever the file's flags. A ring that finds
no room to ring drops the wake-up: a full queue means the other side has one pending already.

Layout (little-endian, all indices byte counts that only grow; a record is a 4-byte length then its bytes,
wrapping around the ring's end): the first page holds four u64 indices, each on its own cache line (command
head written by the client, command tail by the worker, ack head by the worker, ack tail by the client), then
the worker's and the client's awake words, each on its own line too; the command ring follows, then the ack
ring. Each side keeps its own indices privately and only publishes them: an index read from the shared page is
the other side's, and is checked before it is used.

Ordering: the producer copies a record in, then publishes the head with one aligned 8-byte store (a
``memoryview`` cast to "Q"); the consumer reads the head, then the record. That order holds on x86-64 (stores
are not reordered with stores, loads with loads); the one order it does not keep, a load after a store to
another word, the awake words need, and ``full_fence`` gives (a locked instruction: CPython has no fence), so
weaker memory models are not supported by this transport.
"""

from __future__ import annotations

import mmap
import os
import select
import socket
import time
from typing import Final

from gpubroker.client._transports._core import BatchingTransport, Lost
from gpubroker.client._transports._link import Connector, FramedSocket
from gpubroker.wire.errors import GpuBrokerError, Unavailable
from gpubroker.wire.link import RingRequest
from gpubroker.wire.ring import (
    ACK_HEAD,
    ACK_TAIL,
    CLIENT_AWAKE,
    CMD_HEAD,
    CMD_TAIL,
    MAX_RING_WINDOW,
    RECORD_LENGTH,
    RING_DATA,
    RING_SUPPORTED,
    SPIN_POLLS,
    WORKER_AWAKE,
    ByteRing,
    RingBroken,
    drain_bell,
    rest,
    ring_unless_awake,
    spin_us,
    wait_spin_us,
)

__all__ = ["RING_SUPPORTED", "RingUpgrade", "ring_transport"]

# The first wait for an ack after this side said it may block is at most this long (milliseconds), then the ring is
# looked at again: the worker rings only a client that may block (wire/ring.py's awake words), and were that ever
# missed, an ack is late by this much, never lost.
_RECHECK_MS: Final = 1.0


class _Declined(Exception):
    """The worker answered the ring upgrade with a refusal (``error``), or none was offered: the link is intact."""

    def __init__(self, error: GpuBrokerError) -> None:
        super().__init__(error.message)
        self.error = error


def ring_transport(connect: Connector, token: str, session: str, *, timeout: float | None, fallback: bool,
                   window: int = 4, batch_size: int = 256) -> BatchingTransport:
    """A transport on a same-host Unix link upgraded to the shared-memory ring; opened (hello and upgrade
    answered) here. With ``fallback`` a worker that refuses the upgrade leaves a plain link (``kind`` "unix");
    without it the refusal is raised (Unavailable)."""
    window = min(window, MAX_RING_WINDOW)
    ring = RingRequest(window=window, spin_us=spin_us()) if RING_SUPPORTED else None
    carrier = RingUpgrade(FramedSocket(connect, token, session, kind="ring", timeout=timeout, ring=ring),
                          window=window, fallback=fallback)
    transport = BatchingTransport(carrier, timeout=timeout, window=window, batch_size=batch_size)
    transport.open()
    return transport


class RingUpgrade:
    """The carrier of batches through the ring, over the framed ``link`` it upgrades at each open (whose socket
    stays open: its close says the other side is gone). Where the worker declined the upgrade and ``fallback``
    allows, the link carries the batches itself."""

    def __init__(self, link: FramedSocket, *, window: int, fallback: bool) -> None:
        self.link = link
        self._fallback = fallback
        self._mm: mmap.mmap | None = None
        self._words: memoryview | None = None
        self._bell: socket.socket | None = None  # this side's end of the doorbells' socketpair
        self._commands: ByteRing | None = None
        self._acks: ByteRing | None = None
        self._poller: select.poll | None = None  # the doorbell and the link socket
        self._spin = wait_spin_us() * 1e-6

    @property
    def kind(self) -> str:
        return self.link.kind  # "ring", or "unix" once the worker declined

    @property
    def max_data(self) -> int:
        return self.link.max_data

    @property
    def codec(self) -> str:
        return self.link.codec

    def open(self) -> None:
        link = self.link
        link.kind = "ring"
        link.open()  # (its hello asks for the ring: the front's grant and the worker's answer say how it went)
        try:
            self._map()
            return
        except _Declined as declined:  # the link is a plain one, answered
            self._unmap()
            if self._fallback:
                link.kind = "unix"
                return
            link.shut()
            raise declined.error from None

    def _map(self) -> None:
        """Map the ring the front granted and the worker took; _Declined when there is none."""
        link = self.link
        granted, link.ring = link.ring, None  # (this carrier's to close from now on)
        if granted is None:
            reason = link.ring_declined or "shared-memory rings need Linux (memfd, sealing, SOCK_SEQPACKET)"
            raise _Declined(Unavailable(f"no ring on this link: {reason}"))
        grant, (fd, bell_fd) = granted
        sock = link.sock
        assert sock is not None
        max_frame = link.max_frame
        try:
            self._bell = socket.socket(fileno=bell_fd)
            bell_fd = -1
            self._bell.settimeout(None)  # each call made once (no wait for readiness first, as a timeout has)
            cap, acks = grant.commands, grant.acks
            if min(cap, acks) < max_frame + RECORD_LENGTH.size or os.fstat(fd).st_size != RING_DATA + cap + acks:
                raise _Declined(Unavailable(f"the broker granted a ring of {cap} and {acks} bytes in a memfd of "
                                            f"{os.fstat(fd).st_size}, for frames of {max_frame}"))
            self._mm = mmap.mmap(fd, RING_DATA + cap + acks, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as exc:
            raise _Declined(Unavailable(f"the ring the broker granted could not be mapped: {exc}")) from None
        finally:
            os.close(fd)  # mapped (or not): the descriptor itself is not needed any more
            if bell_fd >= 0:
                os.close(bell_fd)
        words = memoryview(self._mm).cast("Q")
        words[CLIENT_AWAKE] = 1  # (this side looks at the ring before it blocks: _block)
        self._words = words
        self._commands = ByteRing(self._mm, words, RING_DATA, cap, CMD_HEAD * 8, CMD_TAIL * 8, max_frame)
        self._acks = ByteRing(self._mm, words, RING_DATA + cap, acks, ACK_HEAD * 8, ACK_TAIL * 8,
                              acks - RECORD_LENGTH.size)
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

    def send(self, payload: bytes) -> None:
        if self._commands is None:
            self.link.send(payload)
            return
        assert self._bell is not None and self._words is not None
        try:
            if not self._commands.put(payload):  # the window bounds what is in flight: the worker stopped reading
                raise Lost("the worker stopped taking batches from the ring")
            ring_unless_awake(self._words, WORKER_AWAKE, self._bell)  # (a polling worker needs no wake-up)
        except RingBroken as exc:
            raise Lost(f"the command ring is broken: {exc}") from None
        except OSError as exc:
            raise Lost(f"ringing the worker failed: {exc}") from None

    def receive(self, timeout: float | None, in_flight: int, into: memoryview | None = None) -> bytes | bytearray:
        acks = self._acks
        if acks is None:
            return self.link.receive(timeout, in_flight, into)
        # (a ring's records are copied out of shared memory whole: ``into`` would save nothing)
        try:
            payload = acks.get()
            if payload is not None:
                return payload
            if in_flight > 1 or not self._spin:
                # Back-pressure or a drain: what is awaited is not the last batch, and the rest is behind it;
                # spinning would only burn the client's CPU (and the CPU the worker and its device may need).
                return self._block(acks, timeout)
            start = time.perf_counter()
            spin_end = start + (self._spin if timeout is None else min(self._spin, timeout))  # (within the bound)
            while time.perf_counter() < spin_end:
                for _ in range(SPIN_POLLS):
                    if acks.ready():
                        payload = acks.get()
                        if payload is not None:
                            return payload
                os.sched_yield()  # a polite spin: whatever else wants this CPU (the worker, its device) runs
            if timeout is not None:
                timeout = max(timeout - (time.perf_counter() - start), 0.0)  # (the call's bound counts the spin)
            return self._block(acks, timeout)
        except RingBroken as exc:
            raise Lost(f"the ack ring is broken: {exc}") from None

    def arrived(self) -> bytes | bytearray | None:
        acks = self._acks
        if acks is None:
            return self.link.arrived()
        try:
            return acks.get()
        except RingBroken as exc:
            raise Lost(f"the ack ring is broken: {exc}") from None

    @property
    def sees_acks(self) -> bool:
        return self._acks is not None  # (not once the worker declined: a plain link then)

    def _block(self, acks: ByteRing, timeout: float | None) -> bytes:
        """Wait on the doorbell (and the link socket, whose hang-up says the worker is gone) for the next ack.
        This side says it may block first (``rest``, then one more look): from then on the worker rings for each
        ack. The bell is drained after each wake-up and before the ring is looked at again: an ack published
        after that look rings it anew, so none is missed. The first wait is at most _RECHECK: were a ring missed
        after all, it costs that, not a hang."""
        assert self._bell is not None and self.link.sock is not None and self._poller is not None
        assert self._words is not None
        words, bell, sock = self._words, self._bell, self.link.sock.fileno()
        try:
            if rest(words, CLIENT_AWAKE, acks):
                payload = acks.get()
                if payload is not None:
                    return payload
            deadline = None if timeout is None else time.monotonic() + timeout
            cap: float | None = _RECHECK_MS
            while True:
                left = None if deadline is None else max(0.0, deadline - time.monotonic()) * 1000
                wait = cap if left is None else left if cap is None else min(left, cap)
                events = self._poller.poll(wait)
                if not events:
                    if cap is None or (deadline is not None and time.monotonic() >= deadline):
                        raise TimeoutError
                    cap = None  # (the look below, then a plain wait)
                gone = any(fd == sock for fd, _ in events) or not drain_bell(bell)
                payload = acks.get()  # (after a hang-up too: an ack written just before the worker closed the link)
                if payload is not None:
                    return payload
                if gone:
                    raise Lost("the worker closed the link")
        finally:
            words[CLIENT_AWAKE] = 1

    def shut(self) -> None:
        self._unmap()
        self.link.shut()

    def hung_up(self) -> bool:
        return self.link.hung_up()

    def why_lost(self, reason: str) -> GpuBrokerError:
        return self.link.why_lost(reason)
