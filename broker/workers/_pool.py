"""Workers by (tenant, device): started on first use, reaped when idle, replaced after a crash."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence

from ..sandbox import WorkerSandbox
from ._client import WorkerClient

__all__ = ["WorkerPool"]

log = logging.getLogger("gpubroker.workers")


class WorkerPool:
    def __init__(self, backend: str, start_timeout: float, idle_seconds: float,
                 on_worker_exit: Callable[[WorkerClient], None] | None = None,
                 ordinals: Sequence[int] | None = None, sandbox: WorkerSandbox | None = None) -> None:
        self.backend = backend
        self.sandbox = sandbox
        # The backend's own index of each of the broker's devices (config `devices` may pick and reorder them).
        self.ordinals = list(ordinals) if ordinals is not None else None
        self._on_worker_exit = on_worker_exit
        self.start_timeout = start_timeout
        self.idle_seconds = idle_seconds
        self._workers: dict[tuple[str, int], WorkerClient] = {}
        self._starting: dict[tuple[str, int], asyncio.Task[WorkerClient]] = {}
        self.restarts = 0
        # Workers that died or were killed under a live registration (crash, fatal device error, stuck compile),
        # by (tenant, device): the metrics endpoint's worker restarts.
        self.restarts_by: dict[tuple[str, int], int] = {}

    def workers(self) -> list[WorkerClient]:
        return list(self._workers.values())

    def live(self, tenant: str, device: int) -> WorkerClient | None:
        worker = self._workers.get((tenant, device))
        return worker if worker is not None and worker.alive else None

    async def get(self, tenant: str, device: int) -> WorkerClient:
        """The live worker for (tenant, device), starting one if needed; concurrent callers share a start."""
        key = (tenant, device)
        worker = self._workers.get(key)
        if worker is not None and worker.alive:
            return worker
        task = self._starting.get(key)
        if task is None:
            task = asyncio.create_task(self._start(key))
            self._starting[key] = task
            task.add_done_callback(lambda _t: self._starting.pop(key, None))
        return await asyncio.shield(task)

    async def _start(self, key: tuple[str, int]) -> WorkerClient:
        ordinal = self.ordinals[key[1]] if self.ordinals is not None else key[1]
        worker = WorkerClient(key[0], key[1], self.backend, on_exit=self._forget, ordinal=ordinal,
                              sandbox=self.sandbox)
        await worker.start(self.start_timeout)
        self._workers[key] = worker
        return worker

    def _forget(self, worker: WorkerClient) -> None:
        key = (worker.tenant, worker.device)
        if self._workers.get(key) is worker:
            del self._workers[key]
            self._count_restart(key)
        if self._on_worker_exit is not None:
            self._on_worker_exit(worker)

    def _count_restart(self, key: tuple[str, int]) -> None:
        self.restarts += 1
        self.restarts_by[key] = self.restarts_by.get(key, 0) + 1

    async def reap_idle(self, busy: set[tuple[str, int]]) -> None:
        """Stop workers with no sessions that have been idle longer than idle_seconds."""
        now = time.monotonic()
        for key, worker in list(self._workers.items()):
            if key not in busy and now - worker.last_used > self.idle_seconds:
                log.info("reaping idle worker for tenant %s on device %d", *key)
                del self._workers[key]
                await worker.stop()

    async def stop_tenant(self, tenant: str) -> None:
        for key, worker in list(self._workers.items()):
            if key[0] == tenant:
                del self._workers[key]
                await worker.stop()

    async def restart(self, worker: WorkerClient) -> None:
        """Kill a stuck worker (a compile past its timeout); the tenant's next session gets a fresh one."""
        key = (worker.tenant, worker.device)
        if self._workers.get(key) is worker:
            del self._workers[key]
            self._count_restart(key)
        await worker.kill()

    async def close(self) -> None:
        workers = list(self._workers.values())
        self._workers.clear()
        await asyncio.gather(*(w.stop() for w in workers), return_exceptions=True)
