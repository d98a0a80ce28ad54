"""The front-worker framing is the SDK's (client/_frames.py): one wire format for every local socket.

The front reads its workers' replies with ``read_reply``, which bounds the frame by what the front can expect
(a worker runs its tenant's native code and may write anything on its socket): a length past the bound is
refused before a byte of the payload is buffered. Links carry the same frames with an encoded protocol Batch or
Ack as the payload (``recv_payload`` / ``send_payload``: no msgpack wrapping around what is msgpack already).
"""

from __future__ import annotations

import asyncio
import socket
from typing import Any

from gpubroker.client._frames import (
    FRAME_HEADER,
    MAX_FRAME,
    FrameClosed,
    FrameRefused,
    FrameTooLarge,
    pack_frame,
    read_frame_async,
    read_payload_async,
    recv_frame,
    send_frame,
    unpack_frame,
    write_frame_async,
)

__all__ = ["MAX_FRAME", "FrameClosed", "FrameRefused", "FrameTooLarge", "pack_frame", "read_frame_async",
           "read_payload_async", "read_reply", "recv_frame", "recv_payload", "send_frame", "send_payload",
           "unpack_frame", "write_frame_async"]

# Above this a frame's header and payload go out as two buffers rather than joined: a copy of a large Ack saved.
_JOIN_MAX = 64 * 1024


def _recv_into(sock: socket.socket, view: memoryview) -> None:
    got, n = 0, len(view)
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise FrameClosed("peer closed the connection")
        got += k


def recv_payload(sock: socket.socket, limit: int) -> bytearray:
    """One frame's payload, still packed; FrameTooLarge (before a byte of it is read) past ``limit``."""
    header = bytearray(FRAME_HEADER.size)
    _recv_into(sock, memoryview(header))
    (length,) = FRAME_HEADER.unpack(header)
    if length > limit:
        raise FrameTooLarge(length, limit)
    payload = bytearray(length)
    _recv_into(sock, memoryview(payload))
    return payload


def send_payload(sock: socket.socket, payload: bytes) -> None:
    """One frame around an already packed payload."""
    header = FRAME_HEADER.pack(len(payload))
    if len(payload) <= _JOIN_MAX:
        sock.sendall(header + payload)
        return
    sent = sock.sendmsg([header, payload])
    if sent < len(header):
        sock.sendall(header[sent:])
        sent = len(header)
    sock.sendall(memoryview(payload)[sent - len(header):])


async def read_reply(reader: asyncio.StreamReader, limit: int) -> Any:
    """One frame of at most ``limit`` bytes; FrameRefused past it or for bytes that do not unpack."""
    try:
        payload = await read_payload_async(reader, limit)
    except FrameTooLarge as exc:
        raise FrameRefused(f"a frame of {exc.length} bytes, over the front's limit of {limit}") from None
    try:
        # Containers are bounded by the payload already; nesting by msgpack's own stack limit.
        return unpack_frame(payload)
    except Exception as exc:  # ExtraData, FormatError, StackError, UnicodeDecodeError, ...
        raise FrameRefused(f"a frame that is not msgpack ({type(exc).__name__})") from None
