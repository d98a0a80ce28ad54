"""Shared-memory segments in the worker: memfds a same-host client registered, mapped for CopyShared.

The front passes each fd on a socketpair of its own (``--fd-channel``) just ahead of the ``register_segment``
request, with a one-time token; the worker maps it without populating it, so a segment costs the worker nothing
until a copy touches it (only the pages a copy touches are faulted in). On CUDA the first copy that uses a
segment page-locks all of it (cudaHostRegister, which faults in and pins every page), so copies to and from it
run at pinned-memory speed without a staging copy: the pinning is deferred rather than partial, since a copy
spanning two separately registered ranges would not be one DMA. A segment that no copy uses is never pinned.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from gpubroker.wire.errors import FailedPrecondition, GpuBrokerError, Internal, InvalidArgument, OutOfRange

__all__ = ["Segment", "SegmentTable"]

log = logging.getLogger("gpubroker.worker")
# How long to wait for an fd the front has already sent: only a front bug would make this wait at all.
_FD_TIMEOUT = 10.0


@dataclass
class Segment:
    mm: mmap.mmap
    size: int
    pinned: int | None = None  # the host address the backend page-locked, if it did
    pin_tried: bool = False  # pinned at the first copy that uses it (or found not pinnable then)


class SegmentTable:
    """Maps, pins and unmaps segments; the session's handle table (workers/_handles.py) names them by the
    client's handles."""

    def __init__(self, backend: Any, channel: socket.socket | None = None) -> None:
        self.backend = backend
        self.channel = channel

    def set_channel(self, channel: socket.socket) -> None:
        channel.settimeout(_FD_TIMEOUT)
        self.channel = channel

    def receive(self, token: bytes) -> int:
        """The one fd the front sent with the current request, checked against its one-time token."""
        return self.receive_all(token, 1)[0]

    def receive_all(self, token: bytes, count: int) -> list[int]:
        """The ``count`` fds the front sent with the current request, checked against its one-time token. (The
        only descriptors a sandboxed worker can receive: its seccomp filter refuses recvmsg on every other socket,
        sandbox/_seccomp.py.)"""
        if self.channel is None:
            raise FailedPrecondition("this worker has no fd channel (started without --fd-channel)")
        try:
            data, fds, flags, _ = socket.recv_fds(self.channel, 64, 4)
        except OSError as exc:
            raise Internal(f"no file descriptor arrived on the fd channel: {exc}") from None
        if data != token or len(fds) != count or flags & socket.MSG_CTRUNC:
            for fd in fds:
                os.close(fd)
            raise Internal("the fd channel is out of step with the requests")
        return fds

    def register(self, token: bytes, size: Any) -> Segment:
        """Receive the fd sent with this request and map ``size`` bytes of it (page-locked at its first copy)."""
        fd = self.receive(bytes(token))  # first, whatever else is wrong: the next request's fd must stay next
        try:
            if not isinstance(size, int) or size <= 0:
                raise InvalidArgument(f"segment size must be > 0, got {size}")
            # No MAP_POPULATE: pages the client never touched must not be allocated (and charged to this worker)
            # by mapping them; max_shared_bytes_per_session and _per_tenant bound what a client may register.
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as exc:
            raise InvalidArgument(f"cannot map the segment: {exc.strerror}") from None
        finally:
            os.close(fd)  # the mapping keeps the memory; the client's memfd name stays visible in /proc maps
        return Segment(mm, size)

    def _pin(self, seg: Segment) -> None:
        """Page-lock a segment at its first copy, where the backend can (CUDA); only slower where it cannot."""
        seg.pin_tried = True
        register = getattr(self.backend, "register_host_memory", None)
        if register is None:
            return
        try:
            seg.pinned = register(seg.mm)
        except GpuBrokerError as exc:
            if exc.details.get("fatal"):
                raise
            # Pageable copies still work: worth a warning, not a refusal.
            log.warning("segment of %d bytes not page-locked: %s", seg.size, exc.message)

    def _for_copy(self, seg: Segment, offset: int, size: int) -> None:
        """A copy of ``[offset, offset + size)`` of a segment is coming: the range checked, the segment page-locked
        at its first copy."""
        if offset < 0 or size < 0:
            raise InvalidArgument(f"segment offset and size must be >= 0, got {offset} and {size}")
        if offset + size > seg.size:
            raise OutOfRange(f"{size} bytes at segment offset {offset} run past the end of the {seg.size}-byte "
                             "segment")
        if not seg.pin_tried and size > 0:
            self._pin(seg)

    def address(self, seg: Segment, offset: int, size: int) -> int | None:
        """The host address of ``[offset, offset + size)`` of a segment the backend page-locked (at its first
        copy, as ``view`` does), checked as ``view`` checks it; None where it is not page-locked (then ``view``).
        The address is the worker's own, from the backend's registration: nothing a client sent but the range."""
        self._for_copy(seg, offset, size)
        return None if seg.pinned is None else seg.pinned + offset

    @contextlib.contextmanager
    def view(self, seg: Segment, offset: int, size: int) -> Iterator[memoryview]:
        """A memoryview of ``[offset, offset + size)`` of a segment, released on exit so it can be unmapped."""
        self._for_copy(seg, offset, size)
        whole = memoryview(seg.mm)
        part = whole[offset:offset + size]
        try:
            yield part
        finally:
            # A traceback may still hold an array made from it; then it unmaps when that is gone.
            with contextlib.suppress(BufferError):
                part.release()
                whole.release()

    def release(self, seg: Segment) -> None:
        if seg.pinned is not None:
            try:
                self.backend.unregister_host_memory(seg.pinned)
            except GpuBrokerError as exc:
                log.warning("unregistering a segment's host memory: %s", exc.message)
        try:
            seg.mm.close()
        except BufferError:
            log.warning("a %d-byte segment is still referenced; it unmaps when that goes", seg.size)
