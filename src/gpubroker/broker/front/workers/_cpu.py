"""What a worker consumed of the host's CPUs, read from /proc: the measure behind its tenant's time limit and charges.

A worker is a process tree: the sandbox launcher, the worker under it (PID 1 of its own PID namespace, so its pid
here is found as the launcher's child), and whatever a kernel made it start (threads, or processes where the
sandbox still lets it fork). All of it is the tenant's. ``WorkerCpu`` knows the tree's pids (refreshed from a scan
of /proc: this kernel has no /proc/<pid>/task/<tid>/children) and reads, for the whole tree:

- its CPU time: ``utime + stime + cutime + cstime`` of each process (every thread, dead ones and reaped children
  included), in clock ticks;
- for each live thread, its time on a CPU and its time waiting for one (``/proc/<pid>/task/<tid>/schedstat``);
- the host's busy CPU time (``/proc/stat``: everything but idle and iowait, steal included);
- the CPU time of the worker's serving thread alone (``serving``): the worker serves the front's requests on its
  main thread, which runs a compile in-process (PoCL's clang, NVRTC), so only that thread's CPU is a compile's. The
  front finds it itself, never asking the worker: the main thread is the thread-group leader (tid == pid as seen on
  the host), and a sandboxed worker is the launcher's child that is PID 1 of its own PID namespace (``NSpid``), a
  place no process the tenant makes can take.

``hold_seconds`` turns two readings into the device seconds a hold consumed on a CPU device (PoCL), where the
device *is* the host's CPUs. The rule: the hold's wall time, less the time other processes kept the worker off the
CPUs, never less than the wall time over ``slowdown`` (the broker's ``max_kernel_slowdown``, 2 by default), and never
less than the worker's own CPU-seconds divided by the device's compute units::

    device = max(cpu / units, wall / slowdown, wall - min(others / ncpu, delay / units))

``others`` is the CPU time the host spent on anything but this worker during the hold (other tenants' kernels and
the threads they left behind, the front, the host's own processes, a hypervisor's steal), spread over the host's
``ncpu`` CPUs: the share of the device they took. ``delay`` is the time the worker's threads spent waiting for a
CPU, summed over its threads (``schedstat``), spread over the device's ``units``: each thread's wait discounts only
the compute unit it wanted, so a kernel whose every work-item is slowed loses its slowdown, while a thread that
sleeps or blocks (it holds its compute unit and never waits for a CPU) is charged its whole wall time. Its wait is
never lent to another: a worker's threads that wake rarely and then wait (its event loop, its links), or a
work-item that spins beside one that sleeps, discount only their own share, not the sleeper's. A worker that was
not slowed (a one-thread kernel on a host with CPUs to spare) loses nothing, whatever else runs. So a hold costs
its tenant what its kernels used and the compute units it left idle (a kernel that sleeps holds the device as
surely as one that spins), but not what others took from it.

The two floors bound what the measure cannot tell apart. ``cpu / units`` makes a worker's own extra threads its
own: they cannot make its hold look cheaper by crowding its kernel off the CPUs. ``wall / slowdown``: a kernel
whose threads spin until a deadline on a saturated host (one sleeps, the others spin and wait) looks, thread by
thread, exactly like an honest one that others slow (only ending on time tells them apart), so however busy the
host, the host's load stretches the kernel time limit and the fair-share charge at most ``slowdown`` times. The
front sums ``hold_seconds`` of consecutive readings, so that every stretch of a hold (the part since others began
waiting included) is held to that floor.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

__all__ = ["CpuReading", "WorkerCpu", "cpu_count", "hold_seconds", "parent_pid", "scan_children"]

_TICK = float(os.sysconf("SC_CLK_TCK"))
# /proc/stat's cpu line: user nice system idle iowait irq softirq steal (guest time is inside user and nice).
_IDLE_FIELDS = (3, 4)
_FIELDS = 8


def _host_busy() -> float:
    with open("/proc/stat", "rb") as f:
        first = f.readline().split()
    values = [int(v) for v in first[1:1 + _FIELDS]]
    return (sum(values) - sum(values[i] for i in _IDLE_FIELDS)) / _TICK


def cpu_count() -> int:
    """The host's CPUs as /proc/stat counts them (the denominator of the busy time it reports)."""
    with open("/proc/stat", "rb") as f:
        return max(1, sum(1 for line in f if line.startswith(b"cpu") and line[3:4].isdigit()))


def _stat_fields(pid: int) -> list[bytes] | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    return data.rsplit(b")", 1)[1].split()  # (the command name may hold spaces and parentheses)


def parent_pid(pid: int) -> int | None:
    """The process's parent pid (0 for a namespace's first process); None if it is gone."""
    fields = _stat_fields(pid)
    return int(fields[1]) if fields is not None else None


def _innermost_pid(pid: int) -> int | None:
    """The process's pid in its own PID namespace (the last of /proc/<pid>/status's ``NSpid``); None if gone."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"NSpid:"):
                    return int(line.split()[-1])
    except (OSError, ValueError):
        pass
    return None


def scan_children() -> dict[int, list[int]]:
    """Every process's children, by parent pid: one pass over /proc."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        fields = _stat_fields(int(name))
        if fields is not None:
            children.setdefault(int(fields[1]), []).append(int(name))
    return children


@dataclass(frozen=True)
class CpuReading:
    """One look at a worker's process tree and the host."""

    at: float  # time.monotonic()
    cpu: float  # CPU-seconds of the tree (every thread, reaped children too)
    threads: dict[int, tuple[float, float]] = field(default_factory=dict)  # tid: (on a CPU, waiting for one), s
    host_busy: float = 0.0  # CPU-seconds the host spent busy, all CPUs
    serving: float = 0.0  # CPU-seconds of the worker's serving thread (0 until the worker is found)


class WorkerCpu:
    """A worker's process tree, rooted at the process the front started (the sandbox launcher, or the worker)."""

    def __init__(self, root: int, launcher: bool = False) -> None:
        self.root = root
        self.pids: list[int] = [root]
        # The worker's pid on the host, its main (serving) thread's tid: the root itself, or with ``launcher`` (the
        # root is the sandbox's launcher) the launcher's child that is PID 1 of its PID namespace, found by
        # ``refresh``. The launcher's only other child, the helper that maps a worker's uid, is gone before the
        # worker is forked and is no PID 1; the worker's own children are never the launcher's (CLONE_PARENT is
        # refused to a namespace's init and its threads).
        self.worker: int | None = None if launcher else root
        # The most CPU a process of the tree was seen with: a process that exits and is reaped moves its time to
        # its parent's cutime, but one the namespace's reaper has not waited for yet would count twice or not at
        # all between two readings. The tree's time never goes backwards.
        self._last_cpu = 0.0

    def refresh(self, children: dict[int, list[int]]) -> None:
        """Find the tree's processes again from a scan of /proc (``scan_children``)."""
        pids, stack = [], [self.root]
        while stack:
            pid = stack.pop()
            pids.append(pid)
            stack.extend(children.get(pid, ()))
        self.pids = pids
        if self.worker is None:
            self.worker = next((pid for pid in children.get(self.root, ()) if _innermost_pid(pid) == 1), None)

    def read(self, at: float) -> CpuReading:
        cpu = 0.0
        threads: dict[int, tuple[float, float]] = {}
        for pid in self.pids:
            fields = _stat_fields(pid)
            if fields is None:
                continue
            # (fields from the state on: utime stime cutime cstime are the 12th to 15th)
            cpu += sum(int(v) for v in fields[11:15]) / _TICK
            try:
                tids = os.listdir(f"/proc/{pid}/task")
            except OSError:
                continue
            for tid in tids:
                try:
                    with open(f"/proc/{pid}/task/{tid}/schedstat", "rb") as f:
                        run, delay, _ = f.read().split()
                except (OSError, ValueError):
                    continue
                threads[int(tid)] = (int(run) / 1e9, int(delay) / 1e9)
        self._last_cpu = cpu = max(cpu, self._last_cpu)
        serving = threads.get(self.worker, (0.0, 0.0))[0] if self.worker is not None else 0.0
        return CpuReading(at, cpu, threads, _host_busy(), serving)


def hold_seconds(start: CpuReading, end: CpuReading, units: int, ncpu: int, slowdown: float) -> float:
    """The device seconds a worker consumed between two readings on a CPU device (the rule in the module's text)."""
    wall = max(0.0, end.at - start.at)
    cpu = max(0.0, end.cpu - start.cpu)
    others = max(0.0, end.host_busy - start.host_busy - cpu) / max(1, ncpu)
    delay = 0.0
    for tid, (_, d1) in end.threads.items():  # threads born in between count from zero
        delay += max(0.0, d1 - start.threads.get(tid, (0.0, 0.0))[1])
    slowed = delay / max(1, units)  # each waiting thread, its own compute unit's share
    return max(cpu / max(1, units), wall / max(1.0, slowdown), wall - min(others, slowed))
