"""Length-prefixed msgpack frames on local sockets: front <-> worker, and the client's links."""

from __future__ import annotations

import asyncio
import socket
import struct
from typing import Any

import msgpack

__all__ = ["FRAME_HEADER", "MAX_FRAME", "FrameClosed", "FrameRefused", "FrameTooLarge", "pack_frame",
           "read_frame_async", "read_payload_async", "recv_frame", "recv_payload", "send_frame", "send_payload",
           "unpack_frame", "write_frame_async"]

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


# Above this a frame's header and payload go out as two buffers rather than joined: a copy of a copy chunk saved.
_JOIN_MAX = 64 * 1024


def unpack_frame(payload: bytes | bytearray) -> Any:
    return msgpack.unpackb(payload, raw=False, use_list=True, strict_map_key=False)


def pack_frame(obj: Any) -> bytes:
    """One whole frame, header and payload joined (for small messages: large ones go out as two buffers)."""
    payload: bytes = msgpack.packb(obj, use_bin_type=True)
    return _HEADER.pack(len(payload)) + payload


def send_frame(sock: socket.socket, obj: Any) -> None:
    send_payload(sock, msgpack.packb(obj, use_bin_type=True))


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


def _recv_exact(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise FrameClosed("peer closed the connection")
        got += k
    return buf  # unpacked in place: msgpack reads any buffer


def recv_frame(sock: socket.socket) -> Any:
    return unpack_frame(recv_payload(sock, MAX_FRAME))


def recv_payload(sock: socket.socket, limit: int) -> bytearray:
    """One frame's payload, still encoded; FrameTooLarge (before a byte of it is read) if it exceeds ``limit``."""
    (length,) = _HEADER.unpack(_recv_exact(sock, _HEADER.size))
    if length > limit:
        raise FrameTooLarge(length, limit)
    return _recv_exact(sock, length)


async def read_payload_async(reader: asyncio.StreamReader, limit: int) -> bytes:
    """One frame's payload, still packed; FrameTooLarge (before the payload is read) if it exceeds ``limit``."""
    try:
        (length,) = _HEADER.unpack(await reader.readexactly(_HEADER.size))
        if length > limit:
            raise FrameTooLarge(length, limit)
        return await reader.readexactly(length)
    except asyncio.IncompleteReadError as exc:
        raise FrameClosed("peer closed the connection") from exc


async def read_frame_async(reader: asyncio.StreamReader) -> Any:
    return unpack_frame(await read_payload_async(reader, MAX_FRAME))


async def write_frame_async(writer: asyncio.StreamWriter, obj: Any) -> None:
    payload = msgpack.packb(obj, use_bin_type=True)
    if len(payload) <= _JOIN_MAX:
        writer.write(_HEADER.pack(len(payload)) + payload)
    else:
        writer.writelines((_HEADER.pack(len(payload)), payload))
    await writer.drain()
