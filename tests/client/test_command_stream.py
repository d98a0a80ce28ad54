"""CommandStream: an asynchronous command is never lost without an error at the next sync."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from gpubroker.client import Unavailable
from gpubroker.client._commands import CommandStream
from gpubroker.v1 import broker_pb2 as pb


def test_a_stream_that_ends_before_acknowledging_a_batch_is_an_error_at_the_next_sync() -> None:
    def open_stream(batches: Iterator[pb.CommandBatch]) -> Iterator[pb.BatchAck]:
        next(batches)  # the batch goes out, then the connection closes quietly, with no acknowledgement
        yield from ()

    stream = CommandStream(open_stream, "ses_x")
    stream.submit(memset=pb.MemsetRequest())
    with pytest.raises(Unavailable, match="1 batches unacknowledged"):
        stream.wait(raise_error=True)


def test_a_stream_that_ends_after_acknowledging_everything_is_no_error() -> None:
    def open_stream(batches: Iterator[pb.CommandBatch]) -> Iterator[pb.BatchAck]:
        yield pb.BatchAck(batch=next(batches).batch)

    stream = CommandStream(open_stream, "ses_x")
    stream.submit(memset=pb.MemsetRequest())
    stream.wait(raise_error=True)
    stream.close()
