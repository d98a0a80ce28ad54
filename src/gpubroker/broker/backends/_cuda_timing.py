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
"""

from __future__ import annotations

import ctypes
import threading

import cupy
from cupy.cuda import runtime

__all__ = ["DeviceTimer"]

# Past this many unread pairs, completed ones are folded into a running total (bounded memory).
FOLD_PAIRS = 4096
# Idle events kept for reuse; more than this are destroyed.
POOL_MAX = 2 * FOLD_PAIRS

Pair = tuple[cupy.cuda.Event, cupy.cuda.Event]


def _elapsed(start: cupy.cuda.Event, end: cupy.cuda.Event) -> float:
    """Seconds between two completed events on one stream (0.0 if the runtime cannot say)."""
    try:
        ms: float = cupy.cuda.get_elapsed_time(start, end)  # CuPy is untyped: a float of milliseconds
        return ms / 1000.0
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
        self._open: dict[int, cupy.cuda.Event] = {}  # stream pointer -> start event of its open segment
        self._pairs: list[Pair] = []
        self._pool: list[cupy.cuda.Event] = []
        self._folded = 0.0
        self._fold_at = FOLD_PAIRS

    def _event(self) -> cupy.cuda.Event:
        try:
            return self._pool.pop()
        except IndexError:
            return cupy.cuda.Event(block=False, disable_timing=False)

    def _recycle(self, start: cupy.cuda.Event, end: cupy.cuda.Event) -> None:
        if len(self._pool) < POOL_MAX:
            self._pool.append(start)
            self._pool.append(end)

    def begin(self, stream_ptr: int) -> None:
        """Open a segment on the stream unless one is open. Call with ``lock`` held, right before issuing a
        command, and keep holding it until the command is issued (so a take cannot close the segment between)."""
        if stream_ptr not in self._open:
            event = self._event()
            runtime.eventRecord(event.ptr, stream_ptr)
            self._open[stream_ptr] = event

    def close(self, stream_ptr: int | None = None) -> None:
        """Record the end mark of the open segment of one stream (or of all). Call with ``lock`` held."""
        ptrs = list(self._open) if stream_ptr is None else [stream_ptr] if stream_ptr in self._open else []
        for ptr in ptrs:
            start, end = self._open.pop(ptr), self._event()
            try:
                runtime.eventRecord(end.ptr, ptr)
            except Exception:
                pass  # an unrecorded end reads as 0.0; the error surfaces at the tenant's next call
            self._pairs.append((start, end))
        if len(self._pairs) > self._fold_at:
            self._fold()

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
        for start, end in self._pairs:
            try:
                done = end.done  # the end mark is done only once the command and its start mark are
            except Exception:
                done = False
            if done:
                self._folded += _elapsed(start, end)
                self._recycle(start, end)
            else:
                keep.append((start, end))
        self._pairs = keep
        # Doubling keeps folding amortized O(1) per command even when the device runs far behind.
        self._fold_at = max(FOLD_PAIRS, 2 * len(keep))

    def take(self) -> tuple[list[Pair], float]:
        """Close the open segments, then detach the unread pairs and the folded seconds, resetting both."""
        with self.lock:
            self.close()
            pairs, self._pairs = self._pairs, []
            total, self._folded = self._folded, 0.0
            self._fold_at = FOLD_PAIRS
        return pairs, total

    def settle_pairs(self, pairs: list[Pair], completed_only: bool = False) -> float:
        """Seconds of the pairs, once the device has finished them (or only of the completed ones)."""
        total = 0.0
        for start, end in pairs:
            if completed_only:
                try:
                    if not end.done:
                        continue
                except Exception:
                    continue
            total += _elapsed(start, end)
            self._recycle(start, end)
        return total

    def settle(self) -> None:
        """The device is idle for good (closing): fold every pair into the total and drop idle events."""
        with self.lock:
            self.close()
            pairs, self._pairs = self._pairs, []
            self._folded += self.settle_pairs(pairs)
            self._pool = []

    def abandon(self, pairs: list[Pair] | None = None) -> None:
        """After a fatal error: forget every pair and the total, and leak the events rather than destroy them."""
        with self.lock:
            if self._pairs or self._pool or pairs or self._open:
                _leak((self._pairs, self._pool, pairs, self._open))
            self._pairs, self._pool, self._open = [], [], {}
            self._folded = 0.0
            self._fold_at = FOLD_PAIRS
