"""Large host copies split among threads, for the staging path of same-host copies.

One core's memcpy moves 7-15 GB/s; a device's DMA moves 50+ GB/s, and CUDA's own pageable copies stage through
pinned memory at 9-18 GB/s. A copy through the staging segment is one memcpy on the client plus a DMA the worker
overlaps with it, so the memcpy sets the pace: it is split into parts that pool threads copy at the same time
(numpy's copyto releases the GIL for a large contiguous copy), which host memory bandwidth allows several of.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

__all__ = ["COPY_THREADS", "parallel_copy"]


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # (not Linux)
        return os.cpu_count() or 1


# Four parts reach most of a socket's memory bandwidth; more would take cores from the caller's own threads.
COPY_THREADS = max(1, min(4, _cores()))
# Below this a part costs more in hand-off (a thread wake-up, tens of microseconds) than copying it in parallel saves.
_MIN_PART = 2 << 20
_PAGE = 4096

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _executor() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(COPY_THREADS - 1, thread_name_prefix="gpubroker-copy")
        return _pool


def _forget_pool() -> None:
    # A forked child has none of the parent's threads: its first copy starts a pool of its own.
    global _pool, _pool_lock
    _pool, _pool_lock = None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool)


def parallel_copy(dst: np.ndarray, src: np.ndarray, threads: int = COPY_THREADS) -> None:
    """``dst[:] = src`` for two 1-D uint8 arrays of one size, in up to ``threads`` page-aligned parts at once."""
    n = dst.nbytes
    parts = min(threads, n // _MIN_PART)
    if parts <= 1:
        np.copyto(dst, src)
        return
    step = ((n + parts - 1) // parts + _PAGE - 1) // _PAGE * _PAGE  # n / parts, rounded up to whole pages
    futures: list[Future[None]] = []
    try:
        pool = _executor()
        for a in range(step, n, step):
            futures.append(pool.submit(np.copyto, dst[a:a + step], src[a:a + step]))
    except RuntimeError:  # (the interpreter is shutting down: no new threads) this thread copies the rest
        np.copyto(dst[step * (len(futures) + 1):], src[step * (len(futures) + 1):])
    try:
        np.copyto(dst[:step], src[:step])  # this thread copies the first part meanwhile
    finally:
        for future in futures:
            future.result()
