"""CopyPeer: a copy between two sessions of one tenant, usually on two devices (a mixin of GpuBrokerService).

The path is chosen per copy:

- ``device``: both sessions on one device, so in one worker: a device-to-device copy there.
- ``peer``: CUDA, ``peer_copies = "auto"``, and the destination GPU can reach the source as a peer: the source
  worker exports its allocation (CUDA IPC), the destination worker maps it and copies from it over NVLink or PCIe.
- ``host``: anything else (OpenCL, no peer access): the tenant's staging memfd, which both workers map (and on
  CUDA page-lock); the source worker copies one piece device-to-host into one half while the destination worker
  copies the previous piece host-to-device from the other. It counts in the tenant's shared memory
  (``_peer_cache``).

Both devices' queued work finishes first, and the copy is done when the call returns. Every piece takes the
tenant's scheduler turn on each device it uses (the peer path's two in device order, so two copies in opposite
directions cannot deadlock), so a big copy yields the devices between pieces. While a copy runs, its buffers
cannot be freed (the workers pin them: ``pin`` / ``unpin``) and its sessions wait for it before they close:
another process may be reading their memory. Buffers are named by the client's handles, resolved (and their
ranges checked) by the workers.
The peer path's mappings and the host path's staging are kept between copies (``_peer_cache``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Coroutine, Iterable, Iterator
from typing import Any, TypeVar

from gpubroker.broker.config import BrokerConfig
from gpubroker.broker.front._commands import raise_for
from gpubroker.broker.front._peer_cache import ImportCache, StagingCache
from gpubroker.broker.front._sessions import Session, SessionManager
from gpubroker.broker.front.scheduler import DeviceScheduler
from gpubroker.v1 import broker_pb2 as pb
from gpubroker.wire.commands import Batch, BufRef, Command, CopyShared, Synchronize, encode
from gpubroker.wire.errors import FailedPrecondition, GpuBrokerError, InvalidArgument, NotFound, OutOfRange
from gpubroker.wire.worker import (
    PeerClose,
    PeerCopy,
    PeerExport,
    PeerLocal,
    PeerOpen,
    Pin,
    Unpin,
    WorkerRequest,
)

__all__ = ["PeerCopier"]

log = logging.getLogger("gpubroker.server")
T = TypeVar("T")
# Bytes per piece, each under its own scheduler turns: about a millisecond of copying (peer and device copies run
# at hundreds of GB/s; the host path's pieces are its staging's halves, _peer_cache.STAGING_PIECE at most).
DEVICE_PIECE = 256 * 1024 * 1024


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


def _ref(ref: pb.BufferRef, what: str) -> BufRef:
    """A buffer view as the workers' peer operations take it: (the client's handle, the view's offset)."""
    if not ref.handle or len(ref.handle) > 64:
        raise NotFound(f"no buf {ref.handle[:80]!r} in this session")
    return (ref.handle, ref.offset)


_BUSY = "the buffer is being copied to or from another device; free it once that copy returns"


@contextlib.contextmanager
def _side(side: str) -> Iterator[None]:
    """A range error of the workers' (which alone know the buffers' sizes) names the buffer it is about."""
    try:
        yield
    except OutOfRange as exc:
        raise OutOfRange(f"peer copy: the {side} buffer: {exc.message}", **exc.details) from None


class PeerCopier:
    """CopyPeer's work for the front's service: a copy between two sessions of one tenant, on one device, by the
    devices' peer path or through host memory, under the tenant's turns on both devices."""

    def __init__(self, config: BrokerConfig, sessions: SessionManager, schedulers: dict[int, DeviceScheduler]) -> None:
        self.config = config
        self.sessions = sessions
        self.schedulers = schedulers
        # (source, destination) backend device indices whose peer path failed: they go through the host from then on.
        self.peer_unreachable: set[tuple[int, int]] = set()
        self.peer_imports = ImportCache()
        self.peer_staging = StagingCache(config, sessions)
        sessions.closing_hooks.append(self._session_closing)

    async def copy(self, src: Session, dst: Session, request: pb.CopyPeerRequest) -> str:
        """Copy ``request.size`` bytes from ``src``'s buffer to ``dst``'s; the path taken ("device", "peer", "host" or
        "none")."""
        size = request.size
        for what, value in (("copy size", size), ("source offset", request.src_offset),
                            ("destination offset", request.dst_offset)):
            if value < 0:
                raise InvalidArgument(f"{what} must be >= 0, got {value}")
        src_ref, dst_ref = _ref(request.src, "source"), _ref(request.dst, "destination")
        if size == 0:
            return "none"
        sessions = [src] if dst is src else [src, dst]
        for session in sessions:
            session.begin_peer_copy()
        pinned: list[tuple[Session, str]] = []
        try:
            # Each worker refuses to free a pinned buffer (FAILED_PRECONDITION), through any path; the front's
            # count lets a Free it runs refuse before unmapping what the copy uses.
            for session, handle in ((src, src_ref[0]), (dst, dst_ref[0])):
                await session.worker.call(Pin([handle]), session.id)
                pinned.append((session, handle))
                session.peer_pins[handle] = session.peer_pins.get(handle, 0) + 1
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
            for session, handle in pinned:
                left = session.peer_pins.pop(handle, 1) - 1
                if left:
                    session.peer_pins[handle] = left
                if session.lost is None:
                    with contextlib.suppress(GpuBrokerError):
                        await session.worker.call(Unpin([handle]), session.id)
            for session in sessions:
                session.end_peer_copy()

    # -- pieces ------------------------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def _turns(self, tenant: str, devices: Iterable[int]) -> AsyncIterator[None]:
        """The tenant's turn on each device, taken in device order."""
        async with contextlib.AsyncExitStack() as stack:
            for device in sorted(set(devices)):
                await stack.enter_async_context(self.schedulers[device].turn(tenant))
            yield

    def _still_open(self, *sessions: Session) -> None:
        for session in sessions:
            if self.sessions.sessions.get(session.id) is not session:
                raise NotFound(f"session {session.id!r} ended during the copy")
            session.check_alive()
            session.touch()

    async def _on(self, sessions: tuple[Session, ...], target: Session, request: WorkerRequest[T]) -> T:
        """``request`` in ``target``'s worker, under the tenant's turns on the devices of ``sessions``."""
        async with self._turns(target.tenant, [s.device for s in sessions]):
            self._still_open(*sessions)
            result: T = await target.worker.call(request, target.id)
            return result

    async def _run(self, sessions: tuple[Session, ...], target: Session, *commands: Command,
                   side: str = "source or destination") -> None:
        """Commands in ``target``'s worker, under the tenant's turns on the devices of ``sessions``."""
        batch = Batch(0, 0, list(commands))
        async with self._turns(target.tenant, [s.device for s in sessions]):
            self._still_open(*sessions)
            with _side(side):
                raise_for(await target.worker.run_batch(target.id, batch, encode(batch)))

    async def _copy_on_device(self, src: Session, dst: Session, src_ref: BufRef, dst_ref: BufRef,
                              request: pb.CopyPeerRequest) -> None:
        await self._run((src, dst), dst, Synchronize())
        for done in range(0, request.size, DEVICE_PIECE):
            n = min(DEVICE_PIECE, request.size - done)
            with _side("source or destination"):
                await self._on((src, dst), dst, PeerLocal(src.id, src_ref, dst_ref, n, request.src_offset + done,
                                                          request.dst_offset + done))

    async def _copy_by_peer(self, src: Session, dst: Session, src_ref: BufRef, dst_ref: BufRef,
                            request: pb.CopyPeerRequest) -> None:
        both = (src, dst)
        key = (src.id, str(src_ref[0]), dst.id)
        imported, own = self.peer_imports.get(key), False
        if imported is None:  # map the source allocation into the destination's worker (then kept: _peer_cache)
            with _side("source"):
                exported = await self._on(both, src, PeerExport(src_ref))
            imported = await self._on(both, dst, PeerOpen(exported.handle, exported.size, src.worker.ordinal))
            own = not self.peer_imports.add(key, dst, imported)
        else:  # what export and open would have waited for
            await self._synchronize(src, dst)
        try:
            start = src_ref[1] + request.src_offset  # the mapping covers the whole allocation
            for done in range(0, request.size, DEVICE_PIECE):
                n = min(DEVICE_PIECE, request.size - done)
                try:
                    await self._on(both, dst, PeerCopy(imported, start + done, n, dst_ref, request.dst_offset + done))
                except OutOfRange as exc:  # past the mapped source allocation, or past the destination view
                    with _side("source" if "peer's" in exc.message else "destination"):
                        raise
        finally:
            if own:
                with contextlib.suppress(GpuBrokerError):
                    await dst.worker.call(PeerClose(imported), dst.id)

    async def _synchronize(self, src: Session, dst: Session) -> None:
        await _together(self._run((src,), src, Synchronize()), self._run((dst,), dst, Synchronize()))

    async def _copy_by_host(self, src: Session, dst: Session, src_ref: BufRef, dst_ref: BufRef,
                            request: pb.CopyPeerRequest) -> None:
        # Through the tenant's one staging, whatever the size: a memfd per copy would give its workers one more
        # file to keep each time (_peer_cache.py).
        async with self.peer_staging.use(src.tenant) as staging:
            segments = await self.peer_staging.segment(staging, src), await self.peer_staging.segment(staging, dst)
            await self._pipeline(src, dst, src_ref, dst_ref, request, segments, staging.piece)

    async def _pipeline(self, src: Session, dst: Session, src_ref: BufRef, dst_ref: BufRef,
                        request: pb.CopyPeerRequest, segments: tuple[str, str], piece: int) -> None:
        """Piece i goes up to the destination while piece i + 1 comes down from the source, in the other half."""
        size, (seg_src, seg_dst) = request.size, segments
        slots = 1 if size <= piece else 2
        await self._synchronize(src, dst)
        run = self._run

        def down(i: int) -> Coroutine[Any, Any, Any]:
            return run((src,), src, CopyShared(seg_src, (i % slots) * piece, (src_ref[0], src_ref[1]),
                                               request.src_offset + i * piece, min(piece, size - i * piece), False),
                       side="source")

        def up(i: int) -> Coroutine[Any, Any, Any]:
            return run((dst,), dst, CopyShared(seg_dst, (i % slots) * piece, (dst_ref[0], dst_ref[1]),
                                               request.dst_offset + i * piece, min(piece, size - i * piece), True),
                       side="destination")

        count = -(-size // piece)
        await down(0)
        for i in range(count):
            await _together(up(i), *([down(i + 1)] if i + 1 < count else []))

    # -- caches ------------------------------------------------------------------------------------
    async def _session_closing(self, session: Session) -> None:
        await self.peer_imports.close_where(session)
        await self.peer_staging.release(session)

    async def before_free(self, session: Session, handles: set[str]) -> None:
        """Before a batch through the front frees buffers: refuse while a copy uses one; unmap them where other
        workers keep them. (A Free on the session's link reaches the worker alone, which refuses a pinned buffer;
        a mapping kept elsewhere then lives until either session ends.) Once for the whole batch: its frees cost
        this loop one pass, not one each."""
        for _ in range(2):  # again after the unmapping, which awaited: a copy may have begun meanwhile
            if not session.peer_pins.keys().isdisjoint(handles):  # (a pin's count is dropped at 0)
                raise FailedPrecondition(_BUSY)
            await self.peer_imports.close_where(session, handles)
