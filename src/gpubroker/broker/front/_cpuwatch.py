"""CPU a worker uses outside its tenant's device turns: charged to that tenant, and bounded.

A kernel can leave threads (or, where the sandbox lets it fork, processes) running after it returns: the time limit
never sees them, since they hold no device turn, yet they take the host's CPUs from every other tenant (on a CPU
device, the device itself). Every ``period`` seconds the watch reads each worker's process tree (workers/_cpu.py)
and takes what it used beyond what its turns and requests account for:

- while its tenant holds the device (``DeviceScheduler.held_seconds``; all the time with fair scheduling off,
  which has no turns), up to ``hold_cpus`` CPUs: the device's
  compute units on a CPU device (the device is the host's CPUs, all the holder's), one on a GPU (the thread that
  feeds it);
- while it serves a request of the front's that works on the host (a compile runs outside the turns), what its
  serving thread used (``CpuReading.serving``: the thread that runs the compile, found by the front on its own),
  at most one CPU. Never the other threads': a compile can be kept waiting (on a pipe it ``#include``s, say)
  while a thread a kernel left behind burns, and that thread's CPU is outside the turns all the same;
- ``_IDLE_CPU`` always: an idle worker's own upkeep.

On a CPU device (``charge_host_work``) the host work is allowed but charged all the same: a compile there takes
the device's own CPUs from every other tenant's kernels (PoCL's clang), so its CPU goes to its tenant's fair-queuing
clock and usage like the rest, only never towards ``limit`` (a compile is bounded by ``compile_timeout_seconds``).

The rest is charged to the tenant's fair-queuing clock (in device seconds: over the compute units on a CPU device,
over the host's CPUs otherwise), and once the rest summed over ``window`` seconds passes ``limit`` CPU-seconds the
worker is killed, its calls fail with RESOURCE_EXHAUSTED saying why, and its death is its tenant's failure (its
crash budget). Killing the worker ends everything a kernel left behind: its threads die with it, and processes
forked in its PID namespace die with the namespace's init.

The same scan counts each worker's threads where the kernel does not hold the workers to ``worker_pids_max`` (a
root broker with ``worker_uids = "0"`` and no pids cgroup, or no sandbox): a worker seen with more is killed the same
way. Only a backstop: between two scans a kernel can make thousands.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from gpubroker.broker.front._status import cancel_and_wait, log_failure
from gpubroker.broker.front.scheduler import DeviceScheduler
from gpubroker.broker.front.workers import CpuReading, WorkerClient, WorkerPool, scan_children
from gpubroker.wire.errors import GpuBrokerError, ResourceExhausted

__all__ = ["CpuWatch"]

log = logging.getLogger("gpubroker.scheduler")

_IDLE_CPU = 0.05  # CPUs an idle worker may use for its own upkeep (its event loop, its links, the launcher's relay)


@dataclass
class _Seen:
    reading: CpuReading
    held: float
    busy: float
    outside: deque[tuple[float, float]] = field(default_factory=deque)  # (when, CPU-seconds outside turns)


class CpuWatch:
    def __init__(self, pool: WorkerPool, schedulers: dict[int, DeviceScheduler], hold_cpus: dict[int, float],
                 charge_cpus: dict[int, float], limit: float, window: float,
                 kill: Callable[[WorkerClient, GpuBrokerError], None], period: float = 0.5,
                 threads_max: int = 0, charge_host_work: frozenset[int] = frozenset()) -> None:
        self.pool = pool
        self.schedulers = schedulers
        self.hold_cpus = hold_cpus  # by device: CPUs a worker may use while its tenant holds the device
        self.charge_cpus = charge_cpus  # by device: CPU-seconds that make a device second on the fair clock
        # Devices whose workers' host work (a compile's CPU: the serving thread's) is charged, not only allowed:
        # CPU devices, whose compute units are the CPUs a compile takes.
        self.charge_host_work = charge_host_work
        self.limit = limit
        # Threads a worker's tree may have beyond its launcher's one; 0: not watched (the kernel holds the workers
        # to worker_pids_max: a pids cgroup, or RLIMIT_NPROC on a worker that is not the host's root). A backstop:
        # seen only once a period, so a kernel may make many more in between.
        self.threads_max = threads_max
        self.window = window
        self.period = period
        self._kill = kill
        self._seen: dict[WorkerClient, _Seen] = {}
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="cpu-watch")

    async def stop(self) -> None:
        await cancel_and_wait(self._task)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.period)
            try:
                await self.tick()
            except Exception as exc:  # (a /proc oddity must not end the watch: the next tick tries again)
                log_failure(log, "the CPU watch failed; trying again", exc)

    async def tick(self) -> None:
        workers = [w for w in self.pool.workers() if w.alive and w.cpu is not None]
        readings = await asyncio.to_thread(_read_all, workers)  # (a scan of /proc: off the event loop)
        self._seen = {w: s for w, s in self._seen.items() if w in readings}
        for worker, reading in readings.items():
            if worker.alive and not self._too_many_threads(worker, reading):
                self._account(worker, reading)

    def _too_many_threads(self, worker: WorkerClient, reading: CpuReading) -> bool:
        threads = len(reading.threads)
        if not self.threads_max or threads <= self.threads_max + 1:  # (+1: the sandbox's launcher)
            return False
        message = (f"the worker for tenant {worker.tenant!r} on device {worker.device} had {threads - 1} threads, "
                   f"past worker_pids_max = {self.threads_max}; the worker was restarted")
        log.warning("tenant %s: %s", worker.tenant, message)
        self._seen.pop(worker, None)
        self._kill(worker, ResourceExhausted(message))
        return True

    def _account(self, worker: WorkerClient, reading: CpuReading) -> None:
        scheduler = self.schedulers.get(worker.device)
        # With fair scheduling off there are no turns: the worker is taken to hold the device all the time.
        held = (scheduler.held_seconds(worker.tenant) if scheduler is not None and scheduler.enabled
                else reading.at)
        busy = worker.busy_seconds()
        seen = self._seen.get(worker)
        self._seen[worker] = now = _Seen(reading, held, busy, seen.outside if seen is not None else deque())
        if seen is None:
            return
        wall = reading.at - seen.reading.at
        # Host work: the serving thread's CPU only, and no more than the wall time such work was in flight.
        host = min(busy - seen.busy, max(0.0, reading.serving - seen.reading.serving))
        # Beyond what its turns (charged at their fences, on a CPU device at least the worker's CPU) and its upkeep
        # account for: its host work, then anything else.
        beyond = (reading.cpu - seen.reading.cpu - self.hold_cpus.get(worker.device, 1.0) * (held - seen.held)
                  - _IDLE_CPU * wall)
        outside = beyond - host
        # On a CPU device a compile's CPU is the device's too, taken from every other tenant's kernels: charged.
        charged = beyond if worker.device in self.charge_host_work else outside
        if scheduler is not None and charged > 0:
            scheduler.charge_outside(worker.tenant, charged / self.charge_cpus.get(worker.device, 1.0))
        if outside <= 0 or self.limit <= 0:
            return
        now.outside.append((reading.at, outside))
        while now.outside and now.outside[0][0] < reading.at - self.window:
            now.outside.popleft()
        used = sum(cpu for _, cpu in now.outside)
        if used > self.limit:
            message = (f"the worker for tenant {worker.tenant!r} on device {worker.device} used {used:.1f} "
                       f"CPU-seconds outside its device turns within {self.window:g} s, past "
                       f"max_cpu_seconds_outside_turns = {self.limit:g}: threads or processes its kernels left "
                       "running; the worker was restarted")
            log.warning("tenant %s: %s", worker.tenant, message)
            del self._seen[worker]
            self._kill(worker, ResourceExhausted(message))


def _read_all(workers: list[WorkerClient]) -> dict[WorkerClient, CpuReading]:
    children = scan_children()
    readings = {}
    for worker in workers:
        cpu = worker.cpu
        assert cpu is not None
        cpu.refresh(children)
        readings[worker] = cpu.read(time.monotonic())
    return readings
