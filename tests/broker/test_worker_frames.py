"""The front-worker wire: frames survive both directions and a closed peer is noticed."""

from __future__ import annotations

import asyncio
import socket
import threading

import msgpack
import pytest

from gpubroker.wire.frames import (
    FRAME_HEADER,
    FrameDecoder,
    FrameTooLarge,
    frame_length,
    pack_frame,
    recv_payload,
    unpack_frame,
)
from gpubroker.wire.worker import FrameClosed, read_frame_async, recv_frame, send_frame


def test_frames_round_trip_and_close() -> None:
    a, b = socket.socketpair()
    payload = [7, "write", "ses_x", {"data": b"\x00" * 3_000_000, "offset": 5}]
    # Larger than the socket buffer: the sender must run beside the reader.
    sender = threading.Thread(target=send_frame, args=(a, payload))
    sender.start()
    assert recv_frame(b) == payload
    sender.join()
    a.close()
    with pytest.raises(FrameClosed):
        recv_frame(b)
    b.close()


def test_async_reader_sees_frames_then_eof() -> None:
    async def scenario() -> None:
        a, b = socket.socketpair()
        reader, writer = await asyncio.open_unix_connection(sock=b)
        send_frame(a, {"k": [1, 2]})
        assert await read_frame_async(reader) == {"k": [1, 2]}
        a.close()
        with pytest.raises(FrameClosed):
            await read_frame_async(reader)
        writer.close()

    asyncio.run(scenario())


def test_decoder_takes_any_split_and_never_reads_past_a_frame() -> None:
    """The one framing rule (wire/frames.py), however the bytes come: each payload whole, in order; the buffer it
    offers ends at its frame's end (a reader reads nothing of the next frame, nor its descriptors)."""
    payloads = [b"", b"x", bytes(range(256)) * 3, b"yz"]
    stream = b"".join(FRAME_HEADER.pack(len(p)) + p for p in payloads)
    for step in (1, 3, 5, len(stream)):
        frames = FrameDecoder(1024, bytearray)
        got = [bytes(p) for k in range(0, len(stream), step) for p in frames.feed(stream[k:k + step])]
        assert got == payloads
        assert not frames.reading and frames.cut_short() is None
    frames = FrameDecoder(1024, bytearray)
    assert len(frames.buffer()) == FRAME_HEADER.size
    assert frames.advance(0) is None
    frames.buffer()[:2] = FRAME_HEADER.pack(10)[:2]
    assert frames.advance(2) is None and frames.reading
    assert frames.cut_short() == "cut short: the peer closed with 2 bytes of a frame's header read"
    frames.buffer()[:] = FRAME_HEADER.pack(10)[2:]
    assert frames.advance(2) is None
    assert len(frames.buffer()) == 10  # the payload's room, not a byte more
    frames.buffer()[:4] = b"abcd"
    assert frames.advance(4) is None
    assert frames.cut_short() == "cut short: the peer closed with 4 of the 10 bytes of a frame read"
    assert len(frames.buffer()) == 6
    frames.reset()
    assert not frames.reading and len(frames.buffer()) == FRAME_HEADER.size


def test_decoder_refuses_a_header_over_its_bound_before_its_payload() -> None:
    frames = FrameDecoder(8, bytearray)
    with pytest.raises(FrameTooLarge, match="frame of 9 bytes exceeds 8") as caught:
        list(frames.feed(FRAME_HEADER.pack(4) + b"okok" + FRAME_HEADER.pack(9)))
    assert (caught.value.length, caught.value.limit) == (9, 8)
    assert not frames.reading  # between frames: the refused one's payload was never taken
    with pytest.raises(FrameTooLarge):
        frame_length(FRAME_HEADER.pack(9), 8)
    assert frame_length(FRAME_HEADER.pack(8), 8) == 8
    # feed yields the frames before a refused header first
    frames = FrameDecoder(8, bytearray)
    feed = frames.feed(FRAME_HEADER.pack(2) + b"ok" + FRAME_HEADER.pack(9))
    assert bytes(next(feed)) == b"ok"
    with pytest.raises(FrameTooLarge):
        next(feed)


def test_recv_payload_reads_only_its_frame() -> None:
    """A blocking reader stops at its frame's end: what follows (a link's next frame: the worker's) stays."""
    a, b = socket.socketpair()
    a.sendall(FRAME_HEADER.pack(3) + b"one" + FRAME_HEADER.pack(3) + b"two")
    assert recv_payload(b, 3) == b"one"
    assert b.recv(64) == FRAME_HEADER.pack(3) + b"two"
    a.sendall(FRAME_HEADER.pack(4))
    with pytest.raises(FrameTooLarge, match="frame of 4 bytes exceeds 3"):
        recv_payload(b, 3)
    a.sendall(FRAME_HEADER.pack(5) + b"ab")
    a.close()
    with pytest.raises(FrameClosed):
        recv_payload(b, 10)
    b.close()


@pytest.mark.parametrize("message", [
    {"token": "gpb_" + "x" * 40, "session": "ses_abc", "link": 1, "ring": 1},
    [0, 0, {"link": 1, "max_frame": 1 << 24}],
    [0, 1, {"code": "NOT_FOUND", "message": "no session", "type": "", "details": {"retry_after_seconds": 0.5}}],
    [1, 2**40, -2**40, 2**64 - 1, -2**63, 1.5, float("inf"), None, True, b"\x00" * 300, "\u00e9" * 40, {7: "k"}],
    [1, b"\x01" * 70000],
])
def test_frames_are_the_bytes_msgpack_writes(message: object) -> None:
    """The wire's frames come from msgspec alone; their bytes are what msgpack-python writes (use_bin_type), and
    msgpack-python reads them back the same: the format is unchanged for any peer."""
    frame = pack_frame(message)
    payload = msgpack.packb(message, use_bin_type=True)
    assert frame == FRAME_HEADER.pack(len(payload)) + payload
    assert unpack_frame(frame[FRAME_HEADER.size:]) == msgpack.unpackb(payload, raw=False, strict_map_key=False)
