"""Workers by (tenant, device): started on first use, reaped when idle, replaced after a crash.

Each worker's death is charged to its cause, once:

- to nobody when the front stopped it (idle, the tenant removed, the broker stopping) or retired it (a credential
  it ran something for was revoked: ``retire``), or when it died of a
  stop signal (SIGTERM, SIGINT, SIGHUP: an operator's or a service manager's, as at a drain) while the broker
  drains or stops;
- to its tenant when the tenant's code may have caused it: any tenant request was served (a kernel, a compile,
  a module load...), the front killed it for the tenant (a time limit, a lie: ``restart`` with a fault), or
  it exited after a fatal device error its tenant's kernel caused. The tenant's crash budget counts these;
- to the device otherwise (a worker that fails before any tenant code ran): the device's health counts those.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import signal
import time
from collections import deque
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

from gpubroker.broker.front.workers._client import DEFAULT_SEND_BUFFER, DEFAULT_WRITE_STALL, EXIT_FATAL, WorkerClient
from gpubroker.broker.front.workers._zygote import Zygote
from gpubroker.broker.sandbox import WorkerSandbox
from gpubroker.wire.errors import GpuBrokerError, Unavailable
from gpubroker.wire.worker import MAX_FRAME, SetLimits

__all__ = ["TenantCrashes", "WorkerPool"]

log = logging.getLogger("gpubroker.workers")

_STOP_SIGNALS = frozenset({-signal.SIGTERM, -signal.SIGINT, -signal.SIGHUP})
# A stop signal sent to the whole process group reaches the workers and the front together; the front's own
# handler (which starts the drain) runs on its event loop, perhaps just after it reads a worker's end. So such a
# death is judged this much later, once the front knows whether it is draining.
_SIGNAL_SETTLE_SECONDS = 0.5


class TenantCrashes:
    """Per tenant, the worker deaths its own code caused within a sliding window, and the back-off they earn.

    With ``budget`` deaths within ``window`` seconds the tenant's new sessions are refused (UNAVAILABLE, with a
    retry hint) until the oldest of them leaves the window; ``budget`` <= 0 never refuses.
    """

    def __init__(self, budget: int, window: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.budget = budget
        self.window = window
        self._clock = clock
        self._deaths: dict[str, deque[tuple[float, str]]] = {}
        self.total: dict[str, int] = {}  # every death charged, for the metrics (a counter)

    def record(self, tenant: str, reason: str) -> None:
        deaths = self._deaths.setdefault(tenant, deque())
        deaths.append((self._clock(), reason))
        self.total[tenant] = self.total.get(tenant, 0) + 1
        self._expire(tenant)
        if self.budget > 0 and len(deaths) > self.budget:
            deaths.popleft()  # only the last `budget` matter for the back-off
        left = self.backoff(tenant)
        if left is not None:
            log.warning("tenant %s: %d worker crashes of its own within %g s (the last: %s); its new sessions are "
                        "refused for %.0f s", tenant, len(deaths), self.window, reason, left)
        else:
            log.warning("tenant %s: a worker crash of its own (%d within %g s, budget %d): %s", tenant,
                        len(deaths), self.window, self.budget, reason)

    def _expire(self, tenant: str) -> deque[tuple[float, str]]:
        deaths = self._deaths.get(tenant, deque())
        while deaths and deaths[0][0] <= self._clock() - self.window:
            deaths.popleft()
        return deaths

    def forget(self, tenant: str) -> None:
        """The tenant was removed: its back-off is not its successor's under the same name (the total stays)."""
        self._deaths.pop(tenant, None)

    def recent(self, tenant: str) -> int:
        return len(self._expire(tenant))

    def backoff(self, tenant: str) -> float | None:
        """Seconds until the tenant may open sessions again; None while it is within its budget."""
        deaths = self._expire(tenant)
        if self.budget <= 0 or len(deaths) < self.budget:
            return None
        return max(0.0, deaths[-self.budget][0] + self.window - self._clock())

    def check(self, tenant: str) -> None:
        """Refuse a new session of a tenant over its crash budget, saying why and when to retry."""
        left = self.backoff(tenant)
        if left is None:
            return
        deaths = self._deaths[tenant]
        raise Unavailable(
            f"tenant {tenant!r} crashed its workers {len(deaths)} times within {self.window:g} s (the last: "
            f"{deaths[-1][1]}); its new sessions are refused for {left:.0f} s", reason="tenant crash budget",
            retry_after_seconds=round(max(1.0, left), 1))


def _spawn(tasks: set[asyncio.Task[None]], work: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
    """``work`` in a task of its own, kept in ``tasks`` until it ends."""
    task = asyncio.create_task(work, name=name)
    tasks.add(task)
    task.add_done_callback(tasks.discard)
    return task


class WorkerPool:
    def __init__(self, backend: str, start_timeout: float, idle_seconds: float,
                 on_worker_exit: Callable[[WorkerClient], None] | None = None,
                 ordinals: Sequence[int] | None = None, crash_budget: int = 0, crash_window: float = 60.0,
                 on_failure: Callable[[WorkerClient], None] | None = None,
                 max_reply_bytes: int = MAX_FRAME, sandbox: WorkerSandbox | None = None,
                 clock: Callable[[], float] = time.monotonic, send_buffer_bytes: int = DEFAULT_SEND_BUFFER,
                 write_stall_seconds: float = DEFAULT_WRITE_STALL) -> None:
        self.backend = backend
        self.sandbox = sandbox
        self.zygote: Zygote | None = None  # forks the sandboxed workers' launchers (the server starts it)
        # The backend's own index of each of the broker's devices (config `devices` may pick and reorder them).
        self.ordinals = list(ordinals) if ordinals is not None else None
        self._on_worker_exit = on_worker_exit
        # Called once a death's cause is settled and it is someone's failure (worker.blame is "tenant" or
        # "device"): the device's health counts the device's.
        self._on_failure = on_failure
        self.start_timeout = start_timeout
        self.idle_seconds = idle_seconds
        self.max_reply_bytes = max_reply_bytes
        self.send_buffer_bytes = send_buffer_bytes
        self.write_stall_seconds = write_stall_seconds
        self._workers: dict[tuple[str, int], WorkerClient] = {}
        self._starting: dict[tuple[str, int], asyncio.Task[WorkerClient]] = {}
        self.restarts = 0
        # Workers that died or were killed under a live registration (crash, fatal device error, stuck compile),
        # by (tenant, device): the metrics endpoint's worker restarts.
        self.restarts_by: dict[tuple[str, int], int] = {}
        # Bytes of workers' output dropped over the per-worker rate limit, by tenant (workers/_output.py).
        self.output_dropped: dict[str, int] = {}
        # Workers killed for device memory, by (tenant, device, cause: WorkerClient.memory_kill), each also one of
        # its tenant's crashes: gpubroker_device_memory_kills.
        self.memory_kills: dict[tuple[str, int, str], int] = {}
        self.crashes = TenantCrashes(crash_budget, crash_window, clock)
        # Set when the broker drains or stops: stop signals then are the operator's, not failures.
        self.draining = False
        self._settling: dict[int, asyncio.TimerHandle] = {}
        # What each worker enforces (memory quota, handles and streams per session), sent right after it starts
        # and at every reload; and where its reports of memory use go (the sessions' mirror).
        self.limits: Callable[[str, int], SetLimits] | None = None
        self.on_memory: Callable[[WorkerClient, int], None] | None = None
        # Requests to workers (limits at a reload) and stops (idle workers) that nobody waits for in line.
        self._requests: set[asyncio.Task[None]] = set()
        self._stops: set[asyncio.Task[None]] = set()

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

    def _output_dropped(self, tenant: str, nbytes: int) -> None:
        self.output_dropped[tenant] = self.output_dropped.get(tenant, 0) + nbytes

    def _client(self, key: tuple[str, int], zygote: Zygote | None) -> WorkerClient:
        ordinal = self.ordinals[key[1]] if self.ordinals is not None else key[1]
        return WorkerClient(key[0], key[1], self.backend, on_exit=self._forget, ordinal=ordinal,
                            sandbox=self.sandbox, max_reply_bytes=self.max_reply_bytes,
                            on_output_dropped=functools.partial(self._output_dropped, key[0]),
                            send_buffer_bytes=self.send_buffer_bytes, write_stall_seconds=self.write_stall_seconds,
                            zygote=zygote)

    async def _start(self, key: tuple[str, int]) -> WorkerClient:
        worker = self._client(key, self.zygote)
        try:
            await worker.start(self.start_timeout)
        except GpuBrokerError as exc:
            if not worker.forked or self.zygote is None:
                raise
            # A start runs none of the tenant's code: a worker the zygote forked that fails to start is tried again
            # at once as before (exec'd). Should that one start, the zygote is what failed: it is given up.
            worker = self._client(key, None)
            await worker.start(self.start_timeout)
            self.zygote.give_up(f"tenant {key[0]}'s worker on device {key[1]}, forked by it, failed to start "
                                f"({exc.message}) where an exec'd one started")
        worker.on_memory = self.on_memory
        if self.limits is not None:
            limits = self.limits(*key)
            worker.quota_sent(limits.memory_quota)
            try:  # before any session can use it: the quota holds from the first allocation
                await worker.call(limits)
            except BaseException:
                await worker.kill()
                raise
        self._workers[key] = worker
        return worker

    def apply_limits(self) -> list[asyncio.Task[None]]:
        """Send every live worker its limits again (the config was reloaded), each in a task of its own: the caller
        never waits in line behind a worker that does not answer (a tenant's kernel may hold its worker for as long
        as it likes). A worker reads its requests in order, so the limits hold for everything the front sends it
        after this; its reply, whenever it comes, holds nothing but that task. The tasks, for a caller that may wait
        a bounded time for those that answer."""
        if self.limits is None:
            return []
        tasks = []
        for (tenant, device), worker in list(self._workers.items()):
            if worker.alive:
                limits = self.limits(tenant, device)
                worker.quota_sent(limits.memory_quota)  # (before the worker may use it)
                tasks.append(_spawn(self._requests, self._set_limits(worker, limits), f"set-limits-{tenant}-{device}"))
        return tasks

    @staticmethod
    async def _set_limits(worker: WorkerClient, limits: SetLimits) -> None:
        try:
            await worker.call(limits)
        except GpuBrokerError as exc:  # (it died meanwhile: its death is reported on its own)
            log.info("set_limits for tenant %s on device %d: %s", worker.tenant, worker.device, exc.message)

    def _forget(self, worker: WorkerClient) -> None:
        """The worker's death (reported once per worker by WorkerClient): unregister it and charge its cause."""
        key = (worker.tenant, worker.device)
        if self._workers.get(key) is worker:
            del self._workers[key]
        code = worker.returncode
        if not worker.stopping and worker.fault is None and code in _STOP_SIGNALS:
            self._settling[id(worker)] = asyncio.get_running_loop().call_later(
                _SIGNAL_SETTLE_SECONDS, self._settle, worker)
        else:
            self._charge(worker, self._blame(worker))
        if self._on_worker_exit is not None:
            self._on_worker_exit(worker)

    def _settle(self, worker: WorkerClient) -> None:
        self._settling.pop(id(worker), None)
        self._charge(worker, None if self.draining else self._blame(worker))

    def _blame(self, worker: WorkerClient) -> str | None:
        code = worker.returncode
        if worker.retired or worker.lost_with_zygote:
            return None
        if worker.stopping and worker.fault is None:
            return None
        if worker.fault is not None or worker.tenant_code_ran or code == EXIT_FATAL:
            return "tenant"
        if code == 0:
            return None  # it left on its own before serving anyone: odd, but nobody's failure
        return "device"

    def _charge(self, worker: WorkerClient, blame: str | None) -> None:
        worker.blame = blame
        if blame is None:
            how = (f"retired: {worker.fault.message}" if worker.retired and worker.fault is not None
                   else "its launcher ended with the workers' zygote" if worker.lost_with_zygote
                   else "stopped" if worker.stopping else "stopped by a signal while the broker drains")
            log.info("worker for tenant %s on device %d ended: no failure (%s)", worker.tenant, worker.device, how)
            return
        self._count_restart((worker.tenant, worker.device))
        if blame == "tenant":
            if worker.memory_kill is not None:
                kill = (worker.tenant, worker.device, worker.memory_kill)
                self.memory_kills[kill] = self.memory_kills.get(kill, 0) + 1
            self.crashes.record(worker.tenant, worker.death or "the worker died")
        else:
            log.error("device %d: worker for tenant %s failed before running any tenant code: %s", worker.device,
                      worker.tenant, worker.death)
        if self._on_failure is not None:
            self._on_failure(worker)

    def _count_restart(self, key: tuple[str, int]) -> None:
        self.restarts += 1
        self.restarts_by[key] = self.restarts_by.get(key, 0) + 1

    def reap_idle(self, busy: set[tuple[str, int]]) -> None:
        """Stop workers with no sessions that have been idle longer than idle_seconds, each in a task of its own (a
        worker stuck in its tenant's kernel takes its stop timeout to go: the reaper never waits for that)."""
        now = time.monotonic()
        for key, worker in list(self._workers.items()):
            if key not in busy and now - worker.last_used > self.idle_seconds:
                log.info("reaping idle worker for tenant %s on device %d", *key)
                del self._workers[key]
                _spawn(self._stops, worker.stop(), f"stop-{key[0]}-{key[1]}")

    def retire_tenant(self, tenant: str, fault: GpuBrokerError) -> None:
        """Kill every worker of the tenant (it was removed), now and without awaiting (``retire``), those still
        starting too as their start ends, and forget its crashes: a tenant added again under its name starts with
        none of its state. Never a request to the workers: each runs the removed tenant's code, which may keep it
        from answering for as long as it likes."""
        for key, task in list(self._starting.items()):
            if key[0] == tenant:  # (its worker registers as the start ends: killed right then)
                task.add_done_callback(functools.partial(self._retire_started, fault))
        for key, worker in list(self._workers.items()):
            if key[0] == tenant:
                self.retire(worker, fault)
        self.crashes.forget(tenant)

    def _retire_started(self, fault: GpuBrokerError, task: asyncio.Task[WorkerClient]) -> None:
        if not task.cancelled() and task.exception() is None:
            self.retire(task.result(), fault)

    async def restart(self, worker: WorkerClient, fault: GpuBrokerError | None = None) -> None:
        """Kill a worker for its tenant's sake (a compile past its timeout, device work past the kernel time
        limit, a lie); with ``fault`` its calls fail with that error. The death is its tenant's failure,
        counted once when the worker's end is reported; the tenant's next session gets a fresh worker."""
        key = (worker.tenant, worker.device)
        if self._workers.get(key) is worker:
            del self._workers[key]
        await worker.kill(fault or Unavailable(f"the worker for tenant {worker.tenant!r} on device "
                                               f"{worker.device} was restarted"))

    def retire(self, worker: WorkerClient, fault: GpuBrokerError) -> None:
        """Kill a worker, now and without awaiting, because a credential it served was revoked (a reload runs this:
        WorkerCredentials), or its session's work was abandoned (a cancel, an expired lease). Its calls fail with
        ``fault``; its death is nobody's failure; the tenant's next session gets a fresh worker."""
        key = (worker.tenant, worker.device)
        if self._workers.get(key) is worker:
            del self._workers[key]
        worker.retire(fault)

    async def close(self, timeout: float = 10.0) -> None:
        """Stop every worker: each gets ``timeout`` seconds to exit once its channel closes, then is killed (one
        held in its tenant's kernel never reads the close)."""
        self.draining = True
        for handle in self._settling.values():
            handle.cancel()
        self._settling.clear()
        workers = list(self._workers.values())
        self._workers.clear()
        await asyncio.gather(*(w.stop(timeout) for w in workers), return_exceptions=True)
        # Idle stops and limits: each ends with its worker, bounded as above; requests to workers stopped are moot.
        for task in self._requests:
            task.cancel()
        await asyncio.gather(*self._requests, *self._stops, return_exceptions=True)
