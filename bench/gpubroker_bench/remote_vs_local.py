"""`gpubroker bench remote`: gpubroker against the plain runtime in one process, measured side by side.

Each run measures, in this order and on the same machine: the native baseline (plain CuPy with a RawKernel on a
non-blocking stream; without CUDA, plain pyopencl on the same OpenCL device), then the same work through a broker
this command starts, using only the public SDK (``gpubroker.client.connect``):

- same host (the framed link on ``<socket>.fast`` plus shared memory): launch + sync p50 with and without
  ``async_commands`` (and over gRPC, for reference); asynchronous launches per second and the client's CPU per
  queued launch; dependent small kernels (~15 us each on the device) with a 4-byte read back every 50 steps;
  large kernels (~5 ms each); ``host_array`` copies against pinned native copies and plain numpy copies against
  pageable native copies, 64 MiB to 512 MiB, H2D and D2H;
- loopback TCP with TLS (the framed link on ``link_listen``): launch + sync p50 and copy GB/s;
- "vsock": a Unix socket standing in for vsock (the framed link without shared memory, as a VM guest has it).

Three runs (``--runs``); the JSON reports each figure's median and spread (min, max), the ratios against native
per run, the issue's targets with whether the medians meet them, the host (hostname, device, driver) and the
commit. It goes to stdout and to ``bench/results/`` (or ``--out``); a table goes to stderr. ``--quick`` (CI, PoCL)
runs the same steps with tiny counts and sizes, in seconds.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np

from gpubroker.broker import samples
from gpubroker.broker.backends import detect_backend
from gpubroker.broker.certs import init_certs
from gpubroker.broker.config import TlsConfig
from gpubroker.broker.launcher import BrokerProcess, TenantSpec
from gpubroker.client import GpuCompute, RemoteGpu, TlsOptions, connect
from gpubroker_bench._native import SPIN_BLOCK, Native, open_native
from gpubroker_bench._net import free_port

__all__ = ["Plan", "main", "summarize", "write_result"]

MiB = 1 << 20
READ_EVERY = 50  # dependent small kernels: a 4-byte read back every this many steps
SMALL_KERNEL_S = 15e-6
LARGE_KERNEL_S = 5e-3
RESULTS = Path(__file__).resolve().parent / "results"


@dataclass(frozen=True)
class Plan:
    """How much each measure does (``--quick``: enough to exercise every path, in seconds on PoCL)."""

    launches: int  # launch + sync round trips (p50 of these)
    async_launches: int
    dependent_steps: int
    large_count: int
    copy_sizes: tuple[int, ...]
    copy_repeats: int
    link_copy_sizes: tuple[int, ...]  # TCP and vsock copies

    @staticmethod
    def make(backend: str, quick: bool) -> Plan:
        if quick:
            return Plan(100, 500, 2 * READ_EVERY, 2, (1 * MiB, 4 * MiB), 1, (1 * MiB,))
        cuda = backend == "cuda"
        return Plan(5000 if cuda else 1000, 100_000 if cuda else 10_000, 2000 if cuda else 500, 20 if cuda else 5,
                    (64 * MiB, 128 * MiB, 256 * MiB, 512 * MiB), 3, (64 * MiB, 256 * MiB))


# -- the remote side: the same work as _native.py, through the SDK ---------------------------------------------
@dataclass
class _Kernels:
    empty: Any
    spin: Any
    x: Any  # the spin kernel's buffer (SPIN_BLOCK floats)


def _prepare(gpu: GpuCompute, backend: str) -> _Kernels:
    src = samples.source(backend)
    kernels = _Kernels(gpu.compile_kernel(src, "empty_kernel"), gpu.compile_kernel(src, "spin"),
                       gpu.allocate_memory(SPIN_BLOCK * 4))
    gpu.memset(kernels.x, 0)
    gpu.execute_kernel(kernels.empty, 1, 1, [])
    gpu.execute_kernel(kernels.spin, 1, SPIN_BLOCK, [kernels.x, np.int64(1)])
    gpu.synchronize()
    return kernels


def _launch_sync(gpu: GpuCompute, k: _Kernels, iterations: int) -> float:
    """p50 of an empty launch followed by a synchronize, in microseconds."""
    for _ in range(max(5, iterations // 10)):
        gpu.execute_kernel(k.empty, 1, 1, [])
        gpu.synchronize()
    times = []
    for _ in range(iterations):
        t0 = time.perf_counter()
        gpu.execute_kernel(k.empty, 1, 1, [])
        gpu.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def _async_launches(gpu: GpuCompute, k: _Kernels, count: int) -> tuple[float, float]:
    for _ in range(min(count, 2000)):  # steady state: past the first batches and whatever fills lazily
        gpu.execute_kernel(k.empty, 1, 1, [])
    gpu.synchronize()
    c0, t0 = time.process_time(), time.perf_counter()
    for _ in range(count):
        gpu.execute_kernel(k.empty, 1, 1, [])
    gpu.synchronize()
    return time.perf_counter() - t0, time.process_time() - c0


def _spin_chain(gpu: GpuCompute, k: _Kernels, iters: int, steps: int, read_every: int) -> float:
    n, word = np.int64(iters), np.empty(1, dtype=np.float32)
    t0 = time.perf_counter()
    for i in range(1, steps + 1):
        gpu.execute_kernel(k.spin, 1, SPIN_BLOCK, [k.x, n])
        if read_every and i % read_every == 0:
            gpu.copy_d2h(k.x, word)
    gpu.synchronize()
    return time.perf_counter() - t0


def _spin_each(gpu: GpuCompute, k: _Kernels, iters: int, count: int) -> float:
    n = np.int64(iters)
    t0 = time.perf_counter()
    for _ in range(count):
        gpu.execute_kernel(k.spin, 1, SPIN_BLOCK, [k.x, n])
        gpu.synchronize()
    return time.perf_counter() - t0


def _copies(gpu: RemoteGpu, size: int, repeats: int, host_array: bool) -> dict[str, float]:
    """Best H2D and D2H GB/s: from ``host_array`` memory (shared with the worker) or from plain numpy arrays."""
    data = np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8)
    if host_array:
        host, out = gpu.host_array(size), gpu.host_array(size)
        host[:] = data
    else:
        host, out = data, np.empty_like(data)
    buf = gpu.allocate_memory(size)
    h2d, d2h = [], []
    for i in range(repeats + 1):  # the first round warms up
        t0 = time.perf_counter()
        gpu.copy_h2d(host, buf)
        gpu.synchronize()
        t1 = time.perf_counter()
        gpu.copy_d2h(buf, out)
        t2 = time.perf_counter()
        if i:
            h2d.append(t1 - t0)
            d2h.append(t2 - t1)
    if not np.array_equal(out, data):
        raise AssertionError("remote copy round trip returned different bytes")
    gpu.free_memory(buf)
    return {"h2d_gbps": size / min(h2d) / 1e9, "d2h_gbps": size / min(d2h) / 1e9}


# -- one run ------------------------------------------------------------------------------------------------------
@dataclass
class _Setup:
    backend: str
    plan: Plan
    small_iters: int
    large_iters: int
    broker: BrokerProcess
    tls: TlsOptions


def _size_key(size: int) -> str:
    return f"{size // MiB}MiB"


def _native_run(native: Native, s: _Setup) -> dict[str, Any]:
    p = s.plan
    native.launch_sync(max(5, p.launches // 10))
    wall, cpu = native.async_launches(p.async_launches)
    return {
        "launch_sync_p50_us": statistics.median(native.launch_sync(p.launches)) * 1e6,
        "async_launches_per_s": p.async_launches / wall,
        "cpu_us_per_launch": cpu / p.async_launches * 1e6,
        "dependent_small_kernels_s": native.spin_chain(s.small_iters, p.dependent_steps, READ_EVERY),
        "large_kernels_s": native.spin_each(s.large_iters, p.large_count),
        "copies_pinned": {_size_key(n): native.copies(n, p.copy_repeats, pinned=True) for n in p.copy_sizes},
        "copies_pageable": {_size_key(n): native.copies(n, p.copy_repeats, pinned=False) for n in p.copy_sizes},
    }


@contextmanager
def _session(s: _Setup, target: str, kind: str, **kwargs: Any) -> Iterator[tuple[RemoteGpu, _Kernels]]:
    """A session whose commands take the transport ``kind`` ("ring", "unix", "tcp" or "grpc"), or an error: a
    benchmark that fell back to another transport would report the wrong one's figures."""
    transport = kind if kind in ("grpc", "ring") else "link"
    with connect(target, token=s.broker.tokens["bench"], device=0, transport=transport, **kwargs) as gpu:
        if gpu.transport.kind != kind:
            raise AssertionError(f"asked for a {kind} transport, got {gpu.transport.kind}")
        yield gpu, _prepare(gpu, s.backend)


def _link_figures(s: _Setup, target: str, kind: str, **kwargs: Any) -> dict[str, Any]:
    """Launch + sync (with and without async_commands) and plain numpy copies over one transport."""
    p = s.plan
    with _session(s, target, kind, **kwargs) as (gpu, k):
        figures: dict[str, Any] = {"launch_sync_p50_us": _launch_sync(gpu, k, p.launches)}
        figures["copies"] = {_size_key(n): _copies(gpu, n, p.copy_repeats, host_array=False)
                             for n in p.link_copy_sizes}
    with _session(s, target, kind, async_commands=True, **kwargs) as (gpu, k):
        figures["launch_sync_async_p50_us"] = _launch_sync(gpu, k, p.launches)
    return figures


def _remote_run(s: _Setup) -> dict[str, Any]:
    p, target = s.plan, s.broker.target
    remote: dict[str, Any] = {}
    with _session(s, target, "ring") as (gpu, k):  # synchronous: every call is its own round trip
        remote["launch_sync_p50_us"] = _launch_sync(gpu, k, p.launches)
        remote["copies_host_array"] = {_size_key(n): _copies(gpu, n, p.copy_repeats, host_array=True)
                                       for n in p.copy_sizes}
        remote["copies_numpy"] = {_size_key(n): _copies(gpu, n, p.copy_repeats, host_array=False)
                                  for n in p.copy_sizes}
    with _session(s, target, "ring", async_commands=True) as (gpu, k):
        # With asynchronous commands a launch + sync is one round trip: the sync rides with the launch.
        remote["launch_sync_async_p50_us"] = _launch_sync(gpu, k, p.launches)
        wall, cpu = _async_launches(gpu, k, p.async_launches)
        remote["async_launches_per_s"] = p.async_launches / wall
        remote["cpu_us_per_launch"] = cpu / p.async_launches * 1e6
        remote["dependent_small_kernels_s"] = _spin_chain(gpu, k, s.small_iters, p.dependent_steps, READ_EVERY)
        remote["large_kernels_s"] = _spin_each(gpu, k, s.large_iters, p.large_count)
    with _session(s, target, "grpc") as (gpu, k):  # for reference: what other languages get
        remote["grpc_launch_sync_p50_us"] = _launch_sync(gpu, k, p.launches)
    remote["tcp_tls"] = _link_figures(s, s.broker.tcp_target, "tcp", tls=s.tls)
    remote["vsock_standin"] = _link_figures(s, target, "unix", shared_memory=False)
    return remote


def _ratios(native: dict[str, Any], remote: dict[str, Any]) -> dict[str, Any]:
    """remote / native per figure: above 1 is slower for times, below 1 is slower for rates."""
    lp = native["launch_sync_p50_us"]

    def per_size(ours: dict[str, Any], theirs: dict[str, Any]) -> dict[str, Any]:
        return {size: {d: ours[size][f"{d}_gbps"] / theirs[size][f"{d}_gbps"] for d in ("h2d", "d2h")}
                for size in ours}

    return {
        "launch_sync_p50": remote["launch_sync_p50_us"] / lp,
        "launch_sync_async_p50": remote["launch_sync_async_p50_us"] / lp,
        "grpc_launch_sync_p50": remote["grpc_launch_sync_p50_us"] / lp,
        "async_launch_rate": remote["async_launches_per_s"] / native["async_launches_per_s"],
        "cpu_per_launch": remote["cpu_us_per_launch"] / native["cpu_us_per_launch"],
        "dependent_small_kernels_time": remote["dependent_small_kernels_s"] / native["dependent_small_kernels_s"],
        "large_kernels_time": remote["large_kernels_s"] / native["large_kernels_s"],
        "host_array_vs_pinned": per_size(remote["copies_host_array"], native["copies_pinned"]),
        "numpy_vs_pageable": per_size(remote["copies_numpy"], native["copies_pageable"]),
        "tcp_tls_launch_sync_p50": remote["tcp_tls"]["launch_sync_p50_us"] / lp,
        "vsock_standin_launch_sync_p50": remote["vsock_standin"]["launch_sync_p50_us"] / lp,
    }


# -- summaries, targets, provenance -------------------------------------------------------------------------------
def summarize(runs: list[Any]) -> Any:
    """Runs of the same shape -> the same shape with each number as {"median", "min", "max"}."""
    first = runs[0]
    if isinstance(first, dict):
        return {key: summarize([run[key] for run in runs]) for key in first}
    values = [float(v) for v in runs]
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def _leaves(tree: Any) -> Iterator[float]:
    if isinstance(tree, dict) and "median" not in tree:
        for value in tree.values():
            yield from _leaves(value)
    else:
        yield tree["median"]


def _targets(remote: dict[str, Any], ratios: dict[str, Any]) -> dict[str, Any]:
    """The targets (issue 25's, for CUDA on an H100 or H200; issue 13's where issue 25 sets none: large kernels,
    numpy copies, the vsock stand-in's round trip, the client's CPU per launch), each with the medians it was
    judged on."""
    def med(tree: dict[str, Any], key: str) -> float:
        return float(tree[key]["median"])

    def target(text: str, values: dict[str, float], met: bool) -> dict[str, Any]:
        return {"target": text, "values": values, "met": met}

    sync, sync_async = med(remote, "launch_sync_p50_us"), med(remote, "launch_sync_async_p50_us")
    tcp, vsock = remote["tcp_tls"], remote["vsock_standin"]
    out = {
        "same_host_launch_sync": target(
            "p50 <= 25 us, and <= 20 us with async_commands",
            {"p50_us": sync, "async_p50_us": sync_async, "ratio": med(ratios, "launch_sync_p50"),
             "async_ratio": med(ratios, "launch_sync_async_p50")},
            sync <= 25 and sync_async <= 20),
        "async_launches": target(
            ">= 0.9x native's rate; client CPU per queued launch <= 3 us",
            {"ratio": med(ratios, "async_launch_rate"), "cpu_us_per_launch": med(remote, "cpu_us_per_launch")},
            med(ratios, "async_launch_rate") >= 0.9 and med(remote, "cpu_us_per_launch") <= 3),
        "dependent_small_kernels": target("<= 1.2x native", {"ratio": med(ratios, "dependent_small_kernels_time")},
                                          med(ratios, "dependent_small_kernels_time") <= 1.2),
        "large_kernels": target("<= 1.03x native", {"ratio": med(ratios, "large_kernels_time")},
                                med(ratios, "large_kernels_time") <= 1.03),
        "host_array_copies": target(">= 0.95x pinned native, every size and direction",
                                    {"worst_ratio": min(_leaves(ratios["host_array_vs_pinned"]))},
                                    min(_leaves(ratios["host_array_vs_pinned"])) >= 0.95),
        "numpy_copies": target(">= 1.0x pageable native, every size and direction",
                               {"worst_ratio": min(_leaves(ratios["numpy_vs_pageable"]))},
                               min(_leaves(ratios["numpy_vs_pageable"])) >= 1.0),
    }
    for name, figures, bound in (("tcp_tls", tcp, 100), ("vsock_standin", vsock, 150)):
        worst = min(_leaves(figures["copies"]))
        p50 = max(med(figures, "launch_sync_p50_us"), med(figures, "launch_sync_async_p50_us"))
        out[name] = target(f"launch + sync p50 <= {bound} us (with and without async_commands); copies >= 3 GB/s "
                           "each way", {"worst_p50_us": p50, "worst_copy_gbps": worst}, p50 <= bound and worst >= 3)
    return out


def _commit() -> dict[str, Any]:
    """The commit measured: git's, or GPUBROKER_COMMIT where the code runs from a wheel (the GPU machine)."""
    if os.environ.get("GPUBROKER_COMMIT"):
        return {"commit": os.environ["GPUBROKER_COMMIT"], "from": "GPUBROKER_COMMIT"}
    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10)
        if head.returncode == 0:
            dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                                   capture_output=True, text=True, timeout=10).stdout.strip() != ""
            return {"commit": head.stdout.strip(), "dirty": dirty}
    except (OSError, subprocess.SubprocessError):
        pass
    return {"version": metadata.version("gpubroker")}


def _calibrate(native: Native, seconds: float, steps: int) -> tuple[int, float]:
    """The spin kernel's iteration count that runs about ``seconds`` on this device (natively), and what one
    kernel then takes. A device whose launch alone costs more (a CPU device) gets the smallest kernel it has."""
    iters = 1000
    for _ in range(6):
        per = native.spin_chain(iters, steps, 0) / steps
        new = max(1, round(iters * seconds / per))
        if abs(new - iters) <= iters * 0.03:
            break
        iters = new
    return iters, native.spin_chain(iters, steps, 0) / steps


def measure(backend: str, quick: bool, runs: int, device: int = 0,
            progress: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    plan = Plan.make(backend, quick)
    native = open_native(backend, device)
    try:
        host = {"hostname": socket.gethostname(), "platform": platform.platform(), **native.info()}
        progress("calibrating the spin kernel")
        small_iters, small_s = _calibrate(native, SMALL_KERNEL_S, 200 if not quick else 20)
        large_iters, large_s = _calibrate(native, LARGE_KERNEL_S, 5 if not quick else 2)
        with tempfile.TemporaryDirectory(prefix="gpb-bench-") as certs:
            _, server = init_certs(certs)
            settings = {"tls": TlsConfig(cert_file=str(server.cert), key_file=str(server.key)),
                        "link_listen": f"127.0.0.1:{free_port()}"}
            with BrokerProcess([TenantSpec("bench", memory_quota=1 << 40)], backend=backend,
                               tcp=["127.0.0.1:0"], settings=settings) as broker:
                setup = _Setup(backend, plan, small_iters, large_iters, broker,
                               TlsOptions(ca_file=str(Path(certs) / "ca.pem")))
                native_runs, remote_runs, ratio_runs = [], [], []
                for run in range(runs):
                    progress(f"run {run + 1} of {runs}: native")
                    native_runs.append(_native_run(native, setup))
                    progress(f"run {run + 1} of {runs}: through the broker")
                    remote_runs.append(_remote_run(setup))
                    ratio_runs.append(_ratios(native_runs[-1], remote_runs[-1]))
    finally:
        native.close()
    remote, ratios = summarize(remote_runs), summarize(ratio_runs)
    return {
        "bench": "remote", "backend": backend, "quick": quick, "runs": runs,
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), "host": host, "source": _commit(),
        "native": native.kind,
        "transports": {
            "same_host": "the link on <socket>.fast upgraded to a shared-memory ring, straight to the worker, with "
                         "shared memory for copies",
            "grpc": "gRPC on the broker's Unix socket (reference: other languages, grpcurl)",
            "tcp_tls": "the framed link over loopback TCP with TLS (link_listen; the front terminates TLS)",
            "vsock_standin": "a Unix socket standing in for vsock: the framed link without shared memory",
        },
        "kernels": {"small": {"iters": small_iters, "native_us": small_s * 1e6},
                    "large": {"iters": large_iters, "native_ms": large_s * 1e3},
                    "read_back_every": READ_EVERY},
        "plan": {k: list(v) if isinstance(v, tuple) else v for k, v in plan.__dict__.items()},
        "native_figures": summarize(native_runs), "remote_figures": remote, "remote_over_native": ratios,
        "targets": _targets(remote, ratios),
    }


# -- output -------------------------------------------------------------------------------------------------------
def _spread(stat: dict[str, float], fmt: str) -> str:
    return f"{stat['median']:{fmt}} [{stat['min']:{fmt}}-{stat['max']:{fmt}}]"


def table(result: dict[str, Any]) -> str:
    n, r, q = result["native_figures"], result["remote_figures"], result["remote_over_native"]
    lines = [f"{result['host']['device']} on {result['host']['hostname']}; native: {result['native']}",
             f"medians of {result['runs']} runs [min-max]", "",
             f"{'measure':<34} {'native':>10} {'gpubroker':>26} {'ratio':>7}"]

    def row(label: str, native: dict[str, float] | None, remote: dict[str, float], ratio: dict[str, float] | None,
            fmt: str = ".1f") -> None:
        nv = f"{native['median']:{fmt}}" if native else ""
        rv = f"{ratio['median']:.2f}" if ratio else ""
        lines.append(f"{label:<34} {nv:>10} {_spread(remote, fmt):>26} {rv:>7}")

    row("launch+sync p50 (us)", n["launch_sync_p50_us"], r["launch_sync_p50_us"], q["launch_sync_p50"])
    row("  async_commands", n["launch_sync_p50_us"], r["launch_sync_async_p50_us"], q["launch_sync_async_p50"])
    row("  gRPC", n["launch_sync_p50_us"], r["grpc_launch_sync_p50_us"], q["grpc_launch_sync_p50"])
    row("  TCP + TLS link", n["launch_sync_p50_us"], r["tcp_tls"]["launch_sync_p50_us"],
        q["tcp_tls_launch_sync_p50"])
    row("  TCP + TLS link, async_commands", None, r["tcp_tls"]["launch_sync_async_p50_us"], None)
    row("  vsock stand-in", n["launch_sync_p50_us"], r["vsock_standin"]["launch_sync_p50_us"],
        q["vsock_standin_launch_sync_p50"])
    row("  vsock stand-in, async_commands", None, r["vsock_standin"]["launch_sync_async_p50_us"], None)
    row("async launches per s", n["async_launches_per_s"], r["async_launches_per_s"], q["async_launch_rate"], ".0f")
    row("client CPU per launch (us)", n["cpu_us_per_launch"], r["cpu_us_per_launch"], q["cpu_per_launch"], ".2f")
    row("dependent small kernels (s)", n["dependent_small_kernels_s"], r["dependent_small_kernels_s"],
        q["dependent_small_kernels_time"], ".3f")
    row("large kernels (s)", n["large_kernels_s"], r["large_kernels_s"], q["large_kernels_time"], ".3f")
    for size in r["copies_host_array"]:
        for d in ("h2d", "d2h"):
            row(f"host_array {d.upper()} {size} (GB/s)", n["copies_pinned"][size][f"{d}_gbps"],
                r["copies_host_array"][size][f"{d}_gbps"], q["host_array_vs_pinned"][size][d], ".2f")
    for size in r["copies_numpy"]:
        for d in ("h2d", "d2h"):
            row(f"numpy {d.upper()} {size} (GB/s)", n["copies_pageable"][size][f"{d}_gbps"],
                r["copies_numpy"][size][f"{d}_gbps"], q["numpy_vs_pageable"][size][d], ".2f")
    for name, label in (("tcp_tls", "TCP + TLS"), ("vsock_standin", "vsock stand-in")):
        for size, figures in r[name]["copies"].items():
            for d in ("h2d", "d2h"):
                row(f"{label} {d.upper()} {size} (GB/s)", None, figures[f"{d}_gbps"], None, ".2f")
    lines.append("")
    lines.append("targets (the issue's, for CUDA):")
    for name, t in result["targets"].items():
        values = ", ".join(f"{k} {v:.2f}" for k, v in t["values"].items())
        lines.append(f"  {'met ' if t['met'] else 'MISS'} {name:<24} {t['target']}: {values}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gpubroker bench remote", description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="auto", choices=["auto", "cuda", "opencl"])
    parser.add_argument("--device", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="tiny counts and sizes (CI)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--out", help="write the JSON here (default: a new file in bench/results/)")
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error("--runs must be at least 1")
    backend = detect_backend() if args.backend == "auto" else args.backend
    result = measure(backend, args.quick, args.runs, args.device,
                     progress=lambda text: print(f"bench remote: {text}", file=sys.stderr, flush=True))
    write_result(result, "remote", backend, args.quick, args.out)
    print(table(result), file=sys.stderr)
    return 0


def write_result(result: Any, bench: str, backend: str, quick: bool, out_arg: str | None) -> None:
    """A benchmark's JSON: to stdout, and to ``out_arg`` or (in a source checkout) a new file in bench/results/."""
    text = json.dumps(result, indent=2)
    print(text)
    out = Path(out_arg) if out_arg else None
    if out is None and RESULTS.is_dir():  # a source checkout: keep the figures beside the others
        stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%S")
        out = RESULTS / f"{bench}-{backend}{'-quick' if quick else ''}-{socket.gethostname()}-{stamp}.json"
    if out is not None:
        out.write_text(text + "\n")
        print(f"bench {bench}: wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
