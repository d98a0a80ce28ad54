"""The front-worker framing is the SDK's (gpubroker/wire/frames.py): one wire format for every local socket.

The front reads its workers' replies with ``read_reply``, which bounds the frame by what the front can expect
(a worker runs its tenant's native code and may write anything on its socket): a length past the bound is
refused before a byte of the payload is buffered. Links carry the same frames with an encoded protocol Batch or
Ack as the payload (no msgpack wrapping around what is msgpack already), read and written without blocking by
``_links.py``.
"""

from __future__ import annotations

import asyncio

import msgspec
from msgspec import Raw

from gpubroker.wire.frames import (
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

__all__ = ["CONTROL", "EXIT_FATAL", "FRAME_HEADER", "MAX_LINKS_PER_SESSION", "MAX_FRAME", "FrameClosed", "FrameRefused",
           "FrameTooLarge", "pack_frame",
           "read_frame_async", "read_payload_async", "read_reply", "recv_frame", "send_frame", "unpack_frame",
           "write_frame_async"]


# The request id of lease messages between the front and the worker (replies to requests have ids >= 1).
CONTROL = -1
# The status a worker exits with after its tenant's kernel corrupted its device context.
EXIT_FATAL = 3
# A worker serves each session's links in order, one batch at a time; past this many, new links stay with the front.
MAX_LINKS_PER_SESSION = 8

# A reply's envelope: [id, status, result] (a lease message: [CONTROL, op, extra]). Its result is left encoded
# (one small object over the payload) and decoded by the schema of the request it answers (workers/_replies.py):
# never unpacked as arbitrary msgpack, which would build an object of ~64 bytes for each one-byte element.
_ENVELOPE = msgspec.msgpack.Decoder(tuple[int, int | str, Raw])


async def read_reply(reader: asyncio.StreamReader, limit: int) -> tuple[int, int | str, Raw]:
    """One frame of at most ``limit`` bytes, ``[id, status, result]`` with the result still encoded; FrameRefused
    past the limit or for bytes of another shape."""
    try:
        payload = await read_payload_async(reader, limit)
    except FrameTooLarge as exc:
        raise FrameRefused(f"a frame of {exc.length} bytes, over the front's limit of {limit}") from None
    try:
        return _ENVELOPE.decode(payload)
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:
        raise FrameRefused(f"a frame that is not [id, status, result] ({str(exc)[:120]})") from None
