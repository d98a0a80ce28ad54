"""The opencl backend's device-time accounting: every command's profiling event is kept until
take_device_time charges it; completed ones are folded into a running total so the list stays bounded.

A mixin of ``OpenCLBackend`` (in ``_opencl``), which owns the state: ``_lock``, ``_events``, ``_folded``,
``_fold_at``, ``_closed`` and ``_all_queues()``. ``_opencl_host`` declares them for the type checker.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, cast

import pyopencl as cl

__all__ = ["FOLD_EVENTS", "OpenCLTimingMixin", "QUEUE_PROPS", "seconds_if_done"]

if TYPE_CHECKING:
    from gpubroker.broker.backends._opencl_host import OpenCLHost
else:
    OpenCLHost = object  # the type checker's view of OpenCLBackend's members; a plain mixin at run time

# Every queue profiles its commands, so take_device_time can charge what the device really spent.
QUEUE_PROPS = cl.command_queue_properties.PROFILING_ENABLE
# Past this many untaken events, completed ones are folded into a running total (bounded memory).
FOLD_EVENTS = 4096
_START, _END = cl.profiling_info.START, cl.profiling_info.END
_COMPLETE = cl.command_execution_status.COMPLETE


class OpenCLTimingMixin(OpenCLHost):
    """take_device_time and the event bookkeeping behind it, for ``OpenCLBackend``."""

    def _fold_floor(self) -> int:
        """The fewest untaken events that trigger a fold; ``OpenCLBackend`` overrides it (see there)."""
        return FOLD_EVENTS

    def take_device_time(self) -> float:
        """Wait for all queued work, then return the device seconds spent by commands issued since the last
        call (kernels, copies, memsets, d2d), and reset the tally. Measured by OpenCL profiling, not the
        host clock; commands on different queues that overlapped each count in full. Never raises."""
        with self._lock:
            events, self._events = self._events, []
            total, self._folded = self._folded, 0.0
            self._fold_at = self._fold_floor()
            queues = [] if self._closed else self._all_queues()
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

    def _track(self, event: cl.Event) -> None:
        """Keep a command's event for take_device_time; fold completed ones when too many pile up."""
        with self._lock:
            self._events.append(event)
            if len(self._events) > self._fold_at:
                self._fold_completed()
                # Doubling keeps the folding amortized O(1) per command even when the queue runs far behind.
                self._fold_at = max(self._fold_floor(), 2 * len(self._events))

    def _fold_completed(self, drop_pending: bool = False) -> None:
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
