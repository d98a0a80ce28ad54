"""Same host: host memory shared with the tenant's worker through memfd segments.

gRPC cannot carry file descriptors, but the broker's link socket ``PATH.fast`` beside its Unix socket ``PATH``
can. A ``SegmentChannel`` is a connection there whose hello (gpubroker/wire/link.py) says ``segments: 1`` with the
token and session: the front authenticates it as it does every link, then keeps it and registers segments on it
(it never goes to the worker). ``RegisterSegment`` names the segment's handle (chosen by the client, as every
handle is) and its size, with a memfd of exactly that size attached (SCM_RIGHTS), sealed against shrinking and
growing (``create_segment_fd``); the broker maps it into the tenant's worker and answers ``SegmentRegistered``. A
``CopyShared`` command, on whatever transport the session's commands take (gRPC included), then moves bytes
between that mapping and device memory: no copy data travels through a socket at all. ``ReleaseSegment`` unmaps a
segment early; otherwise it lives as long as its session. The channel says its hello as soon as it connects: a
connection that has said nothing holds one of the broker's few places for unauthenticated peers, and may be
closed to make room for another.

When the broker refuses the channel (its connection limits, a flood from other clients), ``host_array`` returns
plain host memory with a warning and copies go as Write and Read commands: slower, never wrong. The broker's
limits on the bytes mapped (per session, per tenant) are the caller's to respect, and raise RESOURCE_EXHAUSTED
saying so.
"""

from __future__ import annotations

import itertools
import logging
import math
import mmap
import os
import socket
import threading
import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np

from gpubroker.client._memcpy import parallel_copy
from gpubroker.client._transports import Transport, peer_hung_up
from gpubroker.client._wire import buf_ref
from gpubroker.wire.addresses import unix_path
from gpubroker.wire.commands import CopyShared, new_handle
from gpubroker.wire.errors import (
    DeadlineExceeded,
    FailedPrecondition,
    GpuBrokerError,
    InvalidArgument,
    Unavailable,
)
from gpubroker.wire.frames import FRAME_HEADER, FrameClosed, FrameTooLarge, recv_payload
from gpubroker.wire.host import address_of, check_device_range
from gpubroker.wire.link import (
    MAX_SEGMENT_FRAME,
    SEGMENTS_VERSION,
    Hello,
    Malformed,
    RegisterSegment,
    ReleaseSegment,
    SegmentRegistered,
    SegmentReleased,
    SegmentsAccepted,
    encode,
    link_path,
    open_answer,
)
from gpubroker.wire.ring import sealed_memfd
from gpubroker.wire.types import Buffer

try:
    import fcntl
except ImportError:  # not a Unix: no shared memory, copies go as Write and Read commands
    fcntl = None  # type: ignore[assignment]  # the module or None, tested before use

__all__ = ["STAGE_MIN", "STAGING_BYTES", "STAGING_SLOTS", "SUPPORTED", "SegmentChannel",
           "SharedMemory", "create_segment_fd", "staged_pieces"]

log = logging.getLogger("gpubroker.client")

T = TypeVar("T")
# Plain host memory smaller than this is copied by Write / Read commands on the transport rather than through the
# staging segment: a small read back (a loss, a flag) is then one round trip, not a pipeline of slots and threads.
STAGE_MIN = 256 * 1024
# The per-session bounce buffer for host memory that is not a host_array, in slots that pipeline a copy. The
# client's memcpy sets the pace (a DMA is several times faster), so the worker need only stay a slot ahead; each
# piece costs the client a round trip and a thread hand-off (~50 us), so slots are large: at 32 MiB that is ~4% of
# the piece's memcpy (~1.3 ms at 25 GB/s). The wait for one DMA at a copy's start (to the host) or end (to the
# device) does not grow with the slot: the pieces ramp up (or down) there (staged_pieces). Larger slots would
# cost pinned memory (the segment is page-locked on CUDA: 128 MiB per session) for ~2%. Four: the transport's
# window, so submitting a slot's piece never waits for more than that slot's acknowledgement.
STAGING_SLOTS = 4
STAGING_BYTES = STAGING_SLOTS * 32 * 1024 * 1024
# memfds and their seals are Linux's; elsewhere shared memory is off and copies go as Write and Read commands.
SUPPORTED = hasattr(os, "memfd_create") and hasattr(fcntl, "F_SEAL_SHRINK") and hasattr(socket, "send_fds")
# The broker refuses a segment that could shrink under the worker's mapping (touching it would SIGBUS), or that
# could hold more than the size it announced and is charged for (a larger file, or one that could grow).
_names = itertools.count(1)


def create_segment_fd(size: int) -> int:
    """A sealed memfd of ``size`` bytes, named so it is recognizable in /proc/PID/maps of the worker."""
    return sealed_memfd(f"gpubroker-seg-{os.getpid()}-{next(_names)}", size)


class SegmentChannel:
    """One segments connection to the broker's link socket for one session; it may carry any number of
    requests, one at a time."""

    def __init__(self, path: str, token: str, session: str, timeout: float | None = 30.0) -> None:
        """Connect to ``path`` and say the hello at once, so that the connection never sits unauthenticated
        (GpuBrokerError when the broker refuses it)."""
        self._timeout = timeout
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.settimeout(timeout)
        try:
            self._sock.connect(path)
        except BaseException:
            self._sock.close()
            raise
        self._lock = threading.Lock()
        try:
            self.request(Hello(token=token, session=session, segments=SEGMENTS_VERSION), SegmentsAccepted)
        except BaseException:
            self._sock.close()
            raise

    def register(self, fd: int, size: int, handle: str | None = None) -> str:
        """Hand ``fd`` (``size`` bytes) to the session's worker as ``handle`` (a new one by default); returns the
        segment's handle for CopyShared."""
        handle = handle or new_handle("segment")
        reply = self.request(RegisterSegment(handle, size), SegmentRegistered, [fd])
        if reply.segment != handle:
            raise Unavailable(f"the broker registered segment {reply.segment!r} as asked for {handle!r}")
        return handle

    def release(self, segment: str) -> None:
        self.request(ReleaseSegment(segment), SegmentReleased)

    def request(self, message: object, answer: type[T], fds: Sequence[int] = ()) -> T:
        """Send one frame (``message`` encoded, with ``fds`` attached to its first byte) and return its answer,
        of type ``answer``, or raise its error."""
        payload = encode(message)
        frame = FRAME_HEADER.pack(len(payload)) + payload
        with self._lock:
            try:
                sent = socket.send_fds(self._sock, [frame], list(fds)) if fds else 0
                self._sock.sendall(frame[sent:])
                reply = recv_payload(self._sock, MAX_SEGMENT_FRAME)
            except FrameTooLarge as exc:
                self._sock.close()
                raise Unavailable(f"the broker's shared-memory channel sent a {exc.length}-byte frame") from None
            except FrameClosed:
                self._sock.close()
                raise Unavailable("the broker's shared-memory channel failed: the broker closed it") from None
            except (OSError, ValueError) as exc:
                # A late answer would be read as the next request's: the connection is done (a new one is made).
                self._sock.close()
                if isinstance(exc, TimeoutError):
                    raise DeadlineExceeded(f"no answer on the shared-memory channel within {self._timeout} s"
                                           ) from None
                raise Unavailable(f"the broker's shared-memory channel failed: {exc}") from None
        try:
            return open_answer(reply, answer)
        except Malformed as exc:
            raise Unavailable(f"the broker's shared-memory channel sent a malformed answer ({exc})") from None

    @property
    def closed(self) -> bool:
        """Closed here, or by the broker between requests (its idle timeout, a revoked token)."""
        return peer_hung_up(self._sock)

    def close(self) -> None:
        self._sock.close()


class _Refused(Unavailable):
    """The broker refused the segments channel (not the request): host_array falls back to plain memory."""


def _forget(table: dict[str, tuple[int, int]], released: list[str], handle: str) -> None:
    # Runs when a host_array's last view dies, before its mapping goes: no lookup can find a stale address.
    # No socket I/O here (a finalizer may run inside any call, even one holding the channel's lock).
    table.pop(handle, None)
    released.append(handle)


def _ignore(_: Any) -> None:
    pass


def _copy_out(piece: np.ndarray, host: np.ndarray) -> Callable[[Any], None]:
    def copy(_: Any) -> None:
        parallel_copy(host, piece)
    return copy


def staged_pieces(total: int, slot: int, to_device: bool) -> list[int]:
    """The sizes of a staged copy's pieces, in order: whole slots, with a ramp of smaller pieces (1/8, 1/4, 1/2 of
    a slot) where the pipeline is not yet (or no longer) overlapped. To the host, the first copy-out waits for the
    first piece's DMA; to the device, the last piece's DMA follows its fill: a small piece there leaves little of
    the copy outside the overlap. Each piece's DMA stays shorter than the memcpy of the piece before it while the
    DMA is more than twice as fast as the memcpy (55 against 10-30 GB/s), so the ramp never stalls the pipeline."""
    sizes: list[int] = []
    left = total
    for part in (slot // 8, slot // 4, slot // 2):
        if left <= 0:
            break
        sizes.append(min(max(1, part), left))
        left -= sizes[-1]
    while left > 0:
        sizes.append(min(slot, left))
        left -= sizes[-1]
    return sizes[::-1] if to_device else sizes


class SharedMemory:
    """The client side of shared memory for one RemoteGpu session: host arrays, staging, CopyShared commands.

    ``transport()`` is the RemoteGpu's transport, which carries the CopyShared commands; ``session()`` is its
    session id. Everything falls back (``copy`` returns False) when the target is not a Unix socket or the broker
    has no link socket beside it.
    """

    def __init__(self, target: str, token: str | None, session: Callable[[], str],
                 transport: Callable[[], Transport], timeout: float | None = 30.0,
                 staging_bytes: int = STAGING_BYTES) -> None:
        path = unix_path(target)
        self.path = link_path(path) if path is not None and token and SUPPORTED else None
        self.staging_bytes = staging_bytes
        self._token = token or ""
        self._session = session
        self._transport = transport
        self._timeout = timeout
        self._channel: SegmentChannel | None = None
        self._off = self.path is None  # once off (no link socket there), stays off for this session
        self._refused = ""  # why the broker refused the channel (then off, and host arrays are plain memory)
        self._connect_lock = threading.Lock()
        self._staging_lock = threading.Lock()
        self._staging: tuple[mmap.mmap, str] | None = None
        self._staging_failed = False
        self._arrays: dict[str, tuple[int, int]] = {}  # live host_array segments: handle -> (address, size)
        self._released: list[str] = []  # host_array segments whose arrays died; released at the next request

    # -- the segments channel ------------------------------------------------------------------------
    def channel(self) -> SegmentChannel | None:
        """The connected segments channel, or None when there is none (then copies go as Write and Read
        commands)."""
        if self._off:
            return None
        with self._connect_lock:
            if self._channel is not None and self._channel.closed:
                self._channel = None  # it failed (its segments live on with the session): connect again
            if self._channel is None and not self._off:
                assert self.path is not None
                try:
                    self._channel = SegmentChannel(self.path, self._token, self._session(), self._timeout)
                except (FileNotFoundError, ConnectionRefusedError) as exc:
                    log.debug("no shared-memory channel at %s (%s); copies go as commands", self.path, exc)
                    self._off = True
                except (OSError, GpuBrokerError) as exc:  # there, but refused: a limit, a flood, a closed door
                    self._refused = str(exc)
                    log.warning("the broker refused shared memory for this session (%s); copies go as Write and "
                                "Read commands and host_array returns plain host memory", exc)
                    self._off = True
            return self._channel

    def _register(self, size: int) -> tuple[mmap.mmap, str]:
        channel = self.channel()
        if channel is None and self._refused:
            raise _Refused(self._refused)
        if channel is None:
            raise FailedPrecondition(
                "shared memory needs a unix: target whose broker serves its link socket "
                f"{self.path or '<socket>.fast'}, and RemoteGpu(..., shared_memory=True)")
        while True:
            try:
                handle = self._released.pop()  # (another thread may take the last one first)
            except IndexError:
                break
            try:
                channel.release(handle)
            except GpuBrokerError as exc:  # already gone with its session: nothing to free
                log.debug("releasing segment %s: %s", handle, exc)
        fd = create_segment_fd(size)
        try:
            # Faulted in here, so the pages are allocated (and charged) to this process, not the broker's worker.
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED | mmap.MAP_POPULATE)
            try:
                return mm, channel.register(fd, size)
            except BaseException:
                mm.close()
                raise
        finally:
            os.close(fd)  # the worker holds its own mapping; ours lives in mm

    def host_array(self, shape: int | Sequence[int], dtype: Any = np.uint8) -> np.ndarray:
        """A numpy array in memory the worker has mapped: copies to and from it are one CopyShared, no copying."""
        dt = np.dtype(dtype)
        dims = (int(shape),) if isinstance(shape, (int, np.integer)) else tuple(int(d) for d in shape)
        if any(d < 0 for d in dims):
            raise InvalidArgument(f"negative dimension in shape {dims}")
        nbytes = math.prod(dims) * dt.itemsize
        try:
            mm, handle = self._register(max(nbytes, 1))
        except _Refused as exc:
            warnings.warn(f"host_array: the broker refused shared memory for this session ({exc}); this array is "
                          "plain host memory and copies of it go as Write and Read commands (slower). Close idle "
                          "RemoteGpu sessions, or ask the operator about the shared-memory connection limits.",
                          RuntimeWarning, stacklevel=3)
            return np.zeros(dims, dtype=dt)
        owner = np.frombuffer(mm, dtype=np.uint8, count=nbytes)
        # Every view of the result keeps ``owner`` alive (numpy stops collapsing bases at the mmap), so its
        # finalizer marks exactly when no array can reach the segment any more.
        self._arrays[handle] = (address_of(owner.data) if nbytes else 0, nbytes)
        weakref.finalize(owner, _forget, self._arrays, self._released, handle)
        array: np.ndarray = owner.view(dt).reshape(dims)
        return array

    def _find(self, address: int, size: int) -> tuple[str, int] | None:
        # Newest first: a fresh mapping can reuse the address range of a dead one.
        for handle, (base, length) in reversed(list(self._arrays.items())):
            if base <= address and address + size <= base + length:
                return handle, address - base
        return None

    def _staging_segment(self) -> tuple[mmap.mmap, str] | None:
        if self._staging is None and not self._staging_failed:
            try:
                self._staging = self._register(self.staging_bytes)
            except (GpuBrokerError, OSError) as exc:
                # Over the broker's per-session limit, say: Write and Read commands still work.
                log.debug("no staging segment (%s); copies go as commands", exc)
                self._staging_failed = True
        return self._staging

    # -- copies --------------------------------------------------------------------------------------
    def _copy_shared(self, segment: str, segment_offset: int, buf: Buffer, offset: int, size: int,
                     to_device: bool, stream: str) -> None:
        self._transport().call(CopyShared(segment, segment_offset, buf_ref(buf), offset, size, to_device, stream))

    def copy(self, host: memoryview, buf: Buffer, offset: int, stream: str, to_device: bool) -> bool:
        """Copy between ``host`` and ``buf`` through shared memory; False: not possible (Write and Read it)."""
        size = host.nbytes
        if size == 0 or self._off or not isinstance(buf, Buffer):
            return False  # (an empty copy still goes to the broker, which checks its handles)
        hit = self._find(address_of(host), size) if self._arrays else None
        if hit is not None:
            self._copy_shared(hit[0], hit[1], buf, offset, size, to_device, stream)
            return True
        # One Write or Read on the transport: a round trip, where staging costs a pipeline's worth. (Checked
        # before connecting: a session that only copies small things never opens the channel.)
        if size < STAGE_MIN or self.channel() is None:
            return False
        with self._staging_lock:
            staging = self._staging_segment()
            if staging is None:
                return False
            # Up front: a bad range must not leave a partial copy behind.
            check_device_range(buf, offset, size, "copy_h2d" if to_device else "copy_d2h")
            # (an array, not a memoryview released on exit: one a traceback still holds would raise BufferError)
            self._staged(host, np.frombuffer(staging[0], dtype=np.uint8), staging[1], buf, offset, to_device, stream)
        return True

    def _staged(self, host: memoryview, stage: np.ndarray, segment: str, buf: Buffer, offset: int,
                to_device: bool, stream: str) -> None:
        """A pipeline through the staging segment's slots, one CopyShared per slot, acknowledged per slot: this
        thread (with the copy pool) copies one piece between the caller's memory and a slot while the worker DMAs
        others between slots and the device. To the device, the worker DMAs slot i while slot i+1 is filled; to the
        host, it fills slots ahead while slot i is copied out (at its ack, before the slot's next command goes). A
        slot is reused only once the command that used it is acknowledged (and, to the host, copied out)."""
        transport = self._transport()
        ref = buf_ref(buf)
        user = np.frombuffer(host, dtype=np.uint8)
        slot = max(1, stage.nbytes // STAGING_SLOTS)
        last = [0] * STAGING_SLOTS  # per slot, the sequence number of the command that used it last
        start = 0
        for piece, n in enumerate(staged_pieces(host.nbytes, slot, to_device)):
            k = piece % STAGING_SLOTS
            at = k * slot
            if last[k]:
                transport.wait_for(last[k])
            command = CopyShared(segment, at, ref, offset + start, n, to_device, stream)
            if to_device:
                parallel_copy(stage[at:at + n], user[start:start + n])
                last[k] = transport.submit(command, on_result=_ignore)  # (a result ends its batch: sent now)
            else:
                # Copied out only once acknowledged: a failed piece leaves the caller's memory untouched.
                last[k] = transport.submit(command, on_result=_copy_out(stage[at:at + n], user[start:start + n]))
            start += n
        transport.wait(raise_error=True)

    def close(self) -> None:
        """Drop the channel and the staging buffer; host arrays stay valid host memory (their session ends)."""
        self._off = True
        with self._connect_lock:
            if self._channel is not None:
                self._channel.close()
                self._channel = None
        with self._staging_lock:
            if self._staging is not None:
                try:
                    self._staging[0].close()
                except BufferError:
                    pass  # a caller still holds a view of it; it unmaps when that goes
                self._staging = None
        self._arrays.clear()
