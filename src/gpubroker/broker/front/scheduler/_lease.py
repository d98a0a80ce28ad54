"""A worker's lease on its tenant's turns, for the device work its client links run without the front."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from gpubroker.broker.front.scheduler._device import DeviceScheduler
from gpubroker.wire.worker import Grant, LeaseToFront, LeaseToWorker, Released, Revoke, Want, Yield

__all__ = ["TurnLease"]

log = logging.getLogger("gpubroker.scheduler")


class TurnLease:
    """Turns taken on a worker's behalf: Want from the worker starts one, Released ends it.

    The scheduler preempts a lease like any holder: when others wait the worker is sent Yield (give the turn
    back as soon as the call in hand is done, so each of its calls is one turn, as through the front) and when
    the holder's slice is over, Revoke (give it back now). Messages go out in order, after the Grant.
    """

    def __init__(self, scheduler: DeviceScheduler, tenant: str,
                 send: Callable[[LeaseToWorker], Awaitable[None]]) -> None:
        self.scheduler = scheduler
        self.tenant = tenant
        self._send = send
        self._wanted = False
        self._task: asyncio.Task[None] | None = None
        self._released: asyncio.Future[None] | None = None
        self._granted = False
        self._asked = 0  # the strongest request (yield 1, revoke 2) made of the current turn
        self._closed = False

    def on_message(self, message: LeaseToFront) -> None:
        if isinstance(message, Want):
            self._wanted = True
            if self._task is None and not self._closed:
                self._task = asyncio.get_running_loop().create_task(self._hold())
        elif isinstance(message, Released) and self._released is not None and not self._released.done():
            self._released.set_result(None)

    def close(self) -> None:
        """The worker is gone: give back whatever turn is held for it."""
        self._closed = True
        if self._task is not None:
            self._task.cancel()

    async def _hold(self) -> None:
        try:
            # A Want that arrives while the last turn is being given back is served by the next round.
            while self._wanted and not self._closed:
                self._wanted = False
                self._released = asyncio.get_running_loop().create_future()
                self._granted, self._asked = False, 0
                async with self.scheduler.turn(self.tenant, preempt=self._preempt):
                    await self._send(Grant())
                    self._granted = True
                    if self._asked:  # asked to give the turn back before the worker even had it
                        await self._send(Revoke() if self._asked == 2 else Yield())
                    await self._released
        except asyncio.CancelledError:
            pass
        except Exception as exc:  # the worker died mid-lease: its turn is given back above
            log.info("lease for tenant %s ended: %s", self.tenant, exc)
        finally:
            self._task = None

    def _preempt(self, hard: bool) -> None:
        level = 2 if hard else 1
        if level <= self._asked or self._released is None or self._released.done():
            return
        self._asked = level
        if self._granted:
            task = asyncio.get_running_loop().create_task(self._ask(Revoke() if hard else Yield()))
            task.add_done_callback(lambda t: t.cancelled() or t.exception())

    async def _ask(self, message: LeaseToWorker) -> None:
        try:
            await self._send(message)
        except Exception:
            if self._released is not None and not self._released.done():
                self._released.set_result(None)  # nobody left to answer: end the turn here
