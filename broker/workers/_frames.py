"""The front-worker framing is the SDK's (client/_frames.py): one wire format for every local socket."""

from gpubroker.client._frames import (
    MAX_FRAME,
    FrameClosed,
    read_frame_async,
    recv_frame,
    send_frame,
    write_frame_async,
)

__all__ = ["MAX_FRAME", "FrameClosed", "read_frame_async", "recv_frame", "send_frame", "write_frame_async"]
