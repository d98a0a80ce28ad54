"""One load-test tenant in a process of its own: connect, set up, then loop until time or count runs out.

It reports to the parent through a multiprocessing queue: ``("ready", tenant)`` once set up, periodic
``("sample", tenant, TenantSample)`` with what happened since the last one, and ``("done", tenant, seconds)`` last.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from gpubroker.client import TlsOptions
from gpubroker.loadtest._workloads import WorkloadSpec, WrongResult, make_workload

__all__ = ["TenantJob", "TenantSample", "run_tenant"]

MAX_CONSECUTIVE_ERRORS = 10  # a session that fails this often in a row is broken: stop, don't spin on it
MAX_MESSAGES = 5  # distinct error messages kept per tenant


@dataclass(frozen=True)
class TenantJob:
    tenant: str
    token: str
    target: str
    device: int
    workload: WorkloadSpec
    duration: float
    max_ops: int
    setup_timeout: float = 120.0
    sample_period: float = 0.2
    tls: TlsOptions | None = None  # for a host:port target over TLS


@dataclass
class TenantSample:
    """What one tenant did since its previous sample."""

    ops: int = 0
    bytes: int = 0
    errors: int = 0
    latencies: list[float] = field(default_factory=list)  # seconds, one per successful operation
    messages: list[str] = field(default_factory=list)


def run_tenant(job: TenantJob, queue: Any, go: Any, stop: Any) -> None:
    """The process target: ``go`` and ``stop`` are multiprocessing Events set by the parent."""
    from gpubroker.client import GpuBrokerError, connect

    sample = TenantSample()
    seen: set[str] = set()
    start: float | None = None
    stopped: float | None = None  # when the loop ended: closing the session is not part of the run

    def error(exc: BaseException) -> None:
        sample.errors += 1
        text = f"{type(exc).__name__}: {exc}"
        if text not in seen and len(seen) < MAX_MESSAGES:
            seen.add(text)
            sample.messages.append(text)

    try:
        workload = make_workload(job.workload)
        with connect(job.target, token=job.token, device=job.device, async_commands=workload.async_commands,
                     tls=job.tls) as gpu:
            workload.setup(gpu)
            queue.put(("ready", job.tenant))
            if not go.wait(job.setup_timeout):
                raise TimeoutError(f"no start signal within {job.setup_timeout} s")
            start = time.monotonic()
            end, next_sample = start + job.duration, start + job.sample_period
            ops = consecutive = 0
            while ops < job.max_ops and not stop.is_set():
                now = time.monotonic()
                if now >= end:
                    break
                if now >= next_sample:
                    queue.put(("sample", job.tenant, sample))
                    sample, next_sample = TenantSample(), now + job.sample_period
                t0 = time.perf_counter()
                try:
                    moved = workload.step(gpu)
                except (GpuBrokerError, WrongResult) as exc:
                    error(exc)
                    consecutive += 1
                    if consecutive >= MAX_CONSECUTIVE_ERRORS:
                        break
                    try:
                        workload.recover(gpu)
                    except GpuBrokerError as again:
                        error(again)
                    continue
                sample.latencies.append(time.perf_counter() - t0)
                sample.ops += 1
                sample.bytes += moved
                ops += 1
                consecutive = 0
            stopped = time.monotonic()
    except Exception as exc:  # setup or connection failures are this tenant's errors, reported like the rest
        error(exc)
    finally:
        queue.put(("sample", job.tenant, sample))
        ran = 0.0 if start is None else (stopped or time.monotonic()) - start
        queue.put(("done", job.tenant, ran))
