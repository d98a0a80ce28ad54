"""Length-prefixed msgpack frames on local sockets: front <-> worker, and the client's fast path."""

from __future__ import annotations

import asyncio
import socket
import struct
from typing import Any

import msgpack

__all__ = ["MAX_FRAME", "FrameClosed", "read_frame_async", "recv_frame", "send_frame", "write_frame_async"]

_HEADER = struct.Struct("!I")
# A chunk of copy data plus its envelope; larger frames mean a bug or a hostile peer.
MAX_FRAME = 256 * 1024 * 1024


class FrameClosed(EOFError):
    """The peer closed the socket (for a worker: it exited or was killed)."""


# Above this a frame's header and payload go out as two buffers rather than joined: a copy of a copy chunk saved.
_JOIN_MAX = 64 * 1024


def _unpack(payload: bytes | bytearray) -> Any:
    return msgpack.unpackb(payload, raw=False, use_list=True, strict_map_key=False)


def send_frame(sock: socket.socket, obj: Any) -> None:
    payload = msgpack.packb(obj, use_bin_type=True)
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
    (length,) = _HEADER.unpack(_recv_exact(sock, _HEADER.size))
    if length > MAX_FRAME:
        raise ValueError(f"frame of {length} bytes exceeds {MAX_FRAME}")
    return _unpack(_recv_exact(sock, length))


async def read_frame_async(reader: asyncio.StreamReader) -> Any:
    try:
        (length,) = _HEADER.unpack(await reader.readexactly(_HEADER.size))
        if length > MAX_FRAME:
            raise ValueError(f"frame of {length} bytes exceeds {MAX_FRAME}")
        return _unpack(await reader.readexactly(length))
    except asyncio.IncompleteReadError as exc:
        raise FrameClosed("peer closed the connection") from exc


async def write_frame_async(writer: asyncio.StreamWriter, obj: Any) -> None:
    payload = msgpack.packb(obj, use_bin_type=True)
    if len(payload) <= _JOIN_MAX:
        writer.write(_HEADER.pack(len(payload)) + payload)
    else:
        writer.writelines((_HEADER.pack(len(payload)), payload))
    await writer.drain()
