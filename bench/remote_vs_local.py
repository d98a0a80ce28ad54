"""Remote (through a broker) against in-process, in one run: launch round trip and copy bandwidth.

Prints JSON and a ratio table. Run: ``gpubroker bench [--backend cuda] [--quick]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import numpy as np

from gpubroker.broker import samples
from gpubroker.broker.backends import detect_backend, open_backend
from gpubroker.broker.launcher import BrokerProcess, TenantSpec
from gpubroker.client import GpuCompute, connect

__all__ = ["main", "measure"]


def _launch_round_trip(gpu: GpuCompute, backend: str, iterations: int) -> dict[str, float]:
    kernel = gpu.compile_kernel(samples.source(backend), "empty_kernel")
    for _ in range(max(5, iterations // 10)):
        gpu.execute_kernel(kernel, 1, 1, [])
        gpu.synchronize()
    times = []
    for _ in range(iterations):
        t0 = time.perf_counter()
        gpu.execute_kernel(kernel, 1, 1, [])
        gpu.synchronize()
        times.append(time.perf_counter() - t0)
    times.sort()
    return {"p50_us": statistics.median(times) * 1e6, "p99_us": times[int(len(times) * 0.99) - 1] * 1e6}


def _bandwidth(gpu: GpuCompute, size: int, repeats: int, host_array: bool = False) -> dict[str, float]:
    host = np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8)
    out = np.empty_like(host)
    if host_array:  # RemoteGpu only: host memory shared with the worker, so each copy is one CopyShared
        shared, out = gpu.host_array(size), gpu.host_array(size)  # type: ignore[attr-defined]
        shared[:] = host
        host = shared
    buf = gpu.allocate_memory(size)
    gpu.copy_h2d(host, buf)  # warm-up: first-touch and any lazy setup
    gpu.copy_d2h(buf, out)
    h2d, d2h = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        gpu.copy_h2d(host, buf)
        gpu.synchronize()
        h2d.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        gpu.copy_d2h(buf, out)
        d2h.append(time.perf_counter() - t0)
    if not np.array_equal(out, host):
        raise AssertionError("copy round trip returned different bytes")
    gpu.free_memory(buf)
    return {"h2d_gbps": size / min(h2d) / 1e9, "d2h_gbps": size / min(d2h) / 1e9}


def _async_launches(gpu: GpuCompute, backend: str, count: int) -> float:
    """Launches per second when nothing waits for each one (the remote client batches them)."""
    kernel = gpu.compile_kernel(samples.source(backend), "empty_kernel")
    for _ in range(min(count, 2000)):  # steady state: past first batches, event pools and caches filling
        gpu.execute_kernel(kernel, 1, 1, [])
    gpu.synchronize()
    t0 = time.perf_counter()
    for _ in range(count):
        gpu.execute_kernel(kernel, 1, 1, [])
    gpu.synchronize()
    return count / (time.perf_counter() - t0)


def _workload(gpu: GpuCompute, backend: str, n: int, iterations: int) -> dict[str, Any]:
    """A real small job: iterations of three dependent kernels on an n-element array, then its result."""
    src = samples.source(backend)
    saxpy, scale, add = (gpu.compile_kernel(src, k) for k in ("saxpy", "scale_inplace", "vector_add"))
    x = np.linspace(0, 1, n, dtype=np.float32)
    dx, dy, dz = (gpu.allocate_memory(x.nbytes) for _ in range(3))
    gpu.copy_h2d(x, dx)
    gpu.memset(dy, 0)
    grid, block, count = (n + 255) // 256, 256, np.int32(n)
    t0 = time.perf_counter()
    for i in range(iterations + 1):
        if i == 1:  # the first iteration warms up (a runtime may build kernels at their first launch)
            gpu.synchronize()
            t0 = time.perf_counter()
        gpu.execute_kernel(saxpy, grid, block, [np.float32(0.5), dx, dy, count])  # y += x/2
        gpu.execute_kernel(scale, grid, block, [dy, np.float32(0.5), count])  # y = y/2 + 1
        gpu.execute_kernel(add, grid, block, [dx, dy, dz, count])  # z = x + y
    gpu.synchronize()
    seconds = time.perf_counter() - t0
    out = np.empty(4, dtype=np.float32)
    gpu.copy_d2h(dz, out)
    for buf in (dx, dy, dz):
        gpu.free_memory(buf)
    return {"seconds": seconds, "elements": n, "iterations": iterations, "z0": float(out[0])}


def _sizes(quick: bool) -> list[int]:
    return [1 << 20, 16 << 20] if quick else [1 << 20, 16 << 20, 64 << 20, 256 << 20, 512 << 20]


def measure(gpu: GpuCompute, backend: str, quick: bool) -> dict[str, Any]:
    return {
        "launch_sync": _launch_round_trip(gpu, backend, 200 if quick else 2000),
        "copies": {str(size): _bandwidth(gpu, size, 2 if quick else 5) for size in _sizes(quick)},
    }


def measure_copies(gpu: GpuCompute, quick: bool, host_array: bool) -> dict[str, Any]:
    """Copy bandwidth only (a RemoteGpu on shared memory: from host_array, or plain numpy through staging)."""
    return {"copies": {str(size): _bandwidth(gpu, size, 2 if quick else 5, host_array) for size in _sizes(quick)}}


def _ratios(local: dict[str, Any], remote: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {
        "launch_sync_p50": remote["launch_sync"]["p50_us"] / local["launch_sync"]["p50_us"],
        "launch_sync_async_p50": remote["launch_sync_async"]["p50_us"] / local["launch_sync"]["p50_us"],
        "launch_sync_tcp_p50": remote["launch_sync_tcp"]["p50_us"] / local["launch_sync"]["p50_us"],
        "launch_sync_tcp_async_p50": remote["launch_sync_tcp_async"]["p50_us"] / local["launch_sync"]["p50_us"],
        "async_launches_per_s": remote["async_launches_per_s"] / local["async_launches_per_s"],
        "workload_time": remote["workload"]["seconds"] / local["workload"]["seconds"],
    }
    for size, figures in remote["copies"].items():
        out[f"h2d_{size}"] = figures["h2d_gbps"] / local["copies"][size]["h2d_gbps"]
        out[f"d2h_{size}"] = figures["d2h_gbps"] / local["copies"][size]["d2h_gbps"]
    for size, figures in remote.get("shm_copies", {}).items():
        out[f"shm_h2d_{size}"] = figures["h2d_gbps"] / local["copies"][size]["h2d_gbps"]
        out[f"shm_d2h_{size}"] = figures["d2h_gbps"] / local["copies"][size]["d2h_gbps"]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gpubroker bench")
    parser.add_argument("--backend", default="auto", choices=["auto", "cuda", "opencl"])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    backend = detect_backend() if args.backend == "auto" else args.backend
    # 1,000 iterations of three kernels on 10 M floats on a GPU; a CPU device gets a smaller job.
    workload = (10_000_000, 1000) if backend == "cuda" and not args.quick else (1_000_000, 50)

    with open_backend(backend, 0) as local_gpu:
        device = local_gpu.device_info().name
        local = measure(local_gpu, backend, args.quick)
        local["async_launches_per_s"] = _async_launches(local_gpu, backend, 2000 if args.quick else 20000)
        local["workload"] = _workload(local_gpu, backend, *workload)
    with BrokerProcess([TenantSpec("bench", memory_quota=1 << 40)], backend=backend, tcp=["127.0.0.1:0"]) as broker, \
            connect(broker.target, token=broker.tokens["bench"], device=0, shared_memory=False) as remote_gpu:
        remote = measure(remote_gpu, backend, args.quick)
        transport = "grpc-stream over a unix socket; shm: memfd segments through <socket>.shm + CopyShared"
        with connect(broker.target, token=broker.tokens["bench"], device=0) as shm_gpu:
            remote["shm_copies"] = measure_copies(shm_gpu, args.quick, host_array=True)["copies"]
            remote["shm_staged_copies"] = measure_copies(shm_gpu, args.quick, host_array=False)["copies"]
        with connect(broker.target, token=broker.tokens["bench"], device=0, async_commands=True) as async_gpu:
            # With asynchronous commands a launch + sync is one round trip: the sync rides with the launch.
            remote["launch_sync_async"] = _launch_round_trip(async_gpu, backend, 200 if args.quick else 2000)
            remote["async_launches_per_s"] = _async_launches(async_gpu, backend, 2000 if args.quick else 20000)
            remote["workload"] = _workload(async_gpu, backend, *workload)
        # A client on another host: plain gRPC over loopback TCP (local credentials and the bearer token).
        with connect(broker.tcp_target, token=broker.tokens["bench"], device=0) as tcp_gpu:
            remote["launch_sync_tcp"] = _launch_round_trip(tcp_gpu, backend, 200 if args.quick else 1000)
        with connect(broker.tcp_target, token=broker.tokens["bench"], device=0, async_commands=True) as tcp_gpu:
            remote["launch_sync_tcp_async"] = _launch_round_trip(tcp_gpu, backend, 200 if args.quick else 1000)

    result = {"backend": backend, "device": device, "transport": transport, "in_process": local,
              "remote": remote, "remote_over_in_process": _ratios(local, remote)}
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(f"\n{'metric':<28} {'in-process':>12} {'remote':>12} {'ratio':>8}", file=sys.stderr)
    lp, rp = local["launch_sync"]["p50_us"], remote["launch_sync"]["p50_us"]
    print(f"{'launch+sync p50 (us)':<28} {lp:>12.1f} {rp:>12.1f} {rp / lp:>8.2f}", file=sys.stderr)
    ra = remote["launch_sync_async"]["p50_us"]
    print(f"{'  same, async_commands':<28} {lp:>12.1f} {ra:>12.1f} {ra / lp:>8.2f}", file=sys.stderr)
    rt = remote["launch_sync_tcp"]["p50_us"]
    print(f"{'  same, gRPC over TCP':<28} {lp:>12.1f} {rt:>12.1f} {rt / lp:>8.2f}", file=sys.stderr)
    rt = remote["launch_sync_tcp_async"]["p50_us"]
    print(f"{'  same, TCP, async_commands':<28} {lp:>12.1f} {rt:>12.1f} {rt / lp:>8.2f}", file=sys.stderr)
    la, ra = local["async_launches_per_s"], remote["async_launches_per_s"]
    print(f"{'async launches per s':<28} {la:>12.0f} {ra:>12.0f} {ra / la:>8.2f}", file=sys.stderr)
    lw, rw = local["workload"]["seconds"], remote["workload"]["seconds"]
    print(f"{'workload time (s)':<28} {lw:>12.3f} {rw:>12.3f} {rw / lw:>8.2f}", file=sys.stderr)
    for size, figures in remote["copies"].items():
        for kind in ("h2d", "d2h"):
            lv, rv = local["copies"][size][f"{kind}_gbps"], figures[f"{kind}_gbps"]
            label = f"{kind.upper()} {int(size) >> 20} MiB (GB/s)"
            print(f"{label:<28} {lv:>12.2f} {rv:>12.2f} {rv / lv:>8.2f}", file=sys.stderr)
    print(f"\n{'copy (GB/s)':<20} {'in-process':>11} {'gRPC':>8} {'shm':>8} {'shm staged':>11} {'shm ratio':>10}",
          file=sys.stderr)
    for size in remote["copies"]:
        for kind in ("h2d", "d2h"):
            key = f"{kind}_gbps"
            lv, gv = local["copies"][size][key], remote["copies"][size][key]
            sv, tv = remote["shm_copies"][size][key], remote["shm_staged_copies"][size][key]
            label = f"{kind.upper()} {int(size) >> 20} MiB"
            print(f"{label:<20} {lv:>11.2f} {gv:>8.2f} {sv:>8.2f} {tv:>11.2f} {sv / lv:>10.2f}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
