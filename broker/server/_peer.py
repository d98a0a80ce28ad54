"""CopyPeer: a copy between two sessions of one tenant, usually on two devices (a mixin of GpuBrokerService).

The path is chosen per copy:

- ``device``: both sessions on one device, so in one worker: a device-to-device copy there.
- ``peer``: CUDA, ``peer_copies = "auto"``, and the destination GPU can reach the source as a peer: the source
  worker exports its allocation (CUDA IPC), the destination worker maps it and copies from it over NVLink or PCIe.
- ``host``: anything else (OpenCL, no peer access): a memfd that both workers map (and on CUDA page-lock); the
  source worker copies one piece device-to-host into one half while the destination worker copies the previous
  piece host-to-device from the other.

Both devices' queued work finishes first, and the copy is done when the call returns. Every piece takes the
tenant's scheduler turn on each device it uses (the peer path's two in device order, so two copies in opposite
directions cannot deadlock), so a big copy yields the devices between pieces. While a copy runs, its buffers
cannot be freed and its sessions wait for it before they close: another process may be reading their memory.
The peer path's mappings and the host path's staging are kept between copies (``_peer_cache``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import AsyncIterator, Callable, Coroutine, Iterable
from typing import Any

from gpubroker.client import FailedPrecondition, GpuBrokerError, InvalidArgument, NotFound, OutOfRange
from gpubroker.v1 import broker_pb2 as pb

from ..sessions import HandleEntry, Session
from ._peer_cache import ImportCache, StagingCache
from ._status import Context, release_slot, rpc

__all__ = ["PeerCopies"]

log = logging.getLogger("gpubroker.server")
# Bytes per piece, each under its own scheduler turns: about a millisecond of copying either way (pinned host
# copies run at ~50 GB/s, peer and device copies at hundreds).
HOST_PIECE = 64 * 1024 * 1024
DEVICE_PIECE = 256 * 1024 * 1024
# Host-path copies up to this size get a staging memfd of their own; larger ones use the tenant's kept one.
SMALL_HOST_COPY = 8 * 1024 * 1024


async def _together(*coros: Coroutine[Any, Any, Any]) -> None:
    """Run the coroutines at once; the first failure cancels the rest and is raised."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    finally:
        for task in tasks:
            task.cancel()
        outcomes = await asyncio.gather(*tasks, return_exceptions=True)
    for outcome in outcomes:
        if isinstance(outcome, BaseException) and not isinstance(outcome, asyncio.CancelledError):
            raise outcome


def _check_range(what: str, buf: list[Any], offset: int, size: int) -> None:
    """``buf`` is [handle, allocation size, view offset], as the service's _buffer_ref gives it."""
    if offset < 0:
        raise InvalidArgument(f"{what} offset must be >= 0, got {offset}")
    if buf[2] + offset + size > buf[1]:
        raise OutOfRange(f"peer copy of {size} bytes at {what} offset {offset} runs past the end of the {what} "
                         f"buffer ({buf[1] - buf[2]} bytes from the view's start)")


class PeerCopies:
    """CopyPeer for GpuBrokerService, whose sessions, schedulers, devices, config and helpers it uses."""

    # (source, destination) backend device indices whose peer path failed: they go through the host from then on.
    peer_unreachable: set[tuple[int, int]]
    peer_imports: ImportCache
    peer_staging: StagingCache

    @rpc
    async def CopyPeer(self: Any, request: pb.CopyPeerRequest, context: Context) -> pb.CopyPeerResponse:
        tenant = self._tenant(context)
        src = self._session(context, request.src_session, tenant)
        # Another tenant's session, or a made-up one, is NOT_FOUND: nothing to learn by guessing.
        dst = self.sessions.get(request.dst_session, tenant)
        dst.check_alive()
        if dst is not src:
            self.admit(dst)
        try:
            return pb.CopyPeerResponse(path=await self.copy_peer(src, dst, request))
        finally:
            if dst is not src:
                release_slot(dst)

    async def copy_peer(self: Any, src: Session, dst: Session, request: pb.CopyPeerRequest) -> str:
        size = request.size
        if size < 0:
            raise InvalidArgument(f"copy size must be >= 0, got {size}")
        src_ref, dst_ref = self._buffer_ref(src, request.src), self._buffer_ref(dst, request.dst)
        _check_range("source", src_ref, request.src_offset, size)
        _check_range("destination", dst_ref, request.dst_offset, size)
        if size == 0:
            return "none"
        pinned = [src.resolve(request.src.handle, "buf"), dst.resolve(request.dst.handle, "buf")]
        sessions = [src] if dst is src else [src, dst]
        for session in sessions:
            session.begin_peer_copy()
        for entry in pinned:
            entry.pins += 1
        try:
            if src.worker is dst.worker:
                await self._copy_on_device(src, dst, src_ref, dst_ref, request)
                return "device"
            key = (src.worker.ordinal, dst.worker.ordinal)
            if (self.config.peer_copies == "auto" and src.worker.backend == "cuda"
                    and key not in self.peer_unreachable):
                try:
                    await self._copy_by_peer(src, dst, src_ref, dst_ref, request)
                    return "peer"
                except FailedPrecondition as exc:
                    if not exc.details.get("peer_unsupported"):
                        raise
                    log.warning("no peer path from device %d to device %d (%s): peer copies between them go "
                                "through host memory", src.device, dst.device, exc.message)
                    self.peer_unreachable.add(key)
            await self._copy_by_host(src, dst, src_ref, dst_ref, request)
            return "host"
        finally:
            for entry in pinned:
                entry.pins -= 1
            for session in sessions:
                session.end_peer_copy()

    # -- pieces ------------------------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def _turns(self: Any, tenant: str, devices: Iterable[int]) -> AsyncIterator[None]:
        """The tenant's turn on each device, taken in device order."""
        async with contextlib.AsyncExitStack() as stack:
            for device in sorted(set(devices)):
                await stack.enter_async_context(self.schedulers[device].turn(tenant))
            yield

    def _still_open(self: Any, *sessions: Session) -> None:
        for session in sessions:
            if self.sessions.sessions.get(session.id) is not session:
                raise NotFound(f"session {session.id!r} ended during the copy")
            session.check_alive()
            session.touch()

    async def _on(self: Any, sessions: tuple[Session, ...], target: Session, op: str, **params: Any) -> Any:
        """``op`` in ``target``'s worker, under the tenant's turns on the devices of ``sessions``."""
        async with self._turns(target.tenant, [s.device for s in sessions]):
            self._still_open(*sessions)
            return await target.worker.call(op, target.id, **params)

    async def _copy_on_device(self: Any, src: Session, dst: Session, src_ref: list[Any], dst_ref: list[Any],
                              request: pb.CopyPeerRequest) -> None:
        await self._on((src, dst), dst, "synchronize", stream=None)
        for done in range(0, request.size, DEVICE_PIECE):
            n = min(DEVICE_PIECE, request.size - done)
            await self._on((src, dst), dst, "peer_local", src_session=src.id, src=src_ref, dst=dst_ref,
                           src_offset=request.src_offset + done, dst_offset=request.dst_offset + done, size=n)

    async def _copy_by_peer(self: Any, src: Session, dst: Session, src_ref: list[Any], dst_ref: list[Any],
                            request: pb.CopyPeerRequest) -> None:
        both = (src, dst)
        key = (src.id, src_ref[0], dst.id)
        imported, own = self.peer_imports.get(key), False
        if imported is None:  # map the source allocation into the destination's worker (then kept: _peer_cache)
            exported = await self._on(both, src, "peer_export", buf=src_ref)
            imported = await self._on(both, dst, "peer_open", handle=exported["handle"], size=exported["size"],
                                      src_device=src.worker.ordinal)
            own = not self.peer_imports.add(key, dst, imported)
        else:  # what export and open would have waited for
            await self._synchronize(src, dst)
        try:
            start = src_ref[2] + request.src_offset  # the mapping covers the whole allocation
            for done in range(0, request.size, DEVICE_PIECE):
                n = min(DEVICE_PIECE, request.size - done)
                await self._on(both, dst, "peer_copy", src_offset=start + done, size=n, dst=dst_ref,
                               dst_offset=request.dst_offset + done, **{"import": imported})
        finally:
            if own:
                with contextlib.suppress(GpuBrokerError):
                    await dst.worker.call("peer_close", dst.id, **{"import": imported})

    async def _synchronize(self: Any, src: Session, dst: Session) -> None:
        await _together(self._on((src,), src, "synchronize", stream=None),
                        self._on((dst,), dst, "synchronize", stream=None))

    async def _copy_by_host(self: Any, src: Session, dst: Session, src_ref: list[Any], dst_ref: list[Any],
                            request: pb.CopyPeerRequest) -> None:
        if request.size > SMALL_HOST_COPY:  # through the tenant's kept staging
            async with self.peer_staging.use(src.tenant) as staging:
                segments = await staging.segment(src), await staging.segment(dst)
                await self._pipeline(src, dst, src_ref, dst_ref, request, segments, HOST_PIECE)
            return
        fd = os.memfd_create("gpubroker-peer-staging", os.MFD_CLOEXEC)  # a small one of its own
        registered: list[tuple[Session, str]] = []
        try:
            os.ftruncate(fd, request.size)
            for session in (src, dst):
                segment = await session.worker.call_with_fd("register_segment", session.id, fd, size=request.size)
                registered.append((session, segment))
        finally:
            os.close(fd)  # the workers' mappings keep the memory
        try:
            segments = registered[0][1], registered[1][1]
            await self._pipeline(src, dst, src_ref, dst_ref, request, segments, request.size)
        finally:
            for session, segment in registered:
                with contextlib.suppress(GpuBrokerError):
                    await session.worker.call("release_segment", session.id, segment=segment)

    async def _pipeline(self: Any, src: Session, dst: Session, src_ref: list[Any], dst_ref: list[Any],
                        request: pb.CopyPeerRequest, segments: tuple[str, str], piece: int) -> None:
        """Piece i goes up to the destination while piece i + 1 comes down from the source, in the other half."""
        size, (seg_src, seg_dst) = request.size, segments
        slots = 1 if size <= piece else 2
        await self._synchronize(src, dst)
        on: Callable[..., Coroutine[Any, Any, Any]] = self._on  # (self is Any in this mixin: name what _on is)

        def down(i: int) -> Coroutine[Any, Any, Any]:
            return on((src,), src, "copy_shared", segment=seg_src, segment_offset=(i % slots) * piece,
                      buf=src_ref, offset=request.src_offset + i * piece, size=min(piece, size - i * piece),
                      to_device=False, stream=None)

        def up(i: int) -> Coroutine[Any, Any, Any]:
            return on((dst,), dst, "copy_shared", segment=seg_dst, segment_offset=(i % slots) * piece,
                      buf=dst_ref, offset=request.dst_offset + i * piece, size=min(piece, size - i * piece),
                      to_device=True, stream=None)

        count = -(-size // piece)
        await down(0)
        for i in range(count):
            await _together(up(i), *([down(i + 1)] if i + 1 < count else []))

    # -- caches ------------------------------------------------------------------------------------
    def init_peer_copies(self: Any) -> None:
        self.peer_unreachable = set()
        self.peer_imports = ImportCache()
        self.peer_staging = StagingCache(2 * HOST_PIECE)
        self.sessions.closing_hooks.append(self._peer_session_closing)

    async def _peer_session_closing(self: Any, session: Session) -> None:
        await self.peer_imports.close_where(session)
        await self.peer_staging.release(session)

    async def before_free(self: Any, session: Session, entry: HandleEntry) -> None:
        """Before the worker frees a buffer: refuse while a copy uses it; unmap it where other workers keep it."""
        for _ in range(2):  # again after the unmapping, which awaited: a copy may have begun meanwhile
            if entry.pins:
                raise FailedPrecondition("the buffer is being copied to or from another device; free it once that "
                                         "copy returns")
            await self.peer_imports.close_where(session, entry.backend)
