"""The front-worker framing is the SDK's (client/_frames.py): one wire format for every local socket.

The front reads its workers' replies with ``read_reply``, which bounds the frame by what the front can expect
(a worker runs its tenant's native code and may write anything on its socket): a length past the bound is
refused before a byte of the payload is buffered. Links carry the same frames with an encoded protocol Batch or
Ack as the payload (no msgpack wrapping around what is msgpack already), read and written without blocking by
``_links.py``.
"""

from __future__ import annotations

import asyncio
from typing import Any

from gpubroker.client._frames import (
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
           "read_payload_async", "read_reply", "recv_frame", "send_frame", "unpack_frame", "write_frame_async"]


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
