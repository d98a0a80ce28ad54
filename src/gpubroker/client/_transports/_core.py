"""The one batching core behind every client transport: pending commands, sequence numbers, the window, the
error kept for the next sync. ``BatchingTransport`` owns a ``Carrier``, which only opens a connection, sends
encoded batches and receives encoded acks on one medium (``_grpc.py``, ``_link.py``, ``_ring.py``); everything
else is here, the same on every transport. Striping large copies over further connections of the session is
something a transport is given (``Stripes``), not something a carrier does."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final, Protocol, cast

import lz4.block
import msgspec

from gpubroker.wire.commands import (
    Ack,
    Allocate,
    Batch,
    BufRef,
    Command,
    CommandError,
    Read,
    Write,
    decode_ack,
    decode_read_ack,
    encode,
)
from gpubroker.wire.errors import (
    DeadlineExceeded,
    GpuBrokerError,
    InvalidArgument,
    Unavailable,
    WireError,
    error_from_wire,
)

__all__ = ["ENVELOPE", "BatchingTransport", "Carrier", "Landed", "Lost", "ReadInto", "Stripes", "Transport",
           "command_error", "read_into"]

# What a frame may carry beyond its copy data (the contract's max frame is chunk_bytes + this).
ENVELOPE: Final = 64 * 1024
# On a carrier that cannot see an ack without waiting (a socket, gRPC): the first batch of a burst goes out
# small, so the device starts while the rest of the burst is being built, and queued commands between two looks
# at whether the peer ran everything sent (never true there: they go at a full batch or a wait). A carrier that
# sees acks cheaply (the ring: one read of shared memory) looks at every command: two queued go at once to a peer
# that has answered everything sent, so the device does not idle behind a client still queueing (what queues
# while the worker is busy goes as one batch when it has answered). Two, not one: a lone launch followed by its
# synchronize (or read) goes with it in one round trip, and on the H200 sending it alone cost a launch + sync
# 5 us more; a burst's device queue is then never more than a command's worth of client time behind.
_FIRST_BATCH: Final = 16
_IDLE_LOOK: Final = 64
_RING_FIRST_BATCH: Final = 2
# Chunks sent raw untried after one that lz4 did not shrink by a sixteenth (random data: not worth the CPU).
_RAW_WRITES: Final = 15
# Seconds unused after which a connection is asked whether the broker hung up (idleness, revocation) before a
# batch goes out on it: then it is reopened, and nothing queued is lost.
_QUIET: Final = 1.0
# How many allocations a failed batch did not make a transport remembers (BatchingTransport.never_made).
_UNMADE_MAX: Final = 4096


class Transport(Protocol):
    """How RemoteGpu's device commands reach the worker, in program order, on one connection."""

    @property
    def kind(self) -> str:
        """What carries the commands: "ring" (same host, shared memory), "unix", "tcp", "vsock" (a framed link)
        or "grpc"."""
        ...

    @property
    def max_data(self) -> int:
        """The largest Write or Read chunk one command may carry."""
        ...

    def call(self, command: Command, timeout: float | None = None) -> Any:
        """Send what is queued plus ``command`` as one batch and wait for its ack (one round trip); return the
        command's result. Raises the command's own error, or a deferred one of an earlier command. ``timeout``
        bounds this wait (None: the transport's own bound per ack); past it DeadlineExceeded, and the transport
        goes on (the work still runs; its errors are deferred ones)."""
        ...

    def submit(self, command: Command, on_result: Callable[[Any], None] | None = None) -> int:
        """Queue ``command``; returns its sequence number. ``on_result`` gets its result once acknowledged (the
        command then ends its batch). Blocks while ``window`` batches are unacknowledged (back-pressure)."""
        ...

    def flush(self) -> None: ...

    def wait_for(self, seq: int) -> None:
        """Until command ``seq`` is acknowledged (a pipeline reusing what an earlier command used)."""
        ...

    def wait(self, raise_error: bool = True) -> None:
        """Flush and read every ack; then raise the first kept error (naming its command) if asked."""
        ...

    def copy_in(self, ref: BufRef, offset: int, data: memoryview, stream: str, chunk: int) -> None:
        """Host to device: ``data`` into the view at ``offset``, in Writes of at most ``chunk`` bytes pipelined
        within the window; returns once every one is acknowledged, raising the first error (a deferred one of an
        earlier command too)."""
        ...

    def copy_out(self, ref: BufRef, offset: int, out: memoryview, stream: str, chunk: int) -> None:
        """Device to host: ``out.nbytes`` bytes of the view from ``offset`` into ``out``, as ``copy_in``."""
        ...

    def never_made(self, handle: str) -> bool:
        """Whether a failed batch did not make the allocation ``handle`` (it failed, or came after the failure and
        did not run); forgets it, so the caller drops its free."""
        ...

    def close(self) -> None: ...


class Lost(Exception):
    """The connection failed (closed, reset, refused a frame); ``reason`` says why, for the error raised."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class Carrier(Protocol):
    """One connection's medium under a BatchingTransport: it connects, moves encoded batches one way and encoded
    acks the other, in order, and says why it was lost. The transport calls it under its lock only, one call at
    a time."""

    @property
    def kind(self) -> str:
        """The transport's kind (a ring declined at open leaves a plain link: "unix")."""
        ...

    @property
    def max_data(self) -> int:
        """The largest copy chunk a command may carry: given, or what the open connection's handshake said; a
        batch may be this plus ENVELOPE encoded."""
        ...

    @property
    def codec(self) -> str:
        """What the open connection negotiated for copies' bytes (see wire.commands.CODECS); "" none."""
        ...

    def open(self) -> None:
        """Connect (again); raise the peer's refusal as a GpuBrokerError."""
        ...

    def send(self, payload: bytes) -> None:
        """One encoded Batch; raise Lost if the connection failed."""
        ...

    def receive(self, timeout: float | None, in_flight: int, into: memoryview | None = None) -> bytes | bytearray:
        """The next encoded Ack; raise Lost if the connection failed, TimeoutError after ``timeout``.
        ``in_flight``: the batches unacknowledged, the awaited one included (1: nothing is queued behind it, so
        the answer may be worth spinning for). ``into``: where the bytes go if that Ack answers a raw Read of
        ``len(into)`` bytes; a carrier that can receive them there straight from its medium may, and then
        returns the Ack as ``Landed`` (its result empty); any other may ignore it."""
        ...

    def arrived(self) -> bytes | bytearray | None:
        """The next encoded Ack if it is already here, else None, without waiting (a carrier that cannot tell
        cheaply says None); raise Lost if the connection failed."""
        ...

    @property
    def sees_acks(self) -> bool:
        """Whether ``arrived`` can see an ack at the cost of a memory read (asked after each open): then the core
        looks at every command queued, and sends to a peer that has answered everything at once."""
        ...

    def shut(self) -> None:
        """Drop the connection (no error)."""
        ...

    def hung_up(self) -> bool:
        """Whether the peer closed the idle connection (asked only after a quiet spell)."""
        ...

    def why_lost(self, reason: str) -> GpuBrokerError:
        """The error for a lost connection (a carrier may ask its broker why)."""
        ...


@dataclass(slots=True)
class Stripes:
    """Further connections of the same session that a large copy is dealt over, each link's share sent by a
    thread of its own (given to a TCP link: one TLS connection is one core's encryption, fewer bytes a second
    than a device takes)."""

    count: int  # connections a striped copy uses at most, the transport's own included (1: none)
    min_bytes: int  # a copy smaller than this goes on the transport's own connection
    carrier: Callable[[], Carrier]  # a further connection's carrier, not yet open
    # Connections a striped copy *from* the device uses at most (the first ones of ``count``): its bytes are
    # decrypted here a TLS record (16 KiB) a call, each a turn on this process's GIL, so more threads than this
    # contend for it rather than add (measured on an H200 host: 1.44 GB/s over 2 links, 1.2 over 4).
    reads: int = 2


class Landed(bytes):
    """An encoded Ack to a raw Read whose bytes a carrier received straight into where they go (``receive``'s
    ``into``), encoded with an empty result in their place: its result is delivered already."""


class ReadInto:
    """Where a Read's bytes go (``into``, a part of the caller's memory), once they are checked to be exactly the
    bytes asked for. The result is as ``decode_read_ack`` gives it: a view of the bytes or, with ``codec`` (asked
    of the worker), a ``(codec, view)`` tuple: "" for raw bytes, or the codec, decompressed to exactly the size.
    A carrier may land a raw Read's bytes in ``into`` itself (``Landed``)."""

    __slots__ = ("codec", "into")

    def __init__(self, out: memoryview, start: int, size: int, codec: str = "") -> None:
        self.into = out[start:start + size]
        self.codec = codec

    def __call__(self, data: Any) -> None:
        codec, size = self.codec, len(self.into)
        if codec and type(data) is tuple and data[0] in ("", codec):
            if data[0]:
                try:
                    data = lz4.block.decompress(data[1], uncompressed_size=size) if size else b""
                except lz4.block.LZ4BlockError as exc:
                    raise GpuBrokerError(f"the broker answered a read of {size} bytes with a bad lz4 block: "
                                         f"{exc}") from None
            else:
                data = data[1]
        if not isinstance(data, (bytes, memoryview)) or len(data) != size:  # (bytes: decompressed)
            got = len(data) if isinstance(data, (bytes, memoryview)) else type(data).__name__
            raise GpuBrokerError(f"the broker answered a read of {size} bytes with {got}")
        self.into[:] = data


def read_into(out: memoryview, start: int, size: int, codec: str = "") -> ReadInto:
    """Where a Read's bytes go: ``size`` bytes of ``out`` from ``start`` (see ``ReadInto``)."""
    return ReadInto(out, start, size, codec)


def command_error(e: CommandError, own: bool) -> GpuBrokerError:
    """The error of a failed command: as its own call's error (``own``), or deferred, naming the command."""
    message = e.message if own else f"command {e.seq} ({e.command}) failed: {e.message}"
    return error_from_wire(WireError(e.code, message, e.type, {**e.details, "seq": e.seq, "command": e.command}))


@dataclass(slots=True)
class _Sent:
    id: int
    first: int
    count: int
    on_result: Callable[[Any], None] | None
    call_seq: int  # the sequence number of the call waiting for this batch, else 0
    commands: list[Command]  # (what a failure at one of them left not run)


class BatchingTransport:
    """The batching core over one ``carrier``: the carrier connects and moves bytes; this orders, batches, bounds
    and reports. With ``stripes``, copies of ``stripes.min_bytes`` or more are dealt over further connections.

    Thread-safe (one lock serializes callers: a RemoteGpu may be shared by threads), yet with no thread of its
    own on the hot path: the caller's thread sends, and acks are read when the window is full or at a sync point.
    """

    def __init__(self, carrier: Carrier, *, timeout: float | None, window: int = 4, batch_size: int = 256,
                 stripes: Stripes | None = None) -> None:
        self.carrier = carrier
        self.timeout = timeout  # bounds the wait for each ack (an ack may be a long kernel away)
        self.stripes = stripes
        self._more: list[BatchingTransport] = []  # the session's further connections for striped copies
        self._raw_writes = 0  # chunks left to send raw untried (see write_command)
        self.window = window
        self.batch_size = batch_size
        self._lock = threading.RLock()
        self._pending: list[Command] = []
        self._pending_result: Callable[[Any], None] | None = None
        self._seq = 0  # the last sequence number given out
        self._next_id = 1  # batch ids start at 1: an ack with id 0 refuses a malformed frame
        self._unacked: deque[_Sent] = deque()
        self._error: GpuBrokerError | None = None  # the first deferred failure, raised at the next sync
        self._call_error: GpuBrokerError | None = None
        # Allocations a failed batch did not make: freeing one sends nothing (a Free would fail NOT_FOUND at the
        # next wait, after the failure was already raised). Bounded: past _UNMADE_MAX the oldest are forgotten.
        self._unmade: dict[str, None] = {}
        self._open_now = False
        self._closed = False
        self._last = time.monotonic()
        self._first, self._look = _FIRST_BATCH, _IDLE_LOOK  # (set from the carrier at each open: _opened)

    # -- what the carrier says -----------------------------------------------------------------
    @property
    def kind(self) -> str:
        return self.carrier.kind

    @property
    def max_data(self) -> int:
        return self.carrier.max_data

    @property
    def max_frame(self) -> int:
        """The largest encoded batch the peer takes."""
        return self.carrier.max_data + ENVELOPE

    @property
    def codec(self) -> str:
        return self.carrier.codec

    def open(self) -> None:
        """Connect now rather than at the first batch, so that a refusal (a link's hello) is raised here."""
        with self._lock:
            if not self._open_now:
                self.carrier.open()
                self._opened()

    # -- the caller's side -----------------------------------------------------------------------
    def submit(self, command: Command, on_result: Callable[[Any], None] | None = None) -> int:
        with self._lock:
            if on_result is None and type(command) is not Write:  # the hot path: one more queued command
                self._seq += 1
                pending = self._pending
                pending.append(command)
                n = len(pending)
                # Past the first batch's size, once the peer ran everything sent (looked at every ``_look``
                # commands), what is queued goes now rather than at a full batch: the worker (and its device) do
                # not wait on a client still queueing.
                if n >= self.batch_size or (n >= self._first and (
                        not self._unacked or (n % self._look == 0 and self._idle_peer()))):
                    self._flush()
                return self._seq
            if type(command) is Write and self._pending:
                self._flush()  # a chunk of copy data rides alone: a frame stays within max_data + 64 KiB
            self._seq += 1
            self._pending.append(command)
            self._pending_result = on_result
            self._flush()  # a result is only ever the last command's; a Write rides alone
            return self._seq

    def call(self, command: Command, timeout: float | None = None) -> Any:
        box: list[Any] = []
        with self._lock:
            self._seq += 1
            seq = self._seq
            self._pending.append(command)
            self._pending_result = box.append
            end = None if timeout is None else time.monotonic() + timeout
            try:
                # (the wait for room in the window is this call's too: bounded by its own timeout)
                sent = self._flush(call_seq=seq, end=end, limit=timeout)
                while sent is not None and self._unacked and self._unacked[0].id <= sent.id:
                    self._read_ack(end, timeout)
            except DeadlineExceeded:
                if self._pending and self._pending[-1] is command:
                    # No room within the bound, so nothing was sent: the queued commands stay queued for the next
                    # flush, and this call's own command, which nobody waits for any more, goes.
                    self._pending.pop()
                    self._seq -= 1
                    self._pending_result = None
                # Nobody waits for this call's batches any more: what they report is an earlier command's error
                # for the next call that waits, as for any queued command.
                for waiting in self._unacked:
                    if waiting.call_seq == seq:
                        waiting.call_seq, waiting.on_result = 0, None
                raise
            own, self._call_error = self._call_error, None
            if own is not None:
                # An earlier command's failure, deferred, comes first in program order: as in a synchronous run it
                # is what is raised (the call's own failure most likely follows from it: a handle never made).
                self._raise_kept()
                raise own
            self._raise_kept()
            return box[0] if box else None

    def flush(self) -> None:
        with self._lock:
            self._flush()

    def wait_for(self, seq: int) -> None:
        """Flush and read acks until command ``seq``'s batch is acknowledged (its result delivered); errors stay
        kept for the next sync."""
        with self._lock:
            if self._pending and seq > self._seq - len(self._pending):
                self._flush()
            while self._unacked and self._unacked[0].first <= seq:
                self._read_ack()

    def wait(self, raise_error: bool = True) -> None:
        with self._lock:
            self._flush()
            while self._unacked:
                self._read_ack()
            if raise_error:
                self._raise_kept()

    def write_command(self, ref: BufRef, offset: int, data: memoryview, stream: str) -> Write:
        """One chunk's Write: where the link negotiated lz4, its bytes as an lz4 block when that shrinks them by a
        useful part (random data would not: then raw, and the next chunks raw untried for a while)."""
        if self.codec and data.nbytes:
            if self._raw_writes > 0:
                self._raw_writes -= 1
            else:
                block = lz4.block.compress(data, store_size=False)
                if len(block) <= data.nbytes - (data.nbytes >> 4):
                    return Write(ref, offset, block, stream, self.codec, data.nbytes)
                self._raw_writes = _RAW_WRITES
        return Write(ref, offset, cast("bytes", data), stream)  # (encoded straight from the caller's buffer)

    def copy_in(self, ref: BufRef, offset: int, data: memoryview, stream: str, chunk: int) -> None:
        stripes = self.stripes
        if stripes is not None and stripes.count > 1 and data.nbytes >= stripes.min_bytes:
            def write(link: BatchingTransport, start: int, size: int) -> None:
                link.submit(link.write_command(ref, offset + start, data[start:start + size], stream))

            self._striped(data.nbytes, chunk, write)
            return
        with self._lock:
            for start in range(0, max(data.nbytes, 1), chunk):
                # (each chunk's bytes encoded straight from the caller's buffer: msgspec takes a memoryview)
                self.submit(self.write_command(ref, offset + start, data[start:start + chunk], stream))
            self.wait(raise_error=True)

    def copy_out(self, ref: BufRef, offset: int, out: memoryview, stream: str, chunk: int) -> None:
        stripes = self.stripes
        if stripes is not None and min(stripes.count, stripes.reads) > 1 and out.nbytes >= stripes.min_bytes:
            def read(link: BatchingTransport, start: int, size: int) -> None:
                link.submit(Read(ref, offset + start, size, stream, link.codec),
                            on_result=read_into(out, start, size, link.codec))

            self._striped(out.nbytes, chunk, read, min(stripes.count, stripes.reads))
            return
        with self._lock:
            for start in range(0, max(out.nbytes, 1), chunk):
                n = min(chunk, out.nbytes - start)
                self.submit(Read(ref, offset + start, n, stream, self.codec),
                            on_result=read_into(out, start, n, self.codec))
            self.wait(raise_error=True)

    def close(self) -> None:
        with self._lock:
            more, self._more = self._more, []
        for link in more:
            link.close()
        with self._lock:
            self._closed = True
            self._pending.clear()
            self._unacked.clear()
            if self._open_now:
                self._open_now = False
                self.carrier.shut()

    # -- striped copies ----------------------------------------------------------------------------
    def _striped(self, size: int, chunk: int, send: Callable[[BatchingTransport, int, int], None],
                 count: int | None = None) -> None:
        """The copy's chunks dealt round-robin over this connection and the session's others (``count`` in all at
        most), each one's share sent by a thread of its own and pipelined within that connection's window; in
        program order with the commands around it: those queued before it are acknowledged first, and it returns
        once every chunk is."""
        with self._lock:
            self.wait(raise_error=False)  # (an earlier command's error stays kept: raised at the end, as unstriped)
            links = [self, *self._stripe_links()][:count]
            errors: list[GpuBrokerError | None] = [None] * len(links)

            def share(k: int) -> None:
                link = links[k]
                try:
                    for start in range(k * chunk, size, len(links) * chunk):
                        send(link, start, min(chunk, size - start))
                    link.wait(raise_error=True)
                except GpuBrokerError as exc:
                    errors[k] = exc
                    link.wait(raise_error=False)  # (nothing of this copy left unacknowledged on the link)

            threads = [threading.Thread(target=share, args=(k,), name="gpubroker-stripe", daemon=True)
                       for k in range(1, len(links))]
            for thread in threads:
                thread.start()
            try:
                share(0)
            finally:
                for thread in threads:
                    thread.join()
            failed = next((e for e in errors if e is not None), None)
            if failed is not None:
                raise failed
            self._raise_kept()

    def _stripe_links(self) -> list[BatchingTransport]:
        """The session's further connections (opened once; one that cannot be opened now is done without)."""
        stripes = self.stripes
        assert stripes is not None
        while len(self._more) < stripes.count - 1:
            link = BatchingTransport(stripes.carrier(), timeout=self.timeout, window=self.window,
                                     batch_size=self.batch_size)
            try:
                link.open()
            except GpuBrokerError:
                break
            self._more.append(link)
        return self._more

    # -- the core --------------------------------------------------------------------------------
    def _raise_kept(self) -> None:
        error, self._error = self._error, None
        if error is not None:
            raise error

    def _flush(self, call_seq: int = 0, end: float | None = None, limit: float | None = None) -> _Sent | None:
        """Send what is queued as one batch (two, if too large for one frame). A call's own bound (``end``,
        ``limit``: ``_read_ack``'s) bounds its wait for room in the window; past it DeadlineExceeded, with what was
        not sent back on the queue (``_send_batch``)."""
        if not self._pending:
            return None
        commands, self._pending = self._pending, []
        on_result, self._pending_result = self._pending_result, None
        if self._closed:
            raise Unavailable(f"this {self.kind} transport is closed")
        if self._open_now and not self._unacked and time.monotonic() - self._last > _QUIET \
                and self.carrier.hung_up():
            self._drop()  # closed by the broker while idle: reopened below, nothing lost
        if not self._open_now:
            self.carrier.open()  # (refused: these commands never went out, and the refusal says why)
            self._opened()
        return self._send_batch(commands, self._seq - len(commands) + 1, on_result, call_seq, end, limit)

    def _send_batch(self, commands: list[Command], first: int, on_result: Callable[[Any], None] | None,
                    call_seq: int, end: float | None = None, limit: float | None = None) -> _Sent | None:
        """Send ``commands`` as a batch (two halves, in order, if too large for a frame), each once the window has
        room; waiting for it past a call's bound raises DeadlineExceeded with what was not sent back on the
        queue, in order, ahead of anything queued after."""
        payload = encode(Batch(self._next_id, first, commands))
        if len(payload) > self.carrier.max_data + ENVELOPE:  # (max_frame, without a property's call)
            if len(commands) > 1:  # (many launches with long argument lists): two batches, in order
                half = len(commands) // 2
                try:
                    if self._send_batch(commands[:half], first, None, 0, end, limit) is None:
                        return None
                except DeadlineExceeded:
                    self._pending[half:half] = commands[half:]  # (after the first half, which went back)
                    self._pending_result = on_result
                    raise
                return self._send_batch(commands[half:], first + half, on_result, call_seq, end, limit)
            self._keep(InvalidArgument(f"command {first} ({type(commands[0]).__name__}) is {len(payload)} bytes "
                                       f"encoded, more than the {self.max_frame} a batch may be"), call_seq)
            return None
        try:
            while len(self._unacked) >= self.window and self._open_now:
                self._read_ack(end, limit)  # back-pressure: the worker is `window` batches behind
        except DeadlineExceeded:
            self._pending[:0] = commands  # (not sent: queued again, for the next flush)
            self._pending_result = on_result
            raise
        if not self._open_now:
            # Lost while waiting for room: the loss is kept; these commands are reported lost with it.
            return None
        sent = _Sent(self._next_id, first, len(commands), on_result, call_seq, commands)
        self._next_id += 1
        try:
            self.carrier.send(payload)
        except Lost as exc:
            self._lose(exc.reason, call_seq)
            return None
        self._unacked.append(sent)
        self._last = time.monotonic()
        return sent

    def _opened(self) -> None:
        self._open_now = True
        # (a ring the worker declined leaves a plain link: asked at each open)
        self._first, self._look = (_RING_FIRST_BATCH, 1) if self.carrier.sees_acks else (_FIRST_BATCH, _IDLE_LOOK)

    def _idle_peer(self) -> bool:
        """Whether every batch sent is acknowledged, reading the acks already here without waiting."""
        while self._unacked:
            try:
                payload = self.carrier.arrived()
            except Lost as exc:
                self._lose(exc.reason, self._unacked[0].call_seq)
                return False
            if payload is None:
                return False
            self._take_ack(payload)
        return self._open_now

    def _read_ack(self, end: float | None = None, limit: float | None = None) -> None:
        """Read the next ack: within ``self.timeout``, or until ``end`` (monotonic) for a call that set its own
        ``limit``. Past it DeadlineExceeded, and the connection stays: the batch is still unacknowledged, and its
        ack, when it comes, is read as its own (acks come in order, each naming its batch)."""
        if end is None:
            wait = limit = self.timeout
        else:
            wait = max(1e-3, end - time.monotonic())  # (0 would make a socket's recv non-blocking)
        # (a raw Read's bytes may be received straight into where they go: no buffer of its own, no copy)
        reading = self._unacked[0].on_result
        into = reading.into if type(reading) is ReadInto and not reading.codec else None
        try:
            payload = self.carrier.receive(wait, len(self._unacked), into)
        except TimeoutError:
            waiting = self._unacked[0]
            raise DeadlineExceeded(
                f"no answer from the broker within {limit:g} s (batch of {waiting.count} commands from command "
                f"{waiting.first}): the work is still running and the session goes on. Wait again (synchronize, "
                "with a longer timeout=), or cancel() the session to abandon it") from None
        except Lost as exc:
            self._lose(exc.reason, self._unacked[0].call_seq if self._unacked else 0)
            return
        self._take_ack(payload)

    def _take_ack(self, payload: bytes | bytearray) -> None:
        self._last = time.monotonic()
        sent = self._unacked[0]
        last = sent.commands[-1] if sent.commands else None
        try:
            # (a raw Read's bytes as a view of the payload: copied once, where they go; landed: not even that)
            ack = decode_read_ack(payload) if type(last) is Read and type(payload) is not Landed \
                else decode_ack(payload)
        except msgspec.DecodeError as exc:
            self._lose(f"a malformed acknowledgement ({exc})", sent.call_seq)
            return
        if ack.id == 0 and ack.error is not None:  # the worker refused a frame of ours, then closed the link
            self._keep(command_error(ack.error, own=False), sent.call_seq)
            self._drop()
            return
        if ack.id != sent.id or not 0 <= ack.done <= sent.count or (ack.error is None) != (ack.done == sent.count) \
                or (ack.error is not None and ack.error.seq != sent.first + ack.done):
            self._lose(f"an acknowledgement out of step (batch {ack.id}, {ack.done} done; expected batch "
                       f"{sent.id} of {sent.count})", sent.call_seq)
            return
        self._unacked.popleft()
        if type(payload) is Landed and ack.error is None:
            return  # (its bytes are where they go: the carrier checked the Ack answers a read of just as many)
        self._note(ack, sent)

    def never_made(self, handle: str) -> bool:
        with self._lock:
            if handle not in self._unmade:
                return False
            del self._unmade[handle]
            return True

    def _note(self, ack: Ack, sent: _Sent) -> None:
        if ack.error is not None:
            for command in sent.commands[ack.done:]:
                if isinstance(command, Allocate):
                    if len(self._unmade) >= _UNMADE_MAX:
                        del self._unmade[next(iter(self._unmade))]
                    self._unmade[command.handle] = None
            own = ack.error.seq == sent.call_seq
            error = command_error(ack.error, own)
            if own:
                self._call_error = error
            elif self._error is None:
                self._error = error
            return
        if sent.on_result is not None:
            try:
                sent.on_result(ack.result)
            except GpuBrokerError as exc:  # a result that is not what was asked for (a Read's byte count)
                self._keep(exc, sent.call_seq)

    def _keep(self, error: GpuBrokerError, call_seq: int) -> None:
        if call_seq:
            self._call_error = error
        elif self._error is None:
            self._error = error

    def _lose(self, reason: str, call_seq: int) -> None:
        """The connection failed: every unacknowledged batch may not have run, which the next sync must not hide.
        The next batch opens a new connection (or fails saying why it cannot)."""
        unacked = sum(s.count for s in self._unacked)
        self._drop()
        if unacked:
            reason = f"{reason} ({unacked} commands unacknowledged: they may not have run)"
        self._keep(self.carrier.why_lost(reason), call_seq)

    def _drop(self) -> None:
        self._unacked.clear()
        if self._open_now:
            self._open_now = False
            self.carrier.shut()

