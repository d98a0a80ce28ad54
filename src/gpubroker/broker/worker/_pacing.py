"""Pacing: while other tenants want the device, a worker keeps its queue of launched work short, so the tenant whose
turn comes next waits for about one kernel of this one's, not for everything this one queued.

Kernels cannot be preempted, and the scheduler's fence waits for all the holder queued (scheduler/_device.py): a
tenant that queues four 2 ms kernels in one batch makes the next tenant wait up to 8 ms however short the slice,
and a batch under way holds the turn until it ends. So while others have waited for the device recently (a Yield
came within ``PACE_HOLD``), the worker issues a link batch's launches and library calls paced:

- before each, it waits until fewer than ``depth`` of its earlier ones are unfinished (a completion mark recorded
  after each: an event, not a timing one), across batches: a client without ``async_commands`` sends each launch
  as a batch of its own, and one slice of a few milliseconds would otherwise queue several kernels. ``depth``
  adapts: 1 while the wait for the oldest took longer than ``LONG`` (long kernels go one at a time: the gap
  between two is one host wake-up, ~1 % of a 2 ms kernel), one more per short wait up to ``MAX_DEPTH`` (short
  kernels keep the device busy, and at most about ``MAX_DEPTH`` x ``LONG`` of them are queued);
- then, if the front has a message (a Revoke: the slice is over), the batch stops before that command
  (``Paused``): the serve loop reads the message, and the batch goes on where it stopped while the worker still
  holds the turn, or at its next one. The Ack goes out once the whole batch ran, as always. A batch that goes on
  runs one command before it may stop again, so it always gets on.

A lone tenant is never paced (nobody waits for it). A backend without completion marks is never paced. Batches
that come through the front (gRPC clients, module loads) are not paced: the front holds their turn for the call.
A worker runs a tenant's code: one that does not pace is cut at the kernel time limit like any holder.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

from gpubroker.wire.compute import GpuCompute
from gpubroker.wire.types import Stream

__all__ = ["LONG", "MAX_DEPTH", "PACE_HOLD", "Pacer"]

# Pacing lasts this long after the last sign that others wait (a Yield): the scheduler sends one per turn while
# they do, and turns are milliseconds.
PACE_HOLD = 1.0
# A wait for the oldest unfinished launch longer than this means kernels are long: one at a time.
LONG = 250e-6
# Short kernels may be this many deep (at most MAX_DEPTH x LONG of queued work).
MAX_DEPTH = 8


class Pacer:
    """Paces one worker's link batches while others want the device (see the module's docstring)."""

    def __init__(self, mark: Callable[[Stream | None], object], wait_mark: Callable[[object], bool],
                 front_waiting: Callable[[], bool], clock: Callable[[], float] = time.monotonic) -> None:
        # A backend's completion marks: one recorded on a stream after the work issued on it so far, and a wait
        # for one, which says whether the mark was unfinished (each mark is waited for once, then the backend may
        # reuse it).
        self._mark = mark
        self._wait_mark = wait_mark
        self._front_waiting = front_waiting
        self._clock = clock
        self._until = float("-inf")
        self._pending: deque[object] = deque()  # marks of launches maybe unfinished, oldest first
        self.depth = 1

    @classmethod
    def for_backend(cls, backend: GpuCompute, front_waiting: Callable[[], bool]) -> Pacer | None:
        """A pacer for ``backend`` if it offers completion marks (``mark`` and ``wait_mark``), else None."""
        mark: Callable[[Stream | None], object] | None = getattr(backend, "mark", None)
        wait_mark: Callable[[object], bool] | None = getattr(backend, "wait_mark", None)
        return None if mark is None or wait_mark is None else cls(mark, wait_mark, front_waiting)

    def others_waited(self) -> None:
        """Another tenant waits for the device (the front sent a Yield): pace from now on, for PACE_HOLD."""
        self._until = self._clock() + PACE_HOLD

    @property
    def active(self) -> bool:
        return self._clock() < self._until

    @property
    def unfinished(self) -> int:
        """Paced commands issued whose completion was not waited for (some may be done)."""
        return len(self._pending)

    def before(self) -> bool:
        """Before a paced command: wait until fewer than ``depth`` earlier ones are unfinished; then whether the
        front has a message (the batch should stop here)."""
        pending = self._pending
        while len(pending) >= self.depth:
            started = time.perf_counter()
            if self._wait_mark(pending.popleft()):
                # (only a wait tells a kernel's length: a mark found done, the fence's work perhaps, says nothing)
                waited = time.perf_counter() - started
                self.depth = 1 if waited > LONG else min(self.depth + 1, MAX_DEPTH)
        return self._front_waiting()

    def after(self, stream: Stream | None) -> None:
        """A paced command was issued on ``stream``: mark its completion."""
        self._pending.append(self._mark(stream))

