"""Length-prefixed msgpack frames on local sockets: front <-> worker, and the client's links.

The framing rule lives here alone: a frame is its payload's length (4 bytes, big-endian), then the payload; a
reader has a bound, and a header announcing more is refused (``FrameTooLarge``) before a byte of its payload is
read. ``FrameDecoder`` applies it without doing any IO, for every reader: blocking (``recv_payload``), the front's
event loop (its link listeners' ``FdStream``) and the worker's non-blocking links; ``frame_length`` is the same
rule for a reader that reads whole lengths itself (an asyncio StreamReader).
"""

from __future__ import annotations

import asyncio
import socket
import struct
from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

import msgspec

from gpubroker.wire.encoding import encode

__all__ = ["FRAME_HEADER", "MAX_FRAME", "FrameClosed", "FrameDecoder", "FrameRefused", "FrameTooLarge", "Payload",
           "frame_length", "pack_frame", "read_frame_async", "read_payload_async", "recv_frame", "recv_payload",
           "send_frame", "send_payload", "unpack_frame", "write_frame_async"]

FRAME_HEADER = _HEADER = struct.Struct("!I")  # each frame: its payload's length, then the msgpack payload
# A chunk of copy data plus its envelope; larger frames mean a bug or a hostile peer.
MAX_FRAME = 256 * 1024 * 1024


class FrameClosed(EOFError):
    """The peer closed the socket (for a worker: it exited or was killed)."""


class FrameRefused(ValueError):
    """A frame the reader will not take: larger than its bound, or not msgpack."""


class FrameTooLarge(FrameRefused):
    """A frame whose header announces more than the reader's bound (refused before a byte of it is read)."""

    def __init__(self, length: int, limit: int) -> None:
        super().__init__(f"frame of {length} bytes exceeds {limit}")
        self.length = length
        self.limit = limit


def frame_length(header: bytes | bytearray | memoryview, limit: int) -> int:
    """The payload length a frame's header announces; FrameTooLarge if it exceeds ``limit`` (as FrameDecoder)."""
    length: int = _HEADER.unpack(header)[0]
    if length > limit:
        raise FrameTooLarge(length, limit)
    return length


# A payload as a reader keeps it: plain bytes, or a view of a buffer the reader allocates itself (the worker's
# link frames land in page-locked memory: backends/_cuda_copies.py's pinned_buffer).
Payload = TypeVar("Payload", bound=bytearray | memoryview)


class FrameDecoder(Generic[Payload]):
    """One stream's frames, decoded incrementally without IO: the reader receives into ``buffer()`` (or has bytes
    ``feed``-ed) and ``advance`` hands back each payload once whole, in a buffer ``allocate`` made for it (of its
    length: ``bytearray`` for most readers).

    ``buffer()`` never reaches past the end of the frame being read, so a reader that fills it reads nothing of
    the next frame: neither its bytes nor the descriptors that may come with them (what follows a link's hello is
    the worker's to read; a segment request's memfd is taken with its own frame). The payload is received in
    place, into a buffer allocated once its header is whole and within the bound (so a hostile header costs
    nothing), and handed to the caller as is: msgpack and msgspec read any buffer.
    """

    __slots__ = ("_allocate", "_body", "_got", "_head", "_head_view", "limit", "reading")

    def __init__(self, limit: int, allocate: Callable[[int], Payload]) -> None:
        self.limit = limit
        self._allocate = allocate
        self.reading = False  # a frame is partly received (a stream's end now would cut it short)
        self._head = bytearray(_HEADER.size)
        self._head_view = memoryview(self._head)
        self._body: Payload | None = None  # the payload being read, once its header is whole
        self._got = 0  # bytes of the header, then of the payload, received so far

    # (buffer and advance run twice for every frame of a link: plain attributes, the header's view made once)
    def buffer(self) -> memoryview:
        """Where the stream's next bytes go: the rest of the header, then the rest of the payload."""
        body, got = self._body, self._got
        view = self._head_view if body is None else memoryview(body)
        return view[got:] if got else view

    def advance(self, n: int) -> Payload | None:
        """``n`` more bytes were put in ``buffer()``: the payload once whole (the caller's from then on), else
        None. FrameTooLarge when a header announces more than ``limit``; the decoder is then between frames."""
        got = self._got + n
        body = self._body
        if body is None:
            if got < _HEADER.size:
                self._got, self.reading = got, True
                return None
            self._got, self.reading = 0, False
            length = frame_length(self._head, self.limit)
            if length:
                self._body, self.reading = self._allocate(length), True
                return None
            return self._allocate(0)
        if got < len(body):
            self._got = got
            return None
        self._body, self._got, self.reading = None, 0, False
        return body

    def feed(self, data: bytes | bytearray | memoryview) -> Iterator[Payload]:
        """Each payload that ``data`` completes, in order (copied out of ``data``), as it completes: a header over
        the bound raises FrameTooLarge where it stands, after the frames before it. Exhaust it."""
        view = memoryview(data)
        while view:
            if self._body is None and not self._got and len(view) >= _HEADER.size:
                # Between frames with a whole header here (a recv of acks): a whole payload too is sliced out at
                # once, not copied through buffer() and advance() (which cost a small ack more than its recv).
                (length,) = _HEADER.unpack_from(view)
                if length > self.limit:  # (frame_length's rule, without its slice and call)
                    raise FrameTooLarge(length, self.limit)
                end = _HEADER.size + length
                if len(view) >= end:
                    whole = self._allocate(length)
                    whole[:] = view[_HEADER.size:end]
                    view = view[end:]
                    yield whole
                    continue
            into = self.buffer()
            n = min(len(into), len(view))
            into[:n] = view[:n]
            view = view[n:]
            payload = self.advance(n)
            if payload is not None:
                yield payload

    def cut_short(self) -> str | None:
        """What a stream's end now does to its frames: None between frames, else why it is a frame cut short."""
        if self._body is not None:
            return f"cut short: the peer closed with {self._got} of the {len(self._body)} bytes of a frame read"
        if self._got:
            return f"cut short: the peer closed with {self._got} bytes of a frame's header read"
        return None

    def reset(self) -> None:
        """Drop a frame partly received (the stream ended): the decoder is between frames."""
        self._body, self._got, self.reading = None, 0, False


# Above this a frame's header and payload go out as two buffers rather than joined: a copy of a copy chunk saved.
_JOIN_MAX = 64 * 1024


# Untyped frames (hellos and their replies, tests' probes) in the one msgpack library the wire uses: msgspec writes
# the same bytes msgpack-python did with use_bin_type=True (str as str, bytes as bin, the smallest int form, floats
# as float64), and reads arrays as lists and maps with any keys, as it did with strict_map_key=False.
_encode = encode  # (the wire's one encoder: wire/encoding.py)
_decode = msgspec.msgpack.Decoder().decode


def unpack_frame(payload: bytes | bytearray | memoryview) -> Any:
    """A frame's payload decoded without a schema (msgspec.DecodeError, a ValueError, if it is not msgpack)."""
    return _decode(payload)


def pack_frame(obj: Any) -> bytes:
    """One whole frame, header and payload joined (for small messages: large ones go out as two buffers)."""
    payload = _encode(obj)
    return _HEADER.pack(len(payload)) + payload


def send_frame(sock: socket.socket, obj: Any) -> None:
    send_payload(sock, _encode(obj))


def send_payload(sock: socket.socket, payload: bytes) -> None:
    """One frame whose payload is already encoded (a protocol Batch or Ack)."""
    if len(payload) <= _JOIN_MAX:
        sock.sendall(_HEADER.pack(len(payload)) + payload)
        return
    sent = sock.sendmsg([_HEADER.pack(len(payload)), payload])
    if sent < _HEADER.size:
        sock.sendall(_HEADER.pack(len(payload))[sent:])
        sent = _HEADER.size
    sock.sendall(memoryview(payload)[sent - _HEADER.size:])


def recv_frame(sock: socket.socket) -> Any:
    return unpack_frame(recv_payload(sock, MAX_FRAME))


def recv_payload(sock: socket.socket, limit: int) -> bytearray:
    """One frame's payload, still encoded; FrameTooLarge (before a byte of it is read) if it exceeds ``limit``.
    Reads nothing past the frame's end."""
    frames = FrameDecoder(limit, bytearray)
    while True:
        n = sock.recv_into(frames.buffer())
        if n == 0:
            raise FrameClosed("peer closed the connection")
        payload = frames.advance(n)
        if payload is not None:
            return payload


async def read_payload_async(reader: asyncio.StreamReader, limit: int) -> bytes:
    """One frame's payload, still packed; FrameTooLarge (before the payload is read) if it exceeds ``limit``."""
    try:
        length = frame_length(await reader.readexactly(_HEADER.size), limit)
        return await reader.readexactly(length)  # (the reader's own buffer: no copy through a FrameDecoder)
    except asyncio.IncompleteReadError as exc:
        raise FrameClosed("peer closed the connection") from exc


async def read_frame_async(reader: asyncio.StreamReader) -> Any:
    return unpack_frame(await read_payload_async(reader, MAX_FRAME))


async def write_frame_async(writer: asyncio.StreamWriter, obj: Any) -> None:
    payload = _encode(obj)
    if len(payload) <= _JOIN_MAX:
        writer.write(_HEADER.pack(len(payload)) + payload)
    else:
        writer.writelines((_HEADER.pack(len(payload)), payload))
    await writer.drain()
