"""Several devices through one broker: sessions on every device at once, peer copies, and fairness per device.

1. Placement: sessions opened without a device, and where the broker put each.
2. Sessions on every device at once (one thread each): saxpy launches on each device, checked against numpy.
3. Peer copies of ``--copy-size`` (1 GiB) from device 0 to 1 and back, byte-compared, timed through the broker
   (GB/s = 1e9 bytes/s, over ``--repeats`` copies: best and median). When the broker took the GPUs' peer path,
   the same copies again on a broker with ``peer_copies = "host"``, for comparison.
4. Fairness per device: ``--tenants`` equal saturating tenants per device (each in its own process) and one light
   tenant per device, all devices at once; Jain's index of the shares within each device, the light tenant's
   scheduler wait.

Run: ``gpubroker bench multi [--backend cuda] [--copy-size 1GiB] [--seconds 10] [--out FILE]``. Prints JSON. On
OpenCL, PoCL is asked for two CPU devices (``POCL_DEVICES="pthread pthread"``) unless POCL_DEVICES is set.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import threading
import time
from typing import Any

import numpy as np

from gpubroker.broker import samples
from gpubroker.broker.backends import detect_backend
from gpubroker.broker.config import parse_size
from gpubroker.broker.launcher import BrokerProcess, TenantSpec
from gpubroker.client import AdminClient, RemoteGpu, connect, list_devices
from gpubroker_bench.fairness import _calibrate, _light, _saturate

__all__ = ["main"]


def _placement(target: str, token: str, count: int) -> list[int]:
    """Open ``count`` sessions without naming a device, all held at once; the devices they got."""
    gpus = [connect(target, token=token) for _ in range(count)]
    try:
        return [int(gpu.device or 0) for gpu in gpus]
    finally:
        for gpu in gpus:
            gpu.close()


def _compute(target: str, token: str, device: int, backend: str, n: int, launches: int, start: threading.Barrier,
             out: dict[int, dict[str, Any]]) -> None:
    try:
        with connect(target, token=token, device=device) as gpu:
            saxpy = gpu.compile_kernel(samples.source(backend), "saxpy")
            x = np.arange(n, dtype=np.float32) % 1000
            dx, dy = gpu.allocate_memory(x.nbytes), gpu.allocate_memory(x.nbytes)
            gpu.copy_h2d(x, dx)
            gpu.memset(dy, 0)
            start.wait()
            t0 = time.perf_counter()
            for _ in range(launches):
                gpu.execute_kernel(saxpy, grid=(n + 255) // 256, block=256,
                                   args=[np.float32(0.5), dx, dy, np.int32(n)])
            gpu.synchronize()
            seconds = time.perf_counter() - t0
            y = np.empty_like(x)
            gpu.copy_d2h(dy, y)
            expected = np.zeros_like(x)
            for _ in range(launches):
                expected += np.float32(0.5) * x  # the same float32 steps as the device
            out[device] = {"device": gpu.device, "name": gpu.device_info().name, "launches": launches,
                           "seconds": seconds, "correct": bool(np.array_equal(y, expected))}
    except Exception as exc:  # reported, not raised: the other device's figure still counts
        out[device] = {"device": device, "error": f"{type(exc).__name__}: {exc}", "correct": False}


def _sessions_at_once(target: str, token: str, devices: int, backend: str, n: int, launches: int
                      ) -> list[dict[str, Any]]:
    results: dict[int, dict[str, Any]] = {}
    start = threading.Barrier(devices)
    threads = [threading.Thread(target=_compute, args=(target, token, d, backend, n, launches, start, results))
               for d in range(devices)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return [results[d] for d in range(devices)]


def _one_way(src_gpu: RemoteGpu, dst_gpu: RemoteGpu, size: int, repeats: int, seed: int) -> dict[str, Any]:
    host = src_gpu.host_array(size, np.uint8)
    host[:] = np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)
    src, dst = src_gpu.allocate_memory(size), dst_gpu.allocate_memory(size)
    try:
        src_gpu.copy_h2d(host, src)
        dst_gpu.memset(dst, 0)
        times, paths = [], set()
        for _ in range(repeats):
            t0 = time.perf_counter()
            paths.add(src_gpu.copy_peer(src, dst_gpu, dst, size))
            times.append(time.perf_counter() - t0)
        back = dst_gpu.host_array(size, np.uint8)
        dst_gpu.copy_d2h(dst, back)
        correct = bool(np.array_equal(back, host))
    finally:
        src_gpu.free_memory(src)
        dst_gpu.free_memory(dst)
    return {"bytes": size, "path": "/".join(sorted(paths)), "correct": correct,
            "gb_per_s_best": size / min(times) / 1e9, "gb_per_s_median": size / statistics.median(times) / 1e9,
            "seconds": times}


def _peer_copies(target: str, token: str, size: int, repeats: int) -> dict[str, Any]:
    with connect(target, token=token, device=0) as gpu0, connect(target, token=token, device=1) as gpu1:
        return {"0->1": _one_way(gpu0, gpu1, size, repeats, 1), "1->0": _one_way(gpu1, gpu0, size, repeats, 2)}


def _fairness(target: str, tokens: dict[str, str], admin_token: str, backend: str, devices: int, tenants: int,
              seconds: float) -> dict[str, Any]:
    lengths = [_calibrate(backend, 1.0)] * 3 + [_calibrate(backend, 5.0)]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = []
    for d in range(devices):
        for i in range(tenants):
            procs.append(ctx.Process(target=_saturate, args=(target, tokens[f"d{d}t{i}"], backend, lengths, seconds,
                                                             out, d)))
        procs.append(ctx.Process(target=_light, args=(target, tokens[f"d{d}light"], backend, seconds, out, d)))
    with AdminClient(target, admin_token) as admin:
        for proc in procs:
            proc.start()
        # Shares over the middle of the run: from when every saturating tenant has been charged until the first
        # process is done (before, some were still starting; after, the rest share a smaller field).
        first: dict[tuple[str, int], float] | None = None
        last: dict[tuple[str, int], float] = {}
        while all(p.is_alive() for p in procs):
            usage = {(u.tenant, u.device): u.device_seconds for u in admin.usage().tenants}
            charged = all(usage.get((f"d{d}t{i}", d), 0) > 0 for d in range(devices) for i in range(tenants))
            if first is None and charged:
                first = usage
            last = usage
            time.sleep(0.25)
        final = {(u.tenant, u.device): u for u in admin.usage().tenants}
        reports = [out.get() for _ in procs]  # before joining: a child exits only once its report is read
        for proc in procs:
            proc.join()
    kernels = [v for k, v in reports if k == "kernels"]
    first = first or {}
    per_device = {}
    for d in range(devices):
        names = [f"d{d}t{i}" for i in range(tenants)]
        used = [last.get((t, d), 0.0) - first.get((t, d), 0.0) for t in names]
        window = "all running"
        if not sum(used):  # a run too short (or a host too busy) for a window with charges: the whole run
            used = [final[(t, d)].device_seconds if (t, d) in final else 0.0 for t in names]
            window = "whole run"
        total = sum(used) or 1.0
        shares = [u / total for u in used]
        x = [s * tenants for s in shares]
        light = final.get((f"d{d}light", d))
        per_device[str(d)] = {
            "shares": dict(zip(names, shares, strict=True)),
            "jain_index": sum(x) ** 2 / (len(x) * sum(v * v for v in x)) if any(x) else None,
            "window": window,
            "device_seconds_in_window": sum(used),
            "light_wait_ms": {"p50": light.wait_p50_ms, "p99": light.wait_p99_ms} if light else None,
        }
    return {"tenants_per_device": tenants, "seconds": seconds, "kernels_per_s": sum(kernels) / seconds,
            "devices": per_device}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gpubroker bench multi")
    parser.add_argument("--backend", default="auto", choices=["auto", "cuda", "opencl"])
    parser.add_argument("--copy-size", default="1GiB", help="bytes per peer copy (default 1GiB)")
    parser.add_argument("--repeats", type=int, default=5, help="peer copies timed each way (default 5)")
    parser.add_argument("--seconds", type=float, default=10.0, help="of the fairness run (default 10; 0: skip it)")
    parser.add_argument("--tenants", type=int, default=4, help="saturating tenants per device (default 4)")
    parser.add_argument("--elements", type=int, default=1 << 24, help="floats per device in the compute check")
    parser.add_argument("--launches", type=int, default=200, help="saxpy launches per device in the compute check")
    parser.add_argument("--out", help="write the JSON here too")
    args = parser.parse_args(argv)
    backend = detect_backend() if args.backend == "auto" else args.backend
    env = {"POCL_DEVICES": "pthread pthread"} if backend == "opencl" and "POCL_DEVICES" not in os.environ else {}
    size = parse_size(args.copy_size)
    tenants = [TenantSpec("ops", admin=True), TenantSpec("multi", memory_quota=1 << 40)]
    tenants += [TenantSpec(f"d{d}{t}") for d in range(2) for t in [*(f"t{i}" for i in range(args.tenants)), "light"]]
    settings = {"max_sessions_per_tenant": 8}
    results: dict[str, Any] = {"backend": backend}
    with BrokerProcess(tenants, backend=backend, settings=settings, env=env) as broker:
        token = broker.tokens["multi"]
        devices = list_devices(broker.target, token)
        results["devices"] = [{"id": d.id, "name": d.name, "health": d.health} for d in devices]
        if len(devices) < 2:
            print(json.dumps({**results, "error": "this broker serves fewer than two devices"}, indent=2))
            return 1
        results["placement"] = _placement(broker.target, token, 2 * len(devices))
        results["sessions_at_once"] = _sessions_at_once(broker.target, token, len(devices), backend, args.elements,
                                                        args.launches)
        results["peer_copy"] = _peer_copies(broker.target, token, size, args.repeats)
        if args.seconds > 0:
            fair_tokens = {n: t for n, t in broker.tokens.items() if n.startswith("d")}
            results["fairness"] = _fairness(broker.target, fair_tokens, broker.tokens["ops"], backend, 2,
                                            args.tenants, args.seconds)
    if results["peer_copy"]["0->1"]["path"] == "peer":  # the host path too, for comparison
        with BrokerProcess(tenants[:2], backend=backend, settings={"peer_copies": "host"}, env=env) as broker:
            results["peer_copy_host_path"] = _peer_copies(broker.target, broker.tokens["multi"], size, args.repeats)
    text = json.dumps(results, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    ok = all(r.get("correct") for r in results["sessions_at_once"])
    ok = ok and all(r["correct"] for key in ("peer_copy", "peer_copy_host_path") for r in results.get(key, {}).values())
    for key in ("peer_copy", "peer_copy_host_path"):
        for way, r in results.get(key, {}).items():
            print(f"{key} {way}: {r['path']}, {r['gb_per_s_best']:.1f} GB/s best, {r['gb_per_s_median']:.1f} median, "
                  f"{'correct' if r['correct'] else 'WRONG'}", file=sys.stderr)
    for d, row in results.get("fairness", {}).get("devices", {}).items():
        print(f"fairness device {d}: Jain {row['jain_index']}, light wait {row['light_wait_ms']}", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
