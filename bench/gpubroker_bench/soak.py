"""`gpubroker bench soak`: tenants cycling whole sessions at once; what the broker holds must come back to baseline.

Each tenant (a process of its own) runs cycles of open session -> allocate -> copy in -> compile -> launch ->
synchronize -> copy out (checked) -> close, over every transport in turn (gRPC streams, shared memory, direct links
or the front's fast path, asynchronous command batches). After a warm-up, a baseline is taken of the broker's and
its workers' RSS, open file descriptors and threads, the shared segments mapped, the device memory charged and the
sessions open; after the cycles the same figures are taken again once the broker has settled.
Run: ``gpubroker bench soak [--cycles 1000] [--tenants 4] [--backend auto|cuda|opencl] [--out soak.json]``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import queue
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from gpubroker.broker import samples
from gpubroker.broker.launcher import BrokerProcess, TenantSpec, descendants
from gpubroker.client import AdminClient, connect

__all__ = ["SOAK_SETTINGS", "main", "run_soak", "snapshot"]

# Workers live through the whole run (an idle one reaped and restarted would reset its figures).
SOAK_SETTINGS: dict[str, object] = {"worker_idle_seconds": 3600.0, "lease_seconds": 30.0}
_N = 1 << 16  # floats per cycle's buffer


def _cycle(target: str, token: str, backend: str, i: int, x: np.ndarray) -> None:
    """One session's life, over the transport this cycle's number picks."""
    options: dict[str, Any] = {"shared_memory": i % 2 == 0, "async_commands": i % 3 == 0,
                               "transport": "grpc" if i % 5 == 2 else "auto" if i % 4 == 1 else "link"}
    with connect(target, token=token, **options) as gpu:
        buf = gpu.allocate_memory(x.nbytes)
        if options["shared_memory"] and i % 4 == 0:
            host = gpu.host_array(x.shape, x.dtype)  # a segment of its own, besides the staging one
            host[:] = x
            gpu.copy_h2d(host, buf)
        else:
            gpu.copy_h2d(x, buf)
        kernel = gpu.compile_kernel(samples.source(backend), "scale_inplace")
        gpu.execute_kernel(kernel, x.size // 256, 256, [buf, np.float32(2), np.int32(x.size)])
        gpu.synchronize()
        out = np.empty_like(x)
        gpu.copy_d2h(buf, out)
        if not np.array_equal(out, x * 2 + 1):
            raise AssertionError(f"cycle {i}: wrong result")


def _tenant(target: str, token: str, warmup: int, cycles: int, go: Any, out: Any) -> None:
    x = np.arange(_N, dtype=np.float32)
    try:
        with connect(target, token=token) as gpu:
            backend = gpu.device_info().backend
        for i in range(warmup):
            _cycle(target, token, backend, i, x)
    except Exception as exc:  # the parent says why rather than waiting for a warm-up that never comes
        out.put(("failed", 0, [f"warm-up: {type(exc).__name__}: {exc}"[:300]]))
        return
    errors: list[str] = []
    out.put(("warm", 0, []))
    go.wait()
    started = time.monotonic()
    for i in range(cycles):
        try:
            _cycle(target, token, backend, i, x)
        except Exception as exc:  # counted and reported; the soak goes on
            errors.append(f"{type(exc).__name__}: {exc}"[:300])
    out.put(("done", time.monotonic() - started, errors))


# -- what a process holds -------------------------------------------------------------------------------
def _status(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return 0


def _memfds(pid: int) -> tuple[int, int]:
    """(shared segments the process maps, segment memfds it holds open): clients' segments, copy stagings."""
    maps = {line.split(maxsplit=5)[-1] for line in Path(f"/proc/{pid}/maps").read_text().splitlines()
            if "/memfd:gpubroker-" in line}
    held = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            held += os.readlink(f"/proc/{pid}/fd/{fd}").startswith("/memfd:gpubroker-")
        except OSError:
            pass
    return len(maps), held


def _process(pid: int) -> dict[str, Any]:
    mapped, held = _memfds(pid)
    return {"rss_kib": _status(pid, "VmRSS"), "fds": len(os.listdir(f"/proc/{pid}/fd")),
            "threads": _status(pid, "Threads"), "segments_mapped": mapped, "segment_fds": held}


def _workers(broker_pid: int) -> dict[int, str]:
    """The broker's worker processes: pid -> tenant (the workers themselves: under the sandbox, each is the child
    of a launcher that is the broker's child)."""
    found = {}
    for pid in descendants(broker_pid):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        module = argv[argv.index(b"-m") + 1:argv.index(b"-m") + 2] if b"-m" in argv else []  # (after -s -P)
        if module == [b"gpubroker.broker.worker"] and b"--tenant" in argv:
            found[pid] = argv[argv.index(b"--tenant") + 1].decode()
    return found


def snapshot(broker: BrokerProcess, admin_tenant: str) -> dict[str, Any]:
    """Everything the broker holds now (the admin connection used for it is closed before the fds are counted)."""
    assert broker.process is not None
    with AdminClient(broker.target, broker.tokens[admin_tenant]) as admin:
        usage = admin.usage()
        sessions = len(admin.list_sessions())
    workers = {tenant: _process(pid) for pid, tenant in sorted(_workers(broker.process.pid).items())}
    for tenant, figures in workers.items():
        # The device's own count, through a session of the tenant's worker: on OpenCL that worker's allocations
        # (total - free is exactly what it holds); on CUDA the whole device's use, allocator caches and all.
        with connect(broker.target, token=broker.tokens[tenant], shared_memory=False, transport="grpc") as gpu:
            info = gpu.device_info()
        figures["device_bytes_in_use"] = info.total_memory - info.free_memory
        figures["backend"] = info.backend
    return {"broker": _process(broker.process.pid), "workers": workers, "sessions": sessions,
            "device_memory_used": sum(u.memory_used for u in usage.tenants)}


def settled(broker: BrokerProcess, admin_tenant: str, baseline: dict[str, Any] | None = None,
            timeout: float = 15.0) -> dict[str, Any]:
    """A snapshot once the broker's descriptor count has settled (connections close asynchronously): equal to the
    baseline's, or without one, the same twice running; after ``timeout``, the last one taken."""
    assert broker.process is not None
    deadline = time.monotonic() + timeout
    previous = -1
    while True:
        now = snapshot(broker, admin_tenant)
        time.sleep(0.25)  # (a poll: the connections the snapshot itself opened close on the broker's side)
        now["broker"] = _process(broker.process.pid)
        fds = now["broker"]["fds"]
        if fds == (baseline["broker"]["fds"] if baseline else previous) or time.monotonic() > deadline:
            return now
        previous = fds


def run_soak(broker: BrokerProcess, tenants: list[str], cycles: int, warmup: int = 5, admin_tenant: str = "root"
             ) -> dict[str, Any]:
    ctx = mp.get_context("spawn")  # no fork of a process that runs gRPC threads
    go, out = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_tenant, args=(broker.target, broker.tokens[t], warmup, cycles, go, out))
             for t in tenants]
    for p in procs:
        p.start()
    try:
        for _ in procs:
            kind, _, errs = _report(out, procs, timeout=600)
            if kind == "failed":
                raise RuntimeError(f"a soak tenant failed its {errs[0]}")
        baseline = settled(broker, admin_tenant)
        started = time.monotonic()
        go.set()
        results = [_report(out, procs, timeout=24 * 3600) for _ in procs]
        duration = time.monotonic() - started
        final = settled(broker, admin_tenant, baseline)
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    errors = [e for _, _, errs in results for e in errs]
    total = cycles * len(tenants)
    return {"tenants": len(tenants), "cycles_per_tenant": cycles, "cycles": total, "errors": len(errors),
            "first_errors": errors[:5], "duration_s": round(duration, 1), "cycles_per_s": round(total / duration, 1),
            "baseline": baseline, "final": final, "back_to_baseline": compare(baseline, final)}


def _report(out: Any, procs: list[Any], timeout: float) -> tuple[str, float, list[str]]:
    """A tenant process's next report; RuntimeError once one has died without reporting (a crash, a kill), rather
    than waiting out ``timeout`` for it."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            report: tuple[str, float, list[str]] = out.get(timeout=1.0)
            return report
        except queue.Empty:
            dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if dead:
                raise RuntimeError(f"a soak tenant process died without reporting (exit code {dead[0]})") from None
            if time.monotonic() > deadline:
                raise TimeoutError(f"no soak tenant reported within {timeout:.0f} s") from None


def compare(baseline: dict[str, Any], final: dict[str, Any], rss_slack_kib: int = 16 * 1024,
            rss_slack: float = 0.10) -> dict[str, bool]:
    """Exact for descriptors, segments, device memory and sessions; RSS within a small slack (allocator noise)."""

    def rss_ok(before: dict[str, Any], after: dict[str, Any]) -> bool:
        return after["rss_kib"] <= before["rss_kib"] * (1 + rss_slack) + rss_slack_kib

    procs = [(baseline["broker"], final["broker"])]
    procs += [(baseline["workers"][t], final["workers"].get(t)) for t in baseline["workers"]]
    same_workers = baseline["workers"].keys() == final["workers"].keys()
    return {
        "workers_kept": same_workers,
        "fds": same_workers and all(after["fds"] == before["fds"] for before, after in procs),
        "segments": same_workers and all(after["segments_mapped"] == before["segments_mapped"]
                                         and after["segment_fds"] == before["segment_fds"] for before, after in procs),
        "device_memory": final["device_memory_used"] == baseline["device_memory_used"] and same_workers
        and all(after["device_bytes_in_use"] == before["device_bytes_in_use"] for before, after in procs[1:]
                if before["backend"] == "opencl"),
        "sessions": final["sessions"] == baseline["sessions"],
        "rss": same_workers and all(rss_ok(before, after) for before, after in procs),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gpubroker bench soak", description=__doc__.splitlines()[0])
    parser.add_argument("--cycles", type=int, default=1000, help="session cycles per tenant (default 1000)")
    parser.add_argument("--tenants", type=int, default=4, help="tenants cycling at once, one process each")
    parser.add_argument("--warmup", type=int, default=5, help="cycles per tenant before the baseline (default 5)")
    parser.add_argument("--backend", default="auto", choices=["auto", "cuda", "opencl"])
    parser.add_argument("--out", help="also write the JSON here")
    args = parser.parse_args(argv)
    names = [f"tenant{i}" for i in range(args.tenants)]
    specs = [TenantSpec(n, memory_quota=1 << 30) for n in names] + [TenantSpec("root", admin=True)]
    with BrokerProcess(specs, backend=args.backend, settings=SOAK_SETTINGS) as broker:
        result = run_soak(broker, names, args.cycles, args.warmup)
    result["backend"] = args.backend
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    ok = result["errors"] == 0 and all(result["back_to_baseline"].values())
    print(f"soak: {result['cycles']} cycles, {result['errors']} errors, back to baseline: "
          f"{result['back_to_baseline']}", file=sys.stderr)
    return 0 if ok else 1
