"""Device time of CUDA commands, measured by the GPU: a pair of timing events brackets each command.

The CUDA backend records ``start`` on the command's stream right before issuing it and ``stop`` right
after; ``cudaEventElapsedTime`` of the pair is what the device spent on that command. Events are reused
once their pair has been read, so a launch costs two ``cudaEventRecord`` calls, not two event creations.
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
        return cupy.cuda.get_elapsed_time(start, end) / 1000.0
    except Exception:
        return 0.0


def _leak(objs: object) -> None:
    """Keep ``objs`` (and all it holds) alive for good: in a poisoned context each event's destructor
    (cudaEventDestroy) would only print a CUDA error, and the worker exits soon anyway."""
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(objs))


class DeviceTimer:
    """Event pairs of the commands issued since the last ``take``, plus the folded seconds of completed ones.

    ``start``/``stop``/``cancel`` are called around each command with the backend's device current.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
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

    def start(self, stream_ptr: int) -> cupy.cuda.Event:
        """Record the start mark of a command about to be issued on the stream."""
        event = self._event()
        runtime.eventRecord(event.ptr, stream_ptr)
        return event

    def stop(self, start: cupy.cuda.Event, stream_ptr: int) -> None:
        """Record the end mark of the command just issued, and keep the pair until the next take."""
        end = self._event()
        runtime.eventRecord(end.ptr, stream_ptr)
        with self._lock:
            self._pairs.append((start, end))
            if len(self._pairs) > self._fold_at:
                self._fold()

    def cancel(self, start: cupy.cuda.Event | None) -> None:
        """The command was not issued: its start mark goes back to the pool."""
        if start is not None and len(self._pool) < POOL_MAX:
            self._pool.append(start)

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
        """Detach the unread pairs and the folded seconds, resetting both."""
        with self._lock:
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
        with self._lock:
            pairs, self._pairs = self._pairs, []
            self._folded += self.settle_pairs(pairs)
            self._pool = []

    def abandon(self, pairs: list[Pair] | None = None) -> None:
        """After a fatal error: forget every pair and the total, and leak the events rather than destroy them."""
        with self._lock:
            if self._pairs or self._pool or pairs:
                _leak((self._pairs, self._pool, pairs))
            self._pairs, self._pool = [], []
            self._folded = 0.0
            self._fold_at = FOLD_PAIRS
