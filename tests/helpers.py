"""Small helpers shared by the test modules."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from gpubroker.broker.launcher import descendants, parent_pids

__all__ = ["descendants", "parent_pids", "proc_status", "wait_for"]


def wait_for(condition: Callable[[], bool], timeout: float, what: str) -> None:
    """Poll a condition the broker reaches asynchronously (a lease expiring, a reload), failing after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.05)


def proc_status(pid: int) -> dict[str, str]:
    """/proc/PID/status as a map (Seccomp, NoNewPrivs, CapEff, Uid, ...)."""
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return {k: v.strip() for k, _, v in (line.partition(":") for line in lines)}
