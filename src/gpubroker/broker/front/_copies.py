"""Streamed host<->device copies: Write / Read commands pipelined through the tenant's worker, a bounded few at a
time.

A chunk's worker round trip (front -> worker socket -> device -> reply) used to finish before the next chunk
was received or sent, so the gRPC stream, the front and the worker took turns idling. Here a small, fixed
number of batches stay in flight while the stream moves the neighbouring chunks, which overlaps the three.
Guarantees kept: the broker holds at most ``depth`` (+ the one being received or sent) chunks of a copy; each
chunk's batch takes its own scheduler turn, so a huge copy yields the device between chunks; the first failure
ends the copy with that error, and batches still in flight are abandoned (their replies are dropped by the
worker client) so nothing leaks past the RPC.

Chunks cover disjoint byte ranges of the buffer, so completion order among in-flight batches does not matter
for the bytes; the RPC only answers after every write has been acknowledged, and reads are yielded in offset
order.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol

from gpubroker.broker.front._commands import read_command, write_command
from gpubroker.broker.front._sessions import Session
from gpubroker.v1 import broker_pb2 as pb
from gpubroker.wire.commands import Ack, Command
from gpubroker.wire.errors import InvalidArgument

__all__ = ["READ_DEPTH", "WRITE_DEPTH", "ReplyRoom", "read_chunks", "write_chunks"]

# Batches kept in flight per copy: enough to overlap the stream with the worker (one being served, one queued
# behind it, for reads one more whose reply is on its way); deeper queues only hold more chunks.
WRITE_DEPTH = 2
READ_DEPTH = 3

Run = Callable[[Session, list[Command]], Awaitable[Ack]]


class ReplyRoom(Protocol):
    """The tenant's room for replies produced and not yet sent (_service.py's ``_Replies``)."""

    def try_reserve(self, size: int) -> bool: ...

    async def reserve(self, size: int) -> None: ...

    def settle(self, reserved: int, size: int) -> None: ...

    def release(self, size: int) -> None: ...


def _consume(task: asyncio.Future[Any]) -> None:
    """Retrieve an abandoned call's outcome so asyncio does not log 'exception was never retrieved'."""
    if not task.cancelled():
        task.exception()


def _abandon(tasks: deque[asyncio.Future[Any]]) -> None:
    for task in tasks:
        task.cancel()
        task.add_done_callback(_consume)
    tasks.clear()


def _reap(tasks: deque[asyncio.Future[Ack]]) -> None:
    """Drop finished batches from the front of the queue, raising the first failure."""
    while tasks and tasks[0].done():
        tasks.popleft().result()


async def write_chunks(run: Run, session: Session, header: pb.HostToDeviceHeader, first: pb.HostToDeviceChunk,
                       rest: AsyncIterator[pb.HostToDeviceChunk], chunk_limit: int,
                       depth: int = WRITE_DEPTH) -> None:
    """Write the stream's chunks: receive the next chunk while earlier ones are being written."""
    written = 0
    inflight: deque[asyncio.Future[Ack]] = deque()
    chunk: pb.HostToDeviceChunk | None = first
    try:
        while chunk is not None:
            data = chunk.data
            if len(data) > chunk_limit:
                raise InvalidArgument(f"chunk of {len(data)} bytes exceeds the broker's {chunk_limit}")
            if written + len(data) > header.size:
                raise InvalidArgument(f"chunks carry more than the {header.size} bytes the header announced")
            if data:
                _reap(inflight)  # a failed write ends the copy as soon as it is seen
                if len(inflight) >= depth:
                    await inflight[0]
                    _reap(inflight)
                inflight.append(asyncio.ensure_future(run(session, [write_command(header, written, data)])))
                written += len(data)
            session.touch()
            chunk = await anext(rest, None)
        if written != header.size:
            raise InvalidArgument(f"chunks carried {written} bytes; the header announced {header.size}")
        if not written:  # an empty copy still names a buffer, a stream and a range, which the worker checks
            inflight.append(asyncio.ensure_future(run(session, [write_command(header, 0, b"")])))
        while inflight:
            await inflight[0]
            _reap(inflight)
    finally:
        _abandon(inflight)


async def read_chunks(run: Run, session: Session, request: pb.CopyDeviceToHostRequest, chunk: int,
                      room: ReplyRoom, depth: int = READ_DEPTH) -> AsyncIterator[pb.DeviceToHostChunk]:
    """Read the request's bytes in chunks, in order, with up to ``depth`` reads in flight while earlier ones go
    out. Each chunk's bytes are taken from ``room`` before its read starts and given back once the chunk has gone
    (the consumer asks for the next): a client that takes no chunks stops the copy once the tenant's room is
    used. A read waits for room only when none of the copy's is in flight (whose release needs no room); what is
    still held when the copy is abandoned, the caller releases."""
    issued, size = 0, request.size
    inflight: deque[asyncio.Future[Ack]] = deque()
    reserved: deque[int] = deque()  # each read's in flight
    try:
        if not size:  # an empty copy still names a buffer, a stream and a range, which the worker checks
            ack = await run(session, [read_command(request, 0, 0)])
            yield pb.DeviceToHostChunk(data=ack.result)
        while inflight or issued < size:
            while issued < size and len(inflight) < depth:
                n = min(chunk, size - issued)
                if not inflight:
                    await room.reserve(n)
                elif not room.try_reserve(n):
                    break
                inflight.append(asyncio.ensure_future(run(session, [read_command(request, issued, n)])))
                reserved.append(n)
                issued += n
            ack = await inflight[0]
            inflight.popleft()
            session.touch()
            room.settle(reserved.popleft(), len(ack.result))
            yield pb.DeviceToHostChunk(data=ack.result)
            room.release(len(ack.result))
    finally:
        with contextlib.suppress(RuntimeError):  # (no running loop when collected late)
            _abandon(inflight)
