"""Streamed host<->device copies: chunks pipelined through the tenant's worker, a bounded few at a time.

A chunk's worker round trip (front -> worker socket -> device -> reply) used to finish before the next chunk
was received or sent, so the gRPC stream, the front and the worker took turns idling. Here a small, fixed
number of worker calls stay in flight while the stream moves the neighbouring chunks, which overlaps the
three. Guarantees kept: the broker holds at most ``depth`` (+ the one being received or sent) chunks of a
copy; each chunk's worker call still takes its own scheduler turn, so a huge copy yields the device between
chunks; the first failure ends the copy with that error, and calls still in flight are abandoned (their
replies are dropped by the worker client) so nothing leaks past the RPC.

Chunks cover disjoint byte ranges of the buffer, so completion order among in-flight calls does not matter
for the bytes; the RPC only answers after every write has been acknowledged, and reads are yielded in offset
order.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from gpubroker.client import InvalidArgument
from gpubroker.v1 import broker_pb2 as pb

from ..sessions import Session
from ._staging import CopyStaging

__all__ = ["WRITE_DEPTH", "READ_DEPTH", "read_chunks", "write_chunks"]

# Worker calls kept in flight per copy: enough to overlap the stream with the worker (one call being served,
# one queued behind it, for reads one more whose reply is on its way); deeper queues only hold more chunks.
WRITE_DEPTH = 2
READ_DEPTH = 3

Device = Callable[..., Awaitable[Any]]


def _consume(task: asyncio.Future[Any]) -> None:
    """Retrieve an abandoned call's outcome so asyncio does not log 'exception was never retrieved'."""
    if not task.cancelled():
        task.exception()


def _abandon(tasks: deque[asyncio.Future[Any]]) -> None:
    for task in tasks:
        task.cancel()
        task.add_done_callback(_consume)
    tasks.clear()


def _reap(tasks: deque[asyncio.Future[Any]], slots: deque[int], staging: CopyStaging | None) -> None:
    """Drop finished calls from the front of the queue (freeing their slots), raising the first failure."""
    while tasks and tasks[0].done():
        task = tasks.popleft()
        slot = slots.popleft()
        if staging is not None:
            staging.free.append(slot)
        task.result()


def _write(device: Device, session: Session, buf: list[Any], offset: int, data: bytes, stream: str | None,
           staging: CopyStaging | None, slot: int) -> asyncio.Future[Any]:
    if staging is None:
        return asyncio.ensure_future(device(session, "write", buf=buf, offset=offset, data=data, stream=stream))
    staging.put(slot, data)
    return asyncio.ensure_future(device(session, "copy_shared", buf=buf, offset=offset, size=len(data),
                                        segment=staging.segment, segment_offset=staging.offset(slot),
                                        to_device=True, stream=stream))


async def write_chunks(device: Device, session: Session, header: pb.HostToDeviceHeader, buf: list[Any],
                       stream: str | None, first: pb.HostToDeviceChunk,
                       rest: AsyncIterator[pb.HostToDeviceChunk], chunk_limit: int,
                       depth: int = WRITE_DEPTH, staging: CopyStaging | None = None) -> None:
    """Write the stream's chunks to ``buf``: receive the next chunk while earlier ones are being written.

    With ``staging`` (at least ``depth`` slots of ``chunk_limit``), each chunk goes to the worker through it.
    """
    written = 0
    inflight: deque[asyncio.Future[Any]] = deque()
    slots: deque[int] = deque()  # the staging slot of each write in flight, in the same order
    chunk: pb.HostToDeviceChunk | None = first
    try:
        while chunk is not None:
            data = chunk.data
            if len(data) > chunk_limit:
                raise InvalidArgument(f"chunk of {len(data)} bytes exceeds the broker's {chunk_limit}")
            if written + len(data) > header.size:
                raise InvalidArgument(f"chunks carry more than the {header.size} bytes the header announced")
            if data:
                _reap(inflight, slots, staging)  # a failed write ends the copy as soon as it is seen
                if len(inflight) >= depth:
                    await inflight[0]
                    _reap(inflight, slots, staging)
                slot = staging.free.pop() if staging is not None else -1
                inflight.append(_write(device, session, buf, header.offset + written, data, stream, staging, slot))
                slots.append(slot)
                written += len(data)
            session.touch()
            chunk = await anext(rest, None)
        if written != header.size:
            raise InvalidArgument(f"chunks carried {written} bytes; the header announced {header.size}")
        while inflight:
            await inflight[0]
            _reap(inflight, slots, staging)
    finally:
        if staging is not None and inflight:
            staging.stale = True  # writes given up on may still be reading their slots in the worker
        _abandon(inflight)
        if staging is not None:
            staging.free.extend(slots)


async def read_chunks(device: Device, session: Session, buf: list[Any], offset: int, size: int, chunk: int,
                      stream: str | None, depth: int = READ_DEPTH, staging: CopyStaging | None = None
                      ) -> AsyncIterator[pb.DeviceToHostChunk]:
    """Read ``size`` bytes in chunks, in order, with up to ``depth`` reads in flight while earlier ones go out.

    With ``staging`` (at least ``depth`` slots of ``chunk``), the worker copies each chunk into it.
    """
    issued = 0
    inflight: deque[tuple[asyncio.Future[Any], int, int]] = deque()
    try:
        while inflight or issued < size:
            while issued < size and len(inflight) < depth:
                n = min(chunk, size - issued)
                if staging is None:
                    call, slot = device(session, "read", buf=buf, offset=offset + issued, size=n, stream=stream), -1
                else:
                    slot = staging.free.pop()
                    call = device(session, "copy_shared", buf=buf, offset=offset + issued, size=n,
                                  segment=staging.segment, segment_offset=staging.offset(slot), to_device=False,
                                  stream=stream)
                inflight.append((asyncio.ensure_future(call), slot, n))
                issued += n
            task, slot, n = inflight[0]
            data = await task
            inflight.popleft()
            if staging is not None:
                data = staging.get(slot, n)
                staging.free.append(slot)
            session.touch()
            yield pb.DeviceToHostChunk(data=data)
    finally:
        if staging is not None and inflight:
            staging.stale = True  # reads given up on may still be writing their slots in the worker
        with contextlib.suppress(RuntimeError):  # (no running loop when collected late)
            _abandon(deque(task for task, _, _ in inflight))
        if staging is not None:
            staging.free.extend(slot for _, slot, _ in inflight)
