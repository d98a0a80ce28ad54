"""The opencl backend's device-time accounting: every command's profiling event is kept until
take_device_time charges it; completed ones are folded into a running total so the list stays bounded.

``OpenCLTiming`` is one part of ``OpenCLBackend`` (in ``_opencl``); it holds the device state (``OpenCLDevice``)
for its lock, its closed flag and its queues.
"""

from __future__ import annotations

import contextlib
from typing import cast

import pyopencl as cl

from gpubroker.broker.backends._opencl_device import OpenCLDevice

__all__ = ["FOLD_EVENTS", "OpenCLTiming", "seconds_if_done"]

# Past this many untaken events, completed ones are folded into a running total (bounded memory). Read at call
# time, so patching it (as the tests do) takes effect on the next backend.
FOLD_EVENTS = 4096
_START, _END = cl.profiling_info.START, cl.profiling_info.END
_COMPLETE = cl.command_execution_status.COMPLETE


class OpenCLTiming:
    """take_device_time and the event bookkeeping behind it, for ``OpenCLBackend``."""

    def __init__(self, device: OpenCLDevice) -> None:
        self._dev = device
        self._lock = device.lock
        # Events of commands issued since the last take_device_time, plus the seconds of completed ones already
        # folded out of the list.
        self._events: list[cl.Event] = []
        self._folded = 0.0
        self._fold_at = FOLD_EVENTS

    def take_device_time(self) -> float:
        """Wait for all queued work, then return the device seconds spent by commands issued since the last
        call (kernels, copies, memsets, d2d), and reset the tally. Measured by OpenCL profiling, not the
        host clock; commands on different queues that overlapped each count in full. Never raises."""
        with self._lock:
            events, self._events = self._events, []
            total, self._folded = self._folded, 0.0
            self._fold_at = FOLD_EVENTS
            queues = [] if self._dev.closed else self._dev.all_queues()
        if not events:
            return total
        # Every event taken above was enqueued before these finishes, so each is complete afterwards.
        for queue in queues:
            with contextlib.suppress(cl.Error):  # a failed command surfaces at the caller's synchronize
                queue.finish()
        pending: list[cl.Event] = []
        for event in events:
            seconds = seconds_if_done(event)
            if seconds is None:
                pending.append(event)  # only if a finish failed: charge it at the next take
            else:
                total += seconds
        if pending:
            with self._lock:
                self._events[:0] = pending
        return total

    def track(self, event: cl.Event) -> None:
        """Keep a command's event for take_device_time; fold completed ones when too many pile up."""
        with self._lock:
            self._events.append(event)
            if len(self._events) > self._fold_at:
                self.fold_completed()
                # Doubling keeps the folding amortized O(1) per command even when the queue runs far behind.
                self._fold_at = max(FOLD_EVENTS, 2 * len(self._events))

    def charge(self, seconds: float) -> None:
        """Add device time measured otherwise (the host's clock, for work the CPU device did in NumPy)."""
        with self._lock:
            self._folded += seconds

    def fold_completed(self, drop_pending: bool = False) -> None:
        """Move the device time of completed (or failed) commands into the running total. Hold the lock."""
        keep: list[cl.Event] = []
        for event in self._events:
            seconds = seconds_if_done(event)
            if seconds is not None:
                self._folded += seconds
            elif not drop_pending:
                keep.append(event)
        self._events = keep


def seconds_if_done(event: cl.Event) -> float | None:
    """A finished command's device seconds (0.0 if it failed or has no profile), or None while it is queued
    or running."""
    try:
        status = int(event.command_execution_status)
        if status > _COMPLETE:
            return None
        if status < _COMPLETE:
            return 0.0  # the command failed: it has no profile to charge
        # Nanosecond timestamps: ints, which pyopencl's stubs type only as object.
        end, start = cast(int, event.get_profiling_info(_END)), cast(int, event.get_profiling_info(_START))
        return (end - start) * 1e-9
    except cl.Error:
        return 0.0
