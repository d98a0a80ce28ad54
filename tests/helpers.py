"""Small helpers shared by the test modules."""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from gpubroker.broker.launcher import descendants, parent_pids
from gpubroker.wire.frames import FRAME_HEADER

__all__ = ["busy_synchronizing", "descendants", "other_tenants_launches_take", "parent_pids", "proc_status",
           "recv_payload", "send_payload", "spin_iterations", "wait_for"]


def wait_for(condition: Callable[[], bool], timeout: float, what: str) -> None:
    """Poll a condition the broker reaches asynchronously (a lease expiring, a reload), failing after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.05)


@contextmanager
def busy_synchronizing(gpu: Any) -> Iterator[list[int]]:
    """``gpu.synchronize()`` over and over in a thread (a client whose next batch always follows its answer) while
    the block runs, once at least 100 have been answered; yields the count so far (``[n]``). Whatever the calls
    raised is raised at the end."""
    stop, counts, errors = threading.Event(), [0], list[BaseException]()

    def hammer() -> None:
        try:
            while not stop.is_set():
                gpu.synchronize()
                counts[0] += 1
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=hammer)
    thread.start()
    try:
        wait_for(lambda: counts[0] > 100 or bool(errors), 30, "the busy client's calls")
        yield counts
    finally:
        stop.set()
        thread.join(30)
    if errors:
        raise errors[0]


def other_tenants_launches_take(gpu: Any, count: int = 20) -> float:
    """Seconds ``count`` launches + synchronizes of an empty kernel take (another tenant's, beside a busy one)."""
    from gpubroker.broker import samples

    kernel = gpu.compile_kernel(samples.source(gpu.device_info().backend), "empty_kernel")
    t0 = time.monotonic()
    for _ in range(count):
        gpu.execute_kernel(kernel, 1, 1, [])
        gpu.synchronize()
    return time.monotonic() - t0


def spin_iterations(gpu: Any, kernel: Any, buf: Any, seconds: float) -> int:
    """Iterations of one launch of the sample ``spin`` kernel that take about ``seconds`` on this device: measured
    on a launch past 50 ms, then scaled (its first launch, which builds it for the device, is not measured)."""
    gpu.execute_kernel(kernel, 1, 1, [buf, np.int64(1)])
    gpu.synchronize()
    iters = 1 << 20
    while True:
        start = time.monotonic()
        gpu.execute_kernel(kernel, 1, 1, [buf, np.int64(iters)])
        gpu.synchronize()
        took = time.monotonic() - start
        if took > 0.05:
            return max(iters, int(iters * seconds / took))
        iters *= 8


def mem_available() -> int:
    """The host's MemAvailable, in bytes (0 where /proc/meminfo does not say)."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def proc_status(pid: int) -> dict[str, str]:
    """/proc/PID/status as a map (Seccomp, NoNewPrivs, CapEff, Uid, ...)."""
    return _status(f"/proc/{pid}")


def seccomp_filters(pid: int) -> set[int]:
    """How many seccomp filters each thread of ``pid`` runs under (/proc/PID/task/TID/status), as a set."""
    return {int(_status(f"/proc/{pid}/task/{tid}")["Seccomp_filters"]) for tid in os.listdir(f"/proc/{pid}/task")}


def _status(path: str) -> dict[str, str]:
    lines = Path(f"{path}/status").read_text().splitlines()
    return {k: v.strip() for k, _, v in (line.partition(":") for line in lines)}


def send_payload(sock: socket.socket, payload: bytes) -> None:
    """One raw frame (length, then the payload as it is: an encoded Batch, say) on a blocking socket."""
    sock.sendall(FRAME_HEADER.pack(len(payload)) + payload)


def recv_payload(sock: socket.socket) -> bytes:
    """One raw frame's payload; EOFError when the peer closes first."""

    def exactly(n: int) -> bytes:
        data = b""
        while len(data) < n:
            part = sock.recv(n - len(data))
            if not part:
                raise EOFError("the peer closed the link")
            data += part
        return data

    (length,) = FRAME_HEADER.unpack(exactly(FRAME_HEADER.size))
    return exactly(length)


def contiguous_meta(shape: Sequence[int], dtype: str = "float32") -> tuple[str, tuple[int, ...], tuple[int, ...], int]:
    """A torch command's metadata (wire/torch.py TensorMeta) for a contiguous tensor of ``shape``."""
    strides, n = [], 1
    for size in reversed(shape):
        strides.insert(0, n)
        n *= size
    return (dtype, tuple(shape), tuple(strides), 0)
