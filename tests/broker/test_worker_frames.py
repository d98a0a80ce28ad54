"""The front-worker wire: frames survive both directions and a closed peer is noticed."""

from __future__ import annotations

import asyncio
import socket
import threading

import pytest

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
