"""Device time of CUDA commands, measured by the GPU with timing events that bracket *segments*.

A segment is a run of commands on one stream: ``begin`` records a start event when the first command
after the last close is issued on that stream, and ``close`` records the end event once the host is done
issuing (the worker is about to wait for input, a synchronize, a blocking copy, a take). Not at every
batch end: a timing event between two kernels makes the GPU drain its queue, which dependent small
kernels feel. ``cudaEventElapsedTime`` of the pair is charged. So a launch normally costs one dict
lookup, not two ``cudaEventRecord`` calls.

Trade-off: inside a segment, time the stream sits idle waiting for the host to issue the next command
counts as device time (tiny kernels are charged at the host's issue rate; a link's brief poll for its
next batch too). Segments end whenever the worker waits for input and at every synchronize, and the
scheduler takes (fences) at slice ends, so host idle time between batches is not charged. A start
recorded while the stream is still busy with an earlier segment completes only after that work, so
segments never double count.

Synchronous round trips cost no events. Each ``cudaEventRecord`` costs the host ~2 us (H200), and a launch +
synchronize paid two of them, with their Python, on every round trip (~4-6 us of ~11). So:

- A segment begun while none of this device's work is unfinished (every stream synchronized since its last
  command: *quiet*) and ended by a synchronize that waits for it, with no other stream's work issued
  meanwhile, is charged its host wall time from its first command's issue to the synchronize's return: no end
  event. That bounds its device time from above (its work started after the issue, ran alone, and ended before
  the return) by the host's few microseconds around it, which a tenant holding the device keeps from everyone
  anyway (a slice that others waited for is charged its wall time regardless).
- Only while such runs are short: the host time after the work ends (the synchronizing thread's wake-up, its
  turn on the CPU and the GIL) is in the wall time, which a busy host can stretch. So once a synchronous run
  took longer than ``LONG_SYNC`` (host time: a long kernel, or a host that is late), the next ones get their end
  event again, recorded while their work still runs (its 2 us then hidden behind the wait), until one is short.
- Its start mark is recorded ahead (``anchor``: the worker calls it once it has answered a batch and the device
  is quiet, while its client reads the answer): the next segment begun while the device is still quiet takes
  that event as its start, with the host time between the two (its *lead*) taken off its elapsed time should
  it end with an end event (the anchor completed at once: the device was idle). An anchor older than
  ``ANCHOR_MAX_AGE`` is not used (a synchronous client's next call comes within microseconds to milliseconds,
  and the host's clock, which NTP may slew by 500 ppm, is compared with the GPU's), and without one ``begin``
  records its start event as before.
"""

from __future__ import annotations

import ctypes
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import cupy
from cupy.cuda import runtime

__all__ = ["ANCHOR_MAX_AGE", "LONG_SYNC", "DeviceTimer", "Waited"]

# Past this many unread pairs, completed ones are folded into a running total (bounded memory).
FOLD_PAIRS = 4096
# Idle events kept for reuse; more than this are destroyed.
POOL_MAX = 2 * FOLD_PAIRS

# An anchor older than this (seconds) is not a segment's start: over longer, the host's clock and the GPU's may have
# drifted apart by more than the microseconds a lead is measured in.
ANCHOR_MAX_AGE = 0.02
# A synchronous run longer than this (host seconds) makes the next ones record their end events (see above).
LONG_SYNC = 200e-6

# A closed segment: its start and end events and its lead (seconds to take off their elapsed time).
Pair = tuple[cupy.cuda.Event, cupy.cuda.Event, float]


@dataclass(slots=True)
class _Segment:
    """A stream's open segment."""

    start: cupy.cuda.Event  # its start mark: recorded at its first command, or the anchor recorded ahead
    began: float  # the host's perf_counter when its first command was issued
    lead: float  # how long before ``began`` its start mark was recorded (an anchor's), taken off its elapsed time
    quiet: bool  # begun with none of the device's work unfinished: a synchronize may charge its wall time


@dataclass(slots=True)
class Waited:
    """What ``close_for_sync`` handed to the synchronize after it (``synced``): the segments charged their wall
    time once it returns, when the synchronous run began that it ends (None: no such run), and the streams it
    waits for (with the count of their last ``begin``)."""

    walls: list[_Segment]
    began: float | None
    streams: dict[int, int]


def _elapsed(start: cupy.cuda.Event, end: cupy.cuda.Event, lead: float) -> float:
    """Seconds between two completed events, less ``lead`` (0.0 if the runtime cannot say)."""
    try:
        ms: float = cupy.cuda.get_elapsed_time(start, end)  # CuPy is untyped: a float of milliseconds
        return max(0.0, ms / 1000.0 - lead)
    except Exception:
        return 0.0


def _leak(objs: object) -> None:
    """Keep ``objs`` (and all it holds) alive for good: in a poisoned context each event's destructor
    (cudaEventDestroy) would only print a CUDA error, and the worker exits soon anyway."""
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(objs))


class DeviceTimer:
    """Event pairs of the segments issued since the last ``take``, plus the folded seconds of completed ones.

    ``begin``/``close`` are called with the backend's device current and ``lock`` held.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self._open: dict[int, _Segment] = {}  # stream pointer -> its open segment
        # Streams with commands issued since they were last synchronized, each with the count of its last
        # ``begin`` (a synchronize forgets a stream only if nothing began on it since it started): while this is
        # empty the device is quiet (none of this device's work unfinished).
        self._unfinished: dict[int, int] = {}
        self._begun = 0
        self._long_syncs = False  # the last synchronous run took longer than LONG_SYNC: end events for now
        self._anchor: tuple[cupy.cuda.Event, float] | None = None  # a start mark recorded ahead, and when
        self._pairs: list[Pair] = []
        self._pool: list[cupy.cuda.Event] = []
        self._folded = 0.0
        self._fold_at = FOLD_PAIRS

    def _event(self) -> cupy.cuda.Event:
        try:
            return self._pool.pop()
        except IndexError:
            return cupy.cuda.Event(block=False, disable_timing=False)

    def _recycle(self, *events: cupy.cuda.Event) -> None:
        # (an event recorded again while an earlier record is pending takes the new one: CUDA's rule)
        if len(self._pool) < POOL_MAX:
            self._pool.extend(events)

    def begin(self, stream_ptr: int) -> None:
        """Open a segment on the stream unless one is open. Call with ``lock`` held, right before issuing a
        command, and keep holding it until the command is issued (so a take cannot close the segment between)."""
        if stream_ptr in self._open:
            return
        now = time.perf_counter()
        quiet = not self._unfinished
        anchor, self._anchor = self._anchor, None
        if anchor is not None and quiet and now - anchor[1] < ANCHOR_MAX_AGE:
            segment = _Segment(anchor[0], now, now - anchor[1], True)
        else:
            if anchor is not None:
                self._recycle(anchor[0])
            event = self._event()
            runtime.eventRecord(event.ptr, stream_ptr)
            segment = _Segment(event, now, 0.0, quiet)
        self._open[stream_ptr] = segment
        self._begun += 1
        self._unfinished[stream_ptr] = self._begun

    def _wants_anchor(self) -> bool:
        """The device is quiet and no start mark young enough to use is recorded."""
        anchor = self._anchor
        return not self._unfinished and not self._open and (
            anchor is None or time.perf_counter() - anchor[1] >= ANCHOR_MAX_AGE)

    def anchor(self) -> None:
        """Record the next segment's start mark now, if the device is quiet and none is recorded: called where the
        host has a moment (the worker, once it answered a batch), so the next command does not pay for it.
        Takes ``lock``; call with the backend's device current. Raises the runtime's error."""
        if not self._wants_anchor():  # (looked at first without the lock: mostly there is nothing to do)
            return
        with self.lock:
            if not self._wants_anchor():
                return
            anchor = self._anchor
            event = self._event() if anchor is None else anchor[0]  # (one too old to use is recorded again)
            self._anchor = None
            runtime.eventRecord(event.ptr, 0)  # (the legacy default stream; the device is quiet: it completes now)
            self._anchor = (event, time.perf_counter())

    def close(self, stream_ptr: int | None = None) -> None:
        """Record the end mark of the open segment of one stream (or of all). Call with ``lock`` held."""
        ptrs = list(self._open) if stream_ptr is None else [stream_ptr] if stream_ptr in self._open else []
        for ptr in ptrs:
            self._end(ptr)
        if len(self._pairs) > self._fold_at:
            self._fold()

    def _end(self, ptr: int) -> None:
        """Record the end mark of ``ptr``'s open segment: its pair is read at the next take."""
        end = self._event()  # (first: were no event to be had, the segment stays open, for the next close)
        segment = self._open.pop(ptr)
        try:
            runtime.eventRecord(end.ptr, ptr)
        except Exception:
            pass  # an unrecorded end reads as 0.0; the error surfaces at the tenant's next call
        self._pairs.append((segment.start, end, segment.lead))

    def close_for_sync(self, stream_ptr: int | None = None) -> Waited:
        """``close`` before a synchronize of one stream (or of the device) that the host waits for next: a quiet
        segment that is the only unfinished work gets no end mark, and ``synced`` charges its wall time once the
        wait returns. Call with ``lock`` held; pass what it returns to ``synced``."""
        walls: list[_Segment] = []
        began: float | None = None
        ptrs = list(self._open) if stream_ptr is None else [stream_ptr] if stream_ptr in self._open else []
        for ptr in ptrs:
            segment = self._open[ptr]
            # A synchronous run: begun quiet, and no command began on any stream since (nothing else unfinished,
            # nor anything synchronized meanwhile, whose time would be in this wall time).
            if segment.quiet and len(self._unfinished) == 1 and self._unfinished[ptr] == self._begun:
                began = segment.began
                if not self._long_syncs:
                    del self._open[ptr]
                    walls.append(segment)
                    continue
            self._end(ptr)
        if len(self._pairs) > self._fold_at:
            self._fold()
        unfinished = self._unfinished
        streams = dict(unfinished) if stream_ptr is None else \
            {stream_ptr: unfinished[stream_ptr]} if stream_ptr in unfinished else {}
        return Waited(walls, began, streams)

    def _charge_walls(self, walls: list[_Segment], now: float) -> None:
        for segment in walls:
            self._folded += now - segment.began
            self._recycle(segment.start)

    def wait(self, waited: Waited, sync: Callable[[], object]) -> None:
        """Run ``sync``, the synchronize ``close_for_sync`` prepared (without the lock), then ``synced``: its
        streams finished only if it returned. Its error is raised."""
        try:
            sync()
        except BaseException:
            self.synced(waited, finished=False)
            raise
        self.synced(waited)

    def synced(self, waited: Waited, finished: bool = True) -> None:
        """The synchronize after ``close_for_sync`` returned: charge its segments their wall time, and (if it
        ``finished``: it did not fail) forget the streams it waited for that nothing began on since."""
        now = time.perf_counter()  # (before the lock: a take holding it is not this run's time)
        with self.lock:
            self._charge_walls(waited.walls, now)
            if waited.began is not None:
                self._long_syncs = now - waited.began > LONG_SYNC
            if finished:
                self._forget(waited.streams)

    def _forget(self, streams: dict[int, int]) -> None:
        """A wait for these streams' work returned: those nothing began on since are finished. Hold the lock."""
        unfinished = self._unfinished
        for ptr, begun in streams.items():
            if unfinished.get(ptr) == begun:
                del unfinished[ptr]

    def finished(self, streams: dict[int, int]) -> None:
        """A device-wide wait that began after ``take`` returned these streams has returned: see ``_forget``."""
        with self.lock:
            self._forget(streams)

    @property
    def busy(self) -> bool:
        """Whether a segment is open on some stream."""
        return bool(self._open)

    def flush(self) -> None:
        """Close every open segment: the host is about to stop issuing (the worker waits for input)."""
        if self._open:
            with self.lock:
                self.close()

    def _fold(self) -> None:
        """Fold completed pairs into the running total. Hold the lock; never raises."""
        keep: list[Pair] = []
        for start, end, lead in self._pairs:
            try:
                done = end.done  # the end mark is done only once the command and its start mark are
            except Exception:
                done = False
            if done:
                self._folded += _elapsed(start, end, lead)
                self._recycle(start, end)
            else:
                keep.append((start, end, lead))
        self._pairs = keep
        # Doubling keeps folding amortized O(1) per command even when the device runs far behind.
        self._fold_at = max(FOLD_PAIRS, 2 * len(keep))

    def take(self) -> tuple[list[Pair], float, dict[int, int]]:
        """Close the open segments, then detach the unread pairs and the folded seconds, resetting both; with
        the streams unfinished now (for ``finished``, once a device-wide wait after this returns)."""
        with self.lock:
            self.close()
            pairs, self._pairs = self._pairs, []
            total, self._folded = self._folded, 0.0
            self._fold_at = FOLD_PAIRS
            streams = dict(self._unfinished)
        return pairs, total, streams

    def settle_pairs(self, pairs: list[Pair], completed_only: bool = False) -> float:
        """Seconds of the pairs, once the device has finished them (or only of the completed ones)."""
        total = 0.0
        for start, end, lead in pairs:
            if completed_only:
                try:
                    if not end.done:
                        continue
                except Exception:
                    continue
            total += _elapsed(start, end, lead)
            self._recycle(start, end)
        return total

    def settle(self) -> None:
        """The device is idle for good (closing): fold every pair into the total and drop idle events."""
        with self.lock:
            self.close()
            pairs, self._pairs = self._pairs, []
            self._folded += self.settle_pairs(pairs)
            self._pool, self._anchor = [], None
            self._unfinished.clear()

    def abandon(self, pairs: list[Pair] | None = None) -> None:
        """After a fatal error: forget every pair and the total, and leak the events rather than destroy them."""
        with self.lock:
            if self._pairs or self._pool or pairs or self._open or self._anchor:
                _leak((self._pairs, self._pool, pairs, self._open, self._anchor))
            self._pairs, self._pool, self._open, self._anchor = [], [], {}, None
            self._unfinished.clear()
            self._folded = 0.0
            self._fold_at = FOLD_PAIRS
