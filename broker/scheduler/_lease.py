"""A worker's lease on its tenant's turns, for device calls its direct client links run without the front."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from ._device import DeviceScheduler

__all__ = ["TurnLease"]

log = logging.getLogger("gpubroker.scheduler")


class TurnLease:
    """Turns taken on a worker's behalf: "want" from the worker starts one, "released" ends it.

    The scheduler preempts a lease like any holder whose slice is over; the worker is then sent "revoke" and
    answers "released" once the call in hand is submitted, so a lease delays a switch by one call at most.
    """

    def __init__(self, scheduler: DeviceScheduler, tenant: str, send: Callable[[str], Awaitable[None]]) -> None:
        self.scheduler = scheduler
        self.tenant = tenant
        self._send = send
        self._wanted = False
        self._task: asyncio.Task[None] | None = None
        self._released: asyncio.Future[None] | None = None
        self._revoking = False
        self._closed = False

    def on_message(self, op: str) -> None:
        if op == "want":
            self._wanted = True
            if self._task is None and not self._closed:
                self._task = asyncio.get_running_loop().create_task(self._hold())
        elif op == "released" and self._released is not None and not self._released.done():
            self._released.set_result(None)

    def close(self) -> None:
        """The worker is gone: give back whatever turn is held for it."""
        self._closed = True
        if self._task is not None:
            self._task.cancel()

    async def _hold(self) -> None:
        try:
            # A "want" that arrives while the last turn is being given back is served by the next round.
            while self._wanted and not self._closed:
                self._wanted = False
                self._released = asyncio.get_running_loop().create_future()
                self._revoking = False
                async with self.scheduler.turn(self.tenant, preempt=self._preempt):
                    await self._send("grant")
                    await self._released
        except asyncio.CancelledError:
            pass
        except Exception as exc:  # the worker died mid-lease: its turn is given back above
            log.info("lease for tenant %s ended: %s", self.tenant, exc)
        finally:
            self._task = None

    def _preempt(self) -> None:
        if self._revoking or self._released is None or self._released.done():
            return
        self._revoking = True
        task = asyncio.get_running_loop().create_task(self._revoke())
        task.add_done_callback(lambda t: t.cancelled() or t.exception())

    async def _revoke(self) -> None:
        try:
            await self._send("revoke")
        except Exception:
            if self._released is not None and not self._released.done():
                self._released.set_result(None)  # nobody left to answer: end the turn here
