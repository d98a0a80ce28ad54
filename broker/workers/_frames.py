"""The front-worker framing is the SDK's (client/_frames.py): one wire format for every local socket.

The front reads its workers' replies with ``read_reply``, which bounds the frame by what the front can expect
(a worker runs its tenant's native code and may write anything on its socket): a length past the bound is
refused before a byte of the payload is buffered.
"""

from __future__ import annotations

import asyncio
import struct
from typing import Any

import msgpack

from gpubroker.client._frames import (
    MAX_FRAME,
    FrameClosed,
    read_frame_async,
    recv_frame,
    send_frame,
    write_frame_async,
)

__all__ = ["MAX_FRAME", "FrameClosed", "FrameRefused", "read_frame_async", "read_reply", "recv_frame", "send_frame",
           "write_frame_async"]

_HEADER = struct.Struct("!I")


class FrameRefused(ValueError):
    """A frame the reader will not take: larger than its bound, or not msgpack."""


async def read_reply(reader: asyncio.StreamReader, limit: int) -> Any:
    """One frame of at most ``limit`` bytes; FrameRefused past it or for bytes that do not unpack."""
    try:
        (length,) = _HEADER.unpack(await reader.readexactly(_HEADER.size))
        if length > limit:
            raise FrameRefused(f"a frame of {length} bytes, over the front's limit of {limit}")
        payload = await reader.readexactly(length)
    except asyncio.IncompleteReadError as exc:
        raise FrameClosed("peer closed the connection") from exc
    try:
        # Containers are bounded by the payload already; nesting by msgpack's own stack limit.
        return msgpack.unpackb(payload, raw=False, use_list=True, strict_map_key=False)
    except Exception as exc:  # ExtraData, FormatError, StackError, UnicodeDecodeError, ...
        raise FrameRefused(f"a frame that is not msgpack ({type(exc).__name__})") from None
