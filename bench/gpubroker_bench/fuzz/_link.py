"""Fuzz the framed link (issue 13): raw Batch frames straight to a session's worker, on the Unix socket
``<socket>.fast`` and on the TCP link (``link_listen``, TLS terminated by the front).

A case opens one connection: garbage, a hostile hello, or a valid hello followed by frames drawn from
hypothesis-built commands (valid ones, and ones naming foreign, unknown or reused handles, huge sizes, commands
that only the front may run), malformed msgpack, wrong types, frames over the announced maximum and frames cut
short. The promises checked: the hello is refused unless it is right; every whole frame is answered, in order,
by one Ack for its batch (``done`` and the error's sequence number consistent, the error's status documented, a
Read's result exactly its size, the bytes it returns those the case wrote); a malformed frame then gets an Ack
with id 0 and INVALID_ARGUMENT, and the link is closed; the link is closed (never left hanging) when the client
stops; and after every case a fresh link on the same session still works and frees what the case left, so the
session's memory comes back to nothing.
"""

from __future__ import annotations

import contextlib
import socket
import ssl
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgpack
import msgspec
import numpy as np
from hypothesis import strategies as st

from gpubroker.wire import commands as proto
from gpubroker_bench.fuzz._model import ALLOWED_CODES, Buf
from gpubroker_bench.fuzz._raw import junk
from gpubroker_bench.fuzz._values import dtypes

__all__ = ["LinkFuzzer", "LinkTarget", "LinkVictims", "open_link_session"]

Draw = Callable[..., Any]
_HEADER = struct.Struct("!I")
# Launch extents the device takes at once (a fuzzed launch must not occupy it for long) or refuses at once.
_EXTENTS = [1, 1, 2, 3, 4, 0, -1, 2**32, 2**63 - 1]
_BLOCKS = [1, 2, 64, 256, 0, -1, 4096, 2**32]
_SIZES = [1, 4, 64, 100, 4096, 8192, 0]
_HUGE = [2**31, 2**40, 2**62, 2**63 - 1]


@dataclass(frozen=True)
class LinkTarget:
    """Where a link is opened: a Unix socket path, or a TCP address with the TLS context to reach it."""

    name: str  # "unix" or "tcp"
    unix_path: str = ""
    address: tuple[str, int] = ("", 0)
    tls: ssl.SSLContext | None = None

    def connect(self, timeout: float) -> socket.socket:
        if self.unix_path:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(timeout)
            sock.connect(self.unix_path)
            return sock
        raw = socket.create_connection(self.address, timeout=timeout)
        if self.tls is None:
            return raw
        try:
            return self.tls.wrap_socket(raw, server_hostname=self.address[0])
        except BaseException:
            raw.close()
            raise


class _Reader:
    """Whole frames off a socket; ``None`` at a clean end of stream; a torn frame or a silent peer fails."""

    def __init__(self, sock: socket.socket, where: str) -> None:
        self.sock = sock
        self.where = where
        self.buf = bytearray()
        self.eof = False

    def frame(self) -> bytes | None:
        while True:
            if len(self.buf) >= _HEADER.size:
                (n,) = _HEADER.unpack_from(self.buf)
                if len(self.buf) >= _HEADER.size + n:
                    payload = bytes(self.buf[_HEADER.size:_HEADER.size + n])
                    del self.buf[:_HEADER.size + n]
                    return payload
            if self.eof:
                if self.buf:
                    raise AssertionError(f"{self.where}: a torn reply ({len(self.buf)} bytes) before the close")
                return None
            try:
                data = self.sock.recv(1 << 16)
            except TimeoutError:
                raise AssertionError(f"{self.where}: neither answered nor closed in time") from None
            except (ConnectionResetError, ssl.SSLError):  # (a TLS peer that closes without close_notify)
                data = b""
            if not data:
                self.eof = True
            self.buf += data


@dataclass
class _Live:
    """What the case's link session holds, by the Acks: commands[:done] of each batch ran."""

    bufs: dict[str, int] = field(default_factory=dict)  # handle -> size
    streams: set[str] = field(default_factory=set)
    # What the case's commands allocated or created so far, whether that ran or not: what later ones name.
    named_bufs: set[str] = field(default_factory=set)
    named_streams: set[str] = field(default_factory=set)
    # Each live buffer's bytes where they are known (written on the default stream, in order). A buffer that work
    # on another stream wrote is racy (that stream is not ordered with the default one): never checked again.
    shadow: dict[str, Buf] = field(default_factory=dict)
    racy: set[str] = field(default_factory=set)
    reads_checked: int = 0

    def _span(self, ref: tuple[str, int], offset: int, n: int) -> tuple[Buf, int, int] | None:
        buf = self.shadow.get(ref[0])
        if buf is None:
            return None
        start = min(ref[1] + offset, buf.size)
        return buf, start, max(0, min(n, buf.size - start))

    def ran(self, command: proto.Command) -> None:
        """The effect of a command that ran (the fuzz kernels have none)."""
        if isinstance(command, proto.Allocate):
            self.bufs[command.handle] = command.size
            self.shadow[command.handle] = Buf(command.handle, command.size)  # (its bytes are unknown)
            self.racy.discard(command.handle)
        elif isinstance(command, proto.Free):
            self.bufs.pop(command.handle, None)
            self.shadow.pop(command.handle, None)
        elif isinstance(command, proto.CreateStream):
            self.streams.add(command.handle)
        elif isinstance(command, proto.DestroyStream):
            self.streams.discard(command.handle)
        elif isinstance(command, proto.Memset | proto.Write | proto.CopyD2D):
            dst = command.dst if isinstance(command, proto.CopyD2D) else command.buf
            if command.stream:
                self.racy.add(dst[0])
                return
            if isinstance(command, proto.Memset):
                buf = self.shadow.get(dst[0])
                n = (buf.size - dst[1] - command.offset) if buf and command.size == -1 else command.size
                span = self._span(dst, command.offset, n)
                if span:
                    span[0].set(span[1], bytes([command.value]) * span[2])
            elif isinstance(command, proto.Write):
                span = self._span(dst, command.offset, len(command.data))
                if span:
                    span[0].set(span[1], command.data[:span[2]])
            else:
                span = self._span(dst, command.dst_offset, command.size)
                src = self._span(command.src, command.src_offset, command.size)
                if span and src and command.src[0] not in self.racy:
                    sbuf, start, n = src[0], src[1], min(src[2], span[2])
                    span[0].set(span[1], bytes(sbuf.data[start:start + n]), bytes(sbuf.known[start:start + n]))
                elif span:
                    self.racy.add(dst[0])

    def failed(self, command: proto.Command) -> None:
        """A command that failed may have written part of what it names: those bytes are unknown now."""
        if isinstance(command, proto.Memset | proto.Write | proto.CopyD2D):
            self.racy.add((command.dst if isinstance(command, proto.CopyD2D) else command.buf)[0])

    def mismatch(self, read: proto.Read, got: bytes) -> int | None:
        """Where a default-stream Read of a buffer whose bytes are known differs from them, if it does."""
        if read.stream or read.buf[0] in self.racy:
            return None
        span = self._span(read.buf, read.offset, len(got))
        if not span or span[2] != len(got):
            return None
        self.reads_checked += 1
        return span[0].mismatch(span[1], got)


@dataclass
class _Frame:
    data: bytes  # header included
    batch: proto.Batch | None  # decodable: it must be answered by an Ack naming it
    kind: str  # "batch", "malformed", "huge", "torn"


class LinkFuzzer:
    """``case(draw, target)`` runs one hypothesis-drawn connection against the session ``session``."""

    def __init__(self, token: str, session: str, kernels: dict[str, str], foreign: list[str],
                 observe: Callable[[str, str, str], Any], *, timeout: float = 10.0) -> None:
        self.token = token
        self.session = session  # a session of the tenant owning ``token``, holding only the fuzz kernels
        self.kernels = kernels  # kernel name -> handle, in ``session``
        self.foreign = foreign  # live handles of other sessions (another tenant's, and the same tenant's)
        self.observe = observe
        self.timeout = timeout
        self.cases = 0
        self.acks = 0
        self.closed = 0  # hostile hellos answered by a close rather than a refusal
        self.reads_checked = 0  # reads whose bytes the case knew (besides each case's probe)
        self._next_id = 1
        self._seq = 0

    # -- drawing commands -----------------------------------------------------------------------------------------
    def _handle(self, draw: Draw, live: list[str], kind: str) -> str:
        how = draw(st.sampled_from(["live", "live", "fresh", "foreign", "junk"] if live
                                   else ["fresh", "fresh", "foreign", "junk"]))
        if how == "live":
            return str(draw(st.sampled_from(live)))
        if how == "foreign" and self.foreign:
            return str(draw(st.sampled_from(self.foreign)))
        if how == "junk":
            return str(draw(st.one_of(st.text(min_size=1, max_size=proto.MAX_HANDLE),
                                      st.sampled_from(["b", "bzz", "k0", "s" * proto.MAX_HANDLE]))))
        return proto.new_handle(kind)

    def _ref(self, draw: Draw, live: _Live) -> tuple[str, int]:
        return self._handle(draw, sorted(live.named_bufs), "buf"), draw(st.sampled_from([0, 0, 0, 128, 4096, 2**40]))

    def _stream(self, draw: Draw, live: _Live) -> str:
        return str(draw(st.sampled_from(["", "", "", *sorted(live.named_streams), "s" + "0" * 16, "nope"])))

    def _size(self, draw: Draw) -> int:
        return int(draw(st.one_of(st.sampled_from(_SIZES), st.sampled_from(_HUGE), st.integers(1, 5000))))

    def _arg(self, draw: Draw, live: _Live) -> proto.KernelArg:
        if draw(st.booleans()):
            handle, offset = self._ref(draw, live)
            return proto.BufferArg(handle, offset)
        return proto.ScalarArg(draw(dtypes()).encode("utf-8", "replace")[:16].decode("utf-8", "ignore"),
                               draw(st.binary(max_size=8)))

    def _command(self, draw: Draw, live: _Live) -> proto.Command:
        op = draw(st.sampled_from(["allocate"] * 3 + ["free", "memset", "copy_d2d", "launch", "launch", "write",
                                                      "write", "read", "read", "create_stream", "destroy_stream",
                                                      "synchronize", "copy_shared", "device_info", "front_only"]))
        if op == "allocate":
            allocate = proto.Allocate(self._handle(draw, sorted(live.named_bufs), "buf"),
                                      draw(st.one_of(st.sampled_from([64, 4096, 65536, 1 << 20]),
                                                     st.sampled_from(_HUGE), st.integers(1, 8192))))
            live.named_bufs.add(allocate.handle)  # (later commands of the case name it, allocated or not)
            return allocate
        if op == "free":
            return proto.Free(self._handle(draw, sorted(live.named_bufs), "buf"))
        if op == "memset":
            return proto.Memset(self._ref(draw, live), draw(st.integers(0, 255)),
                                draw(st.one_of(st.just(-1), st.integers(-3, 5000), st.sampled_from(_HUGE))),
                                draw(st.sampled_from([0, 0, 64, 4096, 2**40])), self._stream(draw, live))
        if op == "copy_d2d":
            return proto.CopyD2D(self._ref(draw, live), self._ref(draw, live), self._size(draw),
                                 draw(st.sampled_from([0, 0, 64, 2**40])), draw(st.sampled_from([0, 0, 64, 2**40])),
                                 self._stream(draw, live))
        if op == "launch":
            names = sorted(self.kernels)
            kernel = (self.kernels[draw(st.sampled_from(names))] if names and draw(st.integers(0, 3))
                      else self._handle(draw, [], "kernel"))
            dims = st.lists(st.sampled_from(_EXTENTS), min_size=1, max_size=3).map(tuple)
            blocks = st.lists(st.sampled_from(_BLOCKS), min_size=1, max_size=3).map(tuple)
            return proto.Launch(kernel, draw(dims), draw(blocks),
                                [self._arg(draw, live) for _ in range(draw(st.integers(0, 5)))],
                                draw(st.sampled_from([0, 0, 64, 1 << 20, 2**40])), self._stream(draw, live))
        if op == "write":
            data = draw(st.one_of(st.binary(min_size=1, max_size=256), st.binary(max_size=256),
                                  st.sampled_from([b"", b"\x00" * 4096, b"\xab" * 100_000])))
            return proto.Write(self._ref(draw, live), draw(st.sampled_from([0, 0, 1, 64, 4095, 2**40])), data,
                               self._stream(draw, live))
        if op == "read":
            return proto.Read(self._ref(draw, live), draw(st.sampled_from([0, 0, 1, 64, 4095, 2**40])),
                              self._size(draw), self._stream(draw, live))
        if op == "create_stream":
            create = proto.CreateStream(self._handle(draw, sorted(live.named_streams), "stream"))
            live.named_streams.add(create.handle)
            return create
        if op == "destroy_stream":
            return proto.DestroyStream(self._handle(draw, sorted(live.named_streams), "stream"))
        if op == "synchronize":
            return proto.Synchronize(self._stream(draw, live))
        if op == "copy_shared":
            return proto.CopyShared(self._handle(draw, [], "segment"), 0, self._ref(draw, live), 0,
                                    self._size(draw), draw(st.booleans()), self._stream(draw, live))
        if op == "device_info":
            return proto.DeviceInfoQuery()
        # Commands the front must supervise (a compile needs its time limit): refused on a link.
        which = draw(st.sampled_from(["load", "unload", "get"]))
        if which == "load":
            return proto.LoadModule(proto.new_handle("module"), "opencl_c", b"__kernel void k(void) {}")
        if which == "unload":
            return proto.UnloadModule(proto.new_handle("module"))
        return proto.GetKernel(proto.new_handle("kernel"), proto.new_handle("module"), "k")

    def _round_trip(self, draw: Draw, live: _Live) -> list[proto.Command]:
        """Writes and memsets of one buffer (allocated first when new), then a read back of part of it."""
        commands: list[proto.Command] = []
        handle = draw(st.sampled_from([*sorted(live.named_bufs), "new"]))
        if handle == "new":
            handle = proto.new_handle("buf")
            commands.append(proto.Allocate(handle, draw(st.sampled_from([64, 256, 4096]))))
            live.named_bufs.add(handle)
        for _ in range(draw(st.integers(1, 3))):
            offset = draw(st.sampled_from([0, 1, 17, 63]))
            if draw(st.booleans()):
                commands.append(proto.Write((handle, 0), offset, draw(st.binary(min_size=1, max_size=200))))
            else:
                commands.append(proto.Memset((handle, 0), draw(st.integers(0, 255)),
                                             draw(st.sampled_from([1, 7, 40, -1])), offset))
        commands.append(proto.Read((handle, 0), draw(st.sampled_from([0, 0, 16])),
                                   draw(st.sampled_from([1, 16, 48]))))
        return commands

    def _batch(self, draw: Draw, live: _Live) -> proto.Batch:
        if draw(st.integers(0, 3)) == 0:
            commands = self._round_trip(draw, live)
        else:
            commands = [self._command(draw, live) for _ in range(draw(st.integers(0, 6)))]
        if live.named_bufs and draw(st.integers(0, 2)) == 0:  # end with a plausible read of a buffer it named
            handle = draw(st.sampled_from(sorted(live.named_bufs)))
            commands.append(proto.Read((handle, draw(st.sampled_from([0, 0, 128]))),
                                       draw(st.sampled_from([0, 0, 1, 64])), draw(st.sampled_from([1, 16, 64, 1000]))))
        batch = proto.Batch(self._next_id, self._seq, commands)
        self._next_id += 1
        self._seq += len(commands)
        return batch

    def _frames(self, draw: Draw, live: _Live, max_frame: int) -> list[_Frame]:
        frames: list[_Frame] = []
        for _ in range(draw(st.integers(1, 6))):
            kind = draw(st.sampled_from(["batch"] * 6 + ["bytes", "junk", "wrong_types", "huge", "torn"]))
            if kind == "batch":
                payload = proto.encode(self._batch(draw, live))
            elif kind == "bytes":
                payload = draw(st.binary(max_size=48))
            elif kind == "junk":
                payload = msgpack.packb(draw(junk), use_bin_type=True)
            elif kind == "wrong_types":  # batch-shaped, with a field of the wrong type or out of range
                good = msgspec.msgpack.decode(proto.encode(self._batch(draw, live)))
                good[draw(st.integers(0, 2))] = draw(junk)
                payload = msgpack.packb(good, use_bin_type=True)
            elif kind == "huge":  # a header over the link's maximum: refused before its payload is read
                frames.append(_Frame(_HEADER.pack(draw(st.sampled_from([max_frame + 1, 2**31, 2**32 - 1])))
                                     + draw(st.binary(max_size=16)), None, "huge"))
                break
            else:  # cut short: the header promises more than ever comes
                body = draw(st.binary(max_size=32))
                frames.append(_Frame(_HEADER.pack(len(body) + draw(st.integers(1, 1000))) + body, None, "torn"))
                break
            if len(payload) > max_frame:  # (a batch of several large writes)
                frames.append(_Frame(_HEADER.pack(len(payload)) + payload, None, "huge"))
                break
            try:  # the one decoder says what the worker must make of it (random bytes may happen to be a batch)
                batch = proto.decode_batch(payload)
            except msgspec.DecodeError:
                frames.append(_Frame(_HEADER.pack(len(payload)) + payload, None, "malformed"))
                break
            frames.append(_Frame(_HEADER.pack(len(payload)) + payload, batch, "batch"))
        return frames

    # -- one connection -------------------------------------------------------------------------------------------
    def _hello(self, sock: socket.socket, reader: _Reader, where: str) -> int:
        sock.sendall(_frame({"token": self.token, "session": self.session, "link": 1}))
        reply = reader.frame()
        if reply is None:
            raise AssertionError(f"{where}: a valid hello got no answer")
        decoded = msgpack.unpackb(reply, raw=False, strict_map_key=False)
        if not (isinstance(decoded, list) and len(decoded) == 3 and decoded[:2] == [0, 0]
                and isinstance(decoded[2], dict) and decoded[2].get("link") == 1
                and isinstance(decoded[2].get("max_frame"), int) and decoded[2]["max_frame"] > 0):
            raise AssertionError(f"{where}: a valid hello got {decoded!r}")
        return int(decoded[2]["max_frame"])

    def case(self, draw: Draw, target: LinkTarget) -> None:
        where = f"link/{target.name}"
        mode = draw(st.sampled_from(["garbage", "bad_hello", "link", "link", "link", "link"]))
        live = _Live()
        try:
            if mode == "garbage":
                self._garbage(draw, target, where)
            elif mode == "bad_hello":
                self._bad_hello(draw, target, where)
            else:
                self._link(draw, target, where, live)
        finally:
            self.cases += 1
        self.reads_checked += live.reads_checked
        self._clean_up_and_probe(target, where, live)

    def _garbage(self, draw: Draw, target: LinkTarget, where: str) -> None:
        body = draw(st.binary(max_size=64))
        data = _HEADER.pack(len(body)) + body if target.tls is not None or draw(st.booleans()) else body
        with contextlib.closing(target.connect(self.timeout)) as sock:
            sock.sendall(data)
            self._end(sock, target, where, hello_only=True)

    def _bad_hello(self, draw: Draw, target: LinkTarget, where: str) -> None:
        token = draw(st.one_of(st.just(self.token[:-4] + "AAAA"), st.just(""), junk))
        session = draw(st.one_of(st.just(self.session), st.just("ses_nope"), junk))
        hello = draw(st.sampled_from([{"token": token, "session": session, "link": 1}, {"token": token},
                                      [token, session, 1]]))
        with contextlib.closing(target.connect(self.timeout)) as sock:
            sock.sendall(_frame(hello))
            self._end(sock, target, where, hello_only=True)

    def _end(self, sock: socket.socket, target: LinkTarget, where: str, hello_only: bool) -> None:
        """After a hostile hello: a refusal ([0, 1, error]) or a close, never acceptance, never silence."""
        if target.tls is None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_WR)
        reader = _Reader(sock, where)
        reply = reader.frame()
        if reply is None:
            self.closed += 1
            return
        decoded = msgpack.unpackb(reply, raw=False, strict_map_key=False)
        if not (isinstance(decoded, list) and len(decoded) == 3 and decoded[:2] == [0, 1]):
            raise AssertionError(f"{where}: a hostile hello got {decoded!r}")
        error = decoded[2]
        if not isinstance(error, dict) or not isinstance(error.get("code"), str):
            raise AssertionError(f"{where}: a malformed refusal {error!r}")
        self.observe(f"{where} hello", error["code"], str(error.get("message")))

    def _link(self, draw: Draw, target: LinkTarget, where: str, live: _Live) -> None:
        with contextlib.closing(target.connect(self.timeout)) as sock:
            reader = _Reader(sock, where)
            max_frame = self._hello(sock, reader, where)
            frames = self._frames(draw, live, max_frame)
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                sock.sendall(b"".join(f.data for f in frames))
            last = frames[-1].kind
            # Unix: half-close, so the worker must end the link when the client stops (over TLS a half-close
            # would end TLS itself: there the case reads what it expects, then closes).
            half = target.tls is None
            if half:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_WR)
            # Every whole frame is answered, in order, also when the link then ends (a half-close, a frame that
            # cannot be run, a half frame): batches waiting for the device's turn still get their acks first.
            for f in frames:
                if f.batch is not None:
                    self._check_ack(self._decode_ack(reader.frame(), where, f"batch {f.batch.id}"), f.batch, where,
                                    live)
            if last in ("malformed", "huge"):
                reply = reader.frame()
                if reply is not None:
                    self._check_refusal(self._decode_ack(reply, where, f"a {last} frame"), where, last)
                elif last == "malformed":
                    raise AssertionError(f"{where}: the link closed without refusing a malformed frame")
            if last in ("malformed", "huge") or half:
                extra = reader.frame()  # the worker must close the link now
                if extra is not None:
                    raise AssertionError(f"{where}: more after the link should have closed: {extra[:200]!r}")

    def _check_refusal(self, ack: proto.Ack, where: str, last: str) -> None:
        """A frame refused as a whole: Ack id 0 with nothing run (INVALID_ARGUMENT for one that is no batch)."""
        if (ack.id != 0 or ack.done != 0 or ack.error is None
                or (last == "malformed" and ack.error.code != "INVALID_ARGUMENT")
                or ack.error.code not in ALLOWED_CODES):
            raise AssertionError(f"{where}: a {last} frame got {ack!r}")
        self.observe(f"{where} {last}", ack.error.code, ack.error.message)

    @staticmethod
    def _decode_ack(reply: bytes | None, where: str, what: str) -> proto.Ack:
        if reply is None:
            raise AssertionError(f"{where}: the link closed without answering {what}")
        try:
            return proto.decode_ack(reply)
        except msgspec.DecodeError as exc:
            raise AssertionError(f"{where}: not an Ack ({exc}): {reply[:200]!r}") from None

    def _check_ack(self, ack: proto.Ack, batch: proto.Batch, where: str, live: _Live) -> None:
        self.acks += 1
        n = len(batch.commands)
        if ack.id != batch.id or not 0 <= ack.done <= n:
            raise AssertionError(f"{where}: batch {batch.id} of {n} commands got {ack!r}")
        for command in batch.commands[:ack.done]:  # these ran
            live.ran(command)
        if ack.error is not None:
            error = ack.error
            if ack.done < n:
                live.failed(batch.commands[ack.done])
            if ack.done == n or not batch.first + ack.done <= error.seq < batch.first + n:
                raise AssertionError(f"{where}: batch {batch.id} (first {batch.first}, {n} commands) got {ack!r}")
            if error.code not in ALLOWED_CODES:
                raise AssertionError(f"{where}: undocumented status {error.code} ({error.message!r}) for "
                                     f"{batch.commands[error.seq - batch.first]!r}")
            self.observe(f"{where} {type(batch.commands[error.seq - batch.first]).__name__}", error.code,
                         error.message)
            return
        if ack.done != n:
            raise AssertionError(f"{where}: batch {batch.id} ran {ack.done} of {n} commands with no error")
        ran_foreign = [c for c in batch.commands if isinstance(c, proto.Free) and c.handle in self.foreign]
        if ran_foreign:
            raise AssertionError(f"{where}: freed another session's buffer: {ran_foreign!r}")
        last = batch.commands[-1] if batch.commands else None
        if isinstance(last, proto.Read):
            if not (isinstance(ack.result, bytes) and len(ack.result) == last.size):
                raise AssertionError(f"{where}: a Read of {last.size} bytes got {str(ack.result)[:200]}")
            bad = live.mismatch(last, ack.result)
            if bad is not None:
                raise AssertionError(f"{where}: {last!r} read back a byte it did not write, at buffer offset {bad}")
        if isinstance(last, proto.DeviceInfoQuery) and not isinstance(ack.result, dict):
            raise AssertionError(f"{where}: a device query got {str(ack.result)[:200]}")
        self.observe(f"{where} batch", "OK", "")

    # -- after each case --------------------------------------------------------------------------------------------
    def _clean_up_and_probe(self, target: LinkTarget, where: str, live: _Live) -> None:
        """On a fresh link: free what the case left, then a write and read back of a new buffer must agree."""
        probe = proto.new_handle("buf")
        pattern = bytes(range(256)) * 4
        cleanup = [proto.Free(h) for h in live.bufs] + [proto.DestroyStream(h) for h in live.streams]
        batches = [proto.Batch(self._next_id, self._seq, [*cleanup, proto.Allocate(probe, len(pattern)),
                                                          proto.Write((probe, 0), 0, pattern),
                                                          proto.Read((probe, 0), 0, len(pattern))]),
                   proto.Batch(self._next_id + 1, self._seq + len(cleanup) + 3, [proto.Free(probe)])]
        self._next_id += 2
        self._seq += len(cleanup) + 4
        with contextlib.closing(target.connect(self.timeout)) as sock:
            reader = _Reader(sock, f"{where} (clean-up)")
            self._hello(sock, reader, where)
            sock.sendall(b"".join(_framed(proto.encode(b)) for b in batches))
            for batch in batches:
                ack = self._decode_ack(reader.frame(), where, "the clean-up")
                if (ack.id, ack.done, ack.error) != (batch.id, len(batch.commands), None):
                    raise AssertionError(f"{where}: after the case, the clean-up {batch.commands!r} got {ack!r}")
                if batch is batches[0] and ack.result != pattern:
                    raise AssertionError(f"{where}: after the case, a read back differs: {str(ack.result)[:200]}")


def _framed(payload: bytes) -> bytes:
    return _HEADER.pack(len(payload)) + payload


def _frame(obj: Any) -> bytes:
    return _framed(msgpack.packb(obj, use_bin_type=True))


class LinkVictims:
    """Sessions whose handles the link cases name as foreign ones, and whose data must survive them: another
    tenant's (its own worker, over its own link) and another session of the fuzzed tenant (the same worker)."""

    def __init__(self, target: str, victim_token: str, fuzzed_token: str, timeout: float = 30.0) -> None:
        from gpubroker.client import connect

        self.pattern = np.arange(1024, dtype=np.uint32)
        self.gpus = [connect(target, token=victim_token, device=0, timeout=timeout),
                     connect(target, token=fuzzed_token, device=0, transport="grpc", timeout=timeout)]
        self.bufs = []
        for gpu in self.gpus:
            buf = gpu.allocate_memory(self.pattern.nbytes)
            gpu.copy_h2d(self.pattern, buf)
            self.bufs.append(buf)

    @property
    def handles(self) -> list[str]:
        return [b.handle for b in self.bufs]

    def check(self) -> None:
        """Each victim still works (a memset, a copy and a synchronize) and its buffer holds what it wrote."""
        for gpu, buf in zip(self.gpus, self.bufs, strict=True):
            out = np.empty_like(self.pattern)
            gpu.copy_d2h(buf, out)
            if not np.array_equal(out, self.pattern):
                raise AssertionError(f"a victim's buffer {buf.handle} changed under the link fuzz")
            scratch = gpu.allocate_memory(256)
            gpu.memset(scratch, 7)
            gpu.synchronize()
            word = np.empty(256, dtype=np.uint8)
            gpu.copy_d2h(scratch, word)
            gpu.free_memory(scratch)
            if not (word == 7).all():
                raise AssertionError("a victim's memset read back wrong")

    def close(self) -> None:
        for gpu in self.gpus:
            with contextlib.suppress(Exception):
                gpu.close()


def open_link_session(target: str, token: str, backend: str,
                      timeout: float = 30.0) -> tuple[Any, dict[str, str]]:
    """The fuzzed session (over gRPC, so the case's links are its only ones) with the fuzz kernels loaded:
    (the RemoteGpu, kernel name -> handle)."""
    from gpubroker.client import connect
    from gpubroker_bench.fuzz._values import FUZZ_KERNELS, fuzz_source

    gpu = connect(target, token=token, device=0, transport="grpc", timeout=timeout)
    src = fuzz_source(backend)
    return gpu, {name: gpu.compile_kernel(src, name).handle for name in FUZZ_KERNELS}
