"""The device memory each CUDA worker holds, read by the front from NVML: the bound no code in a worker can move.

A tenant's quota (``memory``, ``device_memory``) is counted inside its own worker (worker/_handles.py
``Tables.reserve``), which runs the tenant's native code: a kernel that overwrites the worker's count, a module's
``__device__`` arrays (allocated as the module loads, seen by no quota), or any native library the worker calls can
take device memory the count never sees. On CUDA the driver knows what each process holds, and NVML reports it by
host pid (``nvmlDeviceGetComputeRunningProcesses``). ``MemoryWatch`` reads it every ``period`` seconds in a thread
of its own (never on the event loop: NVML calls block), adds up each worker's processes (a process belongs to the
worker whose launcher it descends from: found from ``/proc`` by parent pids), and kills a
worker that holds on a device more than

- on its own device: the highest quota the front gave it (``WorkerClient.memory_quota_max``; a reload's lower
  quota applies to new allocations) plus ``device_memory_headroom``, what no quota counts (the CUDA context,
  modules' code, libraries' workspaces, allocators' rounding);
- on any other device (peer copies map memory there, they allocate none): the headroom alone.

The kill is its tenant's failure (its crash budget), its calls fail with RESOURCE_EXHAUSTED saying what happened and
what to do, it is counted in ``gpubroker_device_memory_kills{cause="nvml"}`` and audited (rate-limited per tenant).
Between two readings a worker may briefly hold more, up to what the device has: the watch bounds how long, not how
much. Without pynvml or a working NVML, or on OpenCL (where buffers are host memory, held by the worker's memory
limit), ``describe_bound`` says at start what bounds device memory instead.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import Callable, Container, Iterable
from typing import Any

from gpubroker.broker.config import BrokerConfig
from gpubroker.broker.front._health import nvml_handle
from gpubroker.broker.front.auth import RateLimitedLog
from gpubroker.broker.front.workers import WorkerClient, WorkerPool, parent_pid
from gpubroker.wire.errors import GpuBrokerError, ResourceExhausted

__all__ = ["MemoryWatch", "attribute", "describe_bound", "lineage", "over_bound"]

log = logging.getLogger("gpubroker.memory")
audit = logging.getLogger("gpubroker.audit")

PERIOD = 0.1  # seconds between two readings of NVML
_MAX_DEPTH = 32  # parents walked up from a process NVML names before giving up on it (a worker's tree is shallow)
_UNSEEN_WARNING_SECONDS = 10.0  # a live worker NVML never named this long after the watch first saw it: warn once

# {worker pid: {broker device index: bytes}}: what each worker's process tree holds on each device.
Reading = dict[int, dict[int, int]]
# {pid: (pid, its parent, ...)}: up to the front's child, the front left out.
Lineage = dict[int, tuple[int, ...]]


def describe_bound(config: BrokerConfig, backend: str, watch: MemoryWatch | None) -> None:
    """Say once, at start, what bounds a tenant's device memory on this broker."""
    if backend != "cuda":
        log.info("device memory: on %s the device's buffers are host memory, so each worker's memory limit "
                 "(worker_memory_max, by default its tenant's quota plus the runtime's own; kernel-enforced: a "
                 "cgroup or rlimits) bounds them; the memory quota is the worker's own accounting within it", backend)
    elif watch is not None:
        log.info("device memory: NVML is read every %g s and a worker holding more than its tenant's quota plus "
                 "device_memory_headroom (%d bytes) is killed", PERIOD, config.device_memory_headroom)
    else:
        if not config.nvml_memory_watch:
            fix = "set nvml_memory_watch = true"
        elif not _importable():
            fix = "install nvidia-ml-py (pip install 'gpubroker[cuda]')"
        else:
            fix = "make NVML work for the broker (its error is above)"
        log.warning("device memory: only each worker's own accounting holds its tenant to the quota, which native "
                    "code in the worker can evade, so one tenant could take the whole device; %s, so that the front "
                    "bounds every worker's device memory from outside (NVML)", fix)


def _importable() -> bool:
    try:
        import pynvml  # noqa: F401  (optional: nvidia-ml-py)
    except ImportError:
        return False
    return True


def lineage(pids: Iterable[int], front: int, parent: Callable[[int], int | None] = parent_pid) -> Lineage:
    """Each of ``pids`` with its ancestors up to the front's child (the front left out), read from ``/proc``;
    processes that are not the front's descendants (or are gone) are left out."""
    lines: Lineage = {}
    for pid in pids:
        line = [pid]
        for _ in range(_MAX_DEPTH):
            up = parent(line[-1])
            if up is None or up <= 1:
                break  # gone, or not ours: init's, or another namespace's first process
            if up == front:
                lines[pid] = tuple(line)
                break
            line.append(up)
    return lines


def attribute(processes: dict[int, dict[int, int]], lines: Lineage, roots: Container[int]) -> Reading:
    """Sum ``processes`` ({pid: {device: bytes}}, NVML's figures) by the nearest of ``roots`` (the workers' pids:
    each one's launcher, or an unsandboxed worker) each is or descends from (``lines``: ``lineage``'s). A launcher
    is the front's child, or the workers' zygote's; processes that are no worker's are left out."""
    reading: Reading = {}
    for pid, devices in processes.items():
        root = next((p for p in lines.get(pid, ()) if p in roots), None)
        if root is None:
            continue
        held = reading.setdefault(root, {})
        for device, used in devices.items():
            held[device] = held.get(device, 0) + used
    return reading


def over_bound(worker: WorkerClient, held: dict[int, int], headroom: int) -> tuple[int, int, int] | None:
    """The first (device, bytes held, bytes allowed) on which the worker holds more than it may; None if none."""
    quota = worker.memory_quota_max
    if quota is None:
        return None  # no quota sent yet: it has run nothing of its tenant's
    for device, used in sorted(held.items()):
        allowed = headroom + (quota if device == worker.device else 0)
        if used > allowed:
            return device, used, allowed
    return None


class MemoryWatch:
    """Reads NVML in a thread of its own and judges the readings on the event loop (``open`` makes one)."""

    def __init__(self, nvml: Any, handles: dict[int, Any], pool: WorkerPool, headroom: int,
                 kill: Callable[[WorkerClient, GpuBrokerError], None], period: float = PERIOD) -> None:
        self._nvml = nvml
        self._handles = handles  # broker device index -> NVML handle
        self.pool = pool
        self.headroom = headroom
        self._kill = kill
        self.period = period
        self._front = os.getpid()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = threading.Event()
        self._judging = threading.Event()  # a reading waits for the loop: the thread skips its next ones meanwhile
        self._thread = threading.Thread(target=self._run, name="gpubroker-nvml-memory", daemon=True)
        self._audit = RateLimitedLog(audit)
        self._quiet: set[tuple[int, str]] = set()  # (device, what) already logged as unreadable
        self._first_seen: dict[int, float] = {}  # worker pid -> when the watch first judged it alive
        self._ever_matched = False
        self._warned_unseen = False

    @classmethod
    def open(cls, config: BrokerConfig, backend: str, ordinals: list[int], pool: WorkerPool,
             kill: Callable[[WorkerClient, GpuBrokerError], None]) -> MemoryWatch | None:
        """A watch over the broker's devices (``ordinals``: CUDA's index of each), not yet started; None where it
        cannot run (not CUDA, turned off, no pynvml, NVML failing): ``describe_bound`` says so."""
        if backend != "cuda" or not config.nvml_memory_watch or not ordinals:
            return None
        try:
            import pynvml as nvml  # optional (nvidia-ml-py)
        except ImportError:
            return None
        try:
            nvml.nvmlInit()
        except Exception as exc:  # NVMLError: no driver, no library
            log.warning("device memory is not watched: NVML: %s", exc)
            return None
        try:
            handles = {device: nvml_handle(nvml, ordinal) for device, ordinal in enumerate(ordinals)}
        except Exception as exc:  # a CUDA_VISIBLE_DEVICES NVML cannot map
            log.warning("device memory is not watched: NVML: %s", exc)
            _shutdown(nvml)
            return None
        return cls(nvml, handles, pool, config.device_memory_headroom, kill)

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread.start()

    async def stop(self) -> None:
        self._stopping.set()
        if self._thread.is_alive():
            await asyncio.to_thread(self._thread.join, 5.0)
        _shutdown(self._nvml)

    # -- the thread ----------------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stopping.wait(self.period):
            if self._judging.is_set():
                continue  # the loop has not judged the last reading yet: it is busy, add nothing to its queue
            try:
                processes = self.read()
                lines = lineage(processes, self._front)  # (/proc is read here, not on the loop)
            except Exception as exc:  # (never end the watch: the next period tries again)
                log.warning("reading NVML's device memory failed: %s", exc)
                continue
            loop = self._loop
            if loop is None:
                continue
            self._judging.set()
            try:
                loop.call_soon_threadsafe(self._judge, processes, lines)
            except RuntimeError:  # the loop is closed: the broker is stopping
                return

    def read(self) -> dict[int, dict[int, int]]:
        """NVML's figures: {host pid: {broker device index: bytes}} for every process with a CUDA context."""
        nvml = self._nvml
        processes: dict[int, dict[int, int]] = {}
        for device, handle in self._handles.items():
            try:
                running = nvml.nvmlDeviceGetComputeRunningProcesses(handle)
            except Exception as exc:  # NVMLError (MIG without permission, a GPU that fell off the bus)
                self._once(device, "error", f"NVML cannot list the processes on device {device} ({exc}): its device "
                           "memory is not watched while this lasts")
                continue
            for process in running:
                used = process.usedGpuMemory
                if used is None:  # NVML_VALUE_NOT_AVAILABLE
                    self._once(device, "unavailable", f"NVML reports no per-process memory on device {device}: its "
                               "device memory is not watched")
                    continue
                held = processes.setdefault(int(process.pid), {})
                held[device] = held.get(device, 0) + int(used)
        return processes

    def _once(self, device: int, what: str, message: str) -> None:
        if (device, what) not in self._quiet:
            self._quiet.add((device, what))
            log.warning("%s", message)

    # -- the event loop ------------------------------------------------------------------------------
    def _judge(self, processes: dict[int, dict[int, int]], lines: Lineage) -> None:
        self._judging.clear()
        now = time.monotonic()
        live: dict[int, WorkerClient] = {}
        for worker in self.pool.workers():
            if worker.alive and worker.pid is not None:
                live[worker.pid] = worker
        reading = attribute(processes, lines, live)
        for pid, worker in live.items():
            self._first_seen.setdefault(pid, now)
            held = reading.get(pid)
            if held is None:
                continue
            self._ever_matched = True
            over = over_bound(worker, held, self.headroom)
            if over is not None:
                self._kill_worker(worker, *over)
        self._first_seen = {pid: t for pid, t in self._first_seen.items() if pid in live}
        if not self._ever_matched and not self._warned_unseen and any(
                now - t > _UNSEEN_WARNING_SECONDS for t in self._first_seen.values()):
            self._warned_unseen = True
            log.warning("NVML has named none of the workers' processes in %g s: device memory is not bounded by the "
                        "watch (is the broker in a PID namespace other than the one NVML reports pids in?)",
                        _UNSEEN_WARNING_SECONDS)

    def _kill_worker(self, worker: WorkerClient, device: int, used: int, allowed: int) -> None:
        quota = worker.memory_quota_max or 0
        where = (f"its quota there ({quota} bytes) plus device_memory_headroom ({self.headroom} bytes)"
                 if device == worker.device else
                 f"device_memory_headroom ({self.headroom} bytes), all a worker may hold on a device it does not serve")
        fault = ResourceExhausted(
            f"the worker for tenant {worker.tenant!r} on device {worker.device} held {used} bytes of device "
            f"{device}'s memory (NVML's count for its processes), past {where}, and was killed: the quota does not "
            "see such memory (a module's global arrays, a library's workspace or temporaries, memory native code "
            "allocated); keep within the quota, or ask the operator for a larger quota or device_memory_headroom",
            quota=quota, used=used, allowed=allowed, device=device)
        if not worker.kill_for_memory("nvml", fault):
            return  # already being killed for another cause, which stands
        self._audit.warning(f"memory {worker.tenant}", "action=kill-worker reason=device-memory tenant=%s "
                            "device=%d on_device=%d used=%d allowed=%d pid=%d", worker.tenant, worker.device,
                            device, used, allowed, worker.pid)
        # Unregistered now, so the tenant's next session gets a fresh worker; the death is charged as it is reported.
        self._kill(worker, fault)


def _shutdown(nvml: Any) -> None:
    try:
        nvml.nvmlShutdown()
    except Exception:
        pass
