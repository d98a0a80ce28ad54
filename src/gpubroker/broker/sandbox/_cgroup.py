"""Per-worker cgroups (v2): memory.max, pids.max and cpu.weight for each worker, where the broker may create them.

The broker needs a delegated cgroup of its own (systemd's ``Delegate=yes``) in which it is the only process:
cgroup v2's "no internal processes" rule forbids enabling controllers for children of a cgroup that holds
processes, so the front first moves itself into a leaf ``<own>/front``, then keeps the workers in
``<own>/gpubroker-workers/<tenant>-<device>-<n>``. Anything short of that, and the workers get rlimits only.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from pathlib import Path

__all__ = ["WorkerCgroups"]

log = logging.getLogger("gpubroker.sandbox")

NEEDED = "memory"  # required; pids and cpu are used where delegated too (else pids falls back to an rlimit)


def _write(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def _own_cgroup() -> Path | None:
    """This process's cgroup directory, wherever cgroup2 is mounted (a container may mount only its own subtree,
    so /proc/self/cgroup's path is taken relative to the mount's root)."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
        own = next(line[3:] for line in lines if line.startswith("0::"))
        mounts = Path("/proc/self/mountinfo").read_text().splitlines()
    except (OSError, StopIteration):
        return None
    for line in mounts:
        fields = line.split()
        sep = fields.index("-")
        if fields[sep + 1] != "cgroup2":
            continue
        root, mountpoint = fields[3], fields[4]
        if own == root or own.startswith(root.rstrip("/") + "/"):
            path = Path(mountpoint) / own[len(root):].lstrip("/")
            if path.is_dir():
                return path
    return None


class WorkerCgroups:
    """The workers' parent cgroup and its limits; ``create`` one per worker, ``release`` it when it exits."""

    def __init__(self, parent: Path, controllers: set[str], memory_max: int, pids_max: int, cpu_weight: int) -> None:
        self.parent = parent
        self.controllers = controllers
        self.memory_max = memory_max
        self.pids_max = pids_max
        self.cpu_weight = cpu_weight
        self._serial = itertools.count(1)

    @classmethod
    def setup(cls, memory_max: int, pids_max: int, cpu_weight: int) -> tuple[WorkerCgroups | None, str]:
        """The workers' cgroups, or None and why not."""
        own = _own_cgroup()
        if own is None:
            return None, "no cgroup v2 hierarchy mounted"
        try:
            available = set((own / "cgroup.controllers").read_text().split())
            if NEEDED not in available:
                return None, f"the memory controller is not delegated to {own}"
            if not os.access(own / "cgroup.subtree_control", os.W_OK):
                return None, f"{own} is not delegated to the broker (no write access)"
            wanted: set[str] = {c for c in ("memory", "pids", "cpu") if c in available}
            enabled = set((own / "cgroup.subtree_control").read_text().split())
            if not wanted <= enabled:
                others = [p for p in (own / "cgroup.procs").read_text().split() if int(p) != os.getpid()]
                if others:
                    return None, (f"{own} holds other processes than the broker ({len(others)}); run it as a "
                                  "service with Delegate=yes")
                leaf = own / "front"
                leaf.mkdir(exist_ok=True)
                _write(leaf / "cgroup.procs", "0\n")  # the front leaves for a leaf of its own
                _write(own / "cgroup.subtree_control", " ".join(f"+{c}" for c in sorted(wanted)))
            parent = own / "gpubroker-workers"
            parent.mkdir(exist_ok=True)
            _write(parent / "cgroup.subtree_control", " ".join(f"+{c}" for c in sorted(wanted)))
        except OSError as exc:
            return None, f"cannot set up worker cgroups under {own}: {exc.strerror or exc}"
        return cls(parent, wanted, memory_max, pids_max, cpu_weight), \
            f"cgroup v2 at {parent} ({', '.join(sorted(wanted))})"

    def create(self, tenant: str, device: int, memory_max: int | None = None) -> Path:
        """A new cgroup for one worker, its limits set (``memory_max``: this worker's memory.max, by default the
        one set up; 0: none); the launcher moves itself in before it unshares."""
        memory_max = self.memory_max if memory_max is None else memory_max
        path = self.parent / f"{tenant}-{device}-{next(self._serial)}"
        path.mkdir()
        try:
            if "pids" in self.controllers:
                _write(path / "pids.max", f"{self.pids_max or 'max'}\n")
            _write(path / "memory.max", f"{memory_max or 'max'}\n")
            if memory_max and (path / "memory.swap.max").exists():
                _write(path / "memory.swap.max", "0\n")  # the limit is on memory, not on memory + swap
            if "cpu" in self.controllers:
                _write(path / "cpu.weight", f"{self.cpu_weight}\n")
        except OSError:
            self.release(path)
            raise
        return path

    def release(self, path: Path, timeout: float = 5.0) -> bool:
        """Kill what is left in the worker's cgroup and remove it (blocking: call it off the event loop).

        Returns whether the kernel's OOM killer killed a process there (the tenant's own failure).
        """
        oom = False
        try:
            events = dict(line.split() for line in (path / "memory.events").read_text().splitlines())
            oom = int(events.get("oom_kill", 0)) > 0
        except (OSError, ValueError):
            pass
        deadline = time.monotonic() + timeout
        while True:
            try:
                path.rmdir()
                return oom
            except FileNotFoundError:
                return oom
            except OSError:  # still populated (a worker killed with its launcher is still dying)
                if time.monotonic() > deadline:
                    log.warning("could not remove the worker cgroup %s", path)
                    return oom
                try:
                    _write(path / "cgroup.kill", "1\n")
                except OSError:
                    pass
                time.sleep(0.01)  # (polling the kernel with a deadline; nothing to wait on)
