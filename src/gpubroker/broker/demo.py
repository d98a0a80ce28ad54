"""`gpubroker demo`: an embedded broker, two tenants doing real work at once, checked against numpy."""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np

from gpubroker.broker import samples
from gpubroker.broker.launcher import BrokerProcess, TenantSpec
from gpubroker.client import GpuCompute, connect

__all__ = ["run_demo", "vector_add_job", "matmul_job"]


def vector_add_job(gpu: GpuCompute, n: int = 1 << 20) -> dict[str, Any]:
    backend = gpu.device_info().backend
    rng = np.random.default_rng(1)
    a, b = rng.random(n, dtype=np.float32), rng.random(n, dtype=np.float32)
    t0 = time.perf_counter()
    kernel = gpu.compile_kernel(samples.source(backend), "vector_add")
    t_compile = time.perf_counter() - t0
    da, db, dc = (gpu.allocate_memory(a.nbytes) for _ in range(3))
    t0 = time.perf_counter()
    gpu.copy_h2d(a, da)
    gpu.copy_h2d(b, db)
    block = 256
    gpu.execute_kernel(kernel, (n + block - 1) // block, block, [da, db, dc, np.int32(n)])
    gpu.synchronize()
    c = np.empty_like(a)
    gpu.copy_d2h(dc, c)
    elapsed = time.perf_counter() - t0
    for buf in (da, db, dc):
        gpu.free_memory(buf)
    return {"job": f"vector add, {n:,} floats", "ok": bool(np.allclose(c, a + b)),
            "compile_s": t_compile, "run_s": elapsed}


def matmul_job(gpu: GpuCompute, m: int = 256, k: int = 192, n: int = 128) -> dict[str, Any]:
    backend = gpu.device_info().backend
    rng = np.random.default_rng(2)
    a = rng.random((m, k), dtype=np.float32)
    b = rng.random((k, n), dtype=np.float32)
    t0 = time.perf_counter()
    kernel = gpu.compile_kernel(samples.source(backend), "matmul")
    t_compile = time.perf_counter() - t0
    da, db, dc = gpu.allocate_memory(a.nbytes), gpu.allocate_memory(b.nbytes), gpu.allocate_memory(m * n * 4)
    t0 = time.perf_counter()
    gpu.copy_h2d(a, da)
    gpu.copy_h2d(b, db)
    block = (16, 16)
    grid = ((n + 15) // 16, (m + 15) // 16)
    gpu.execute_kernel(kernel, grid, block, [da, db, dc, np.int32(m), np.int32(k), np.int32(n)])
    gpu.synchronize()
    c = np.empty((m, n), dtype=np.float32)
    gpu.copy_d2h(dc, c)
    elapsed = time.perf_counter() - t0
    for buf in (da, db, dc):
        gpu.free_memory(buf)
    return {"job": f"matmul {m}x{k} @ {k}x{n}", "ok": bool(np.allclose(c, a @ b, rtol=1e-4, atol=1e-3)),
            "compile_s": t_compile, "run_s": elapsed}


def run_demo(backend: str = "auto") -> int:
    print("gpubroker demo: starting an embedded broker ...", flush=True)
    t0 = time.perf_counter()
    with BrokerProcess([TenantSpec("alice"), TenantSpec("bob")], backend=backend) as broker:
        print(f"  broker up on {broker.target} in {time.perf_counter() - t0:.2f} s", flush=True)
        results: dict[str, list[dict[str, Any]]] = {}
        errors: list[BaseException] = []

        def tenant(name: str, job: Any) -> None:
            try:
                with connect(broker.target, token=broker.tokens[name]) as gpu:
                    info = gpu.device_info()
                    results[name] = [{"job": f"device: {info.name} ({info.backend})"}, job(gpu), job(gpu)]
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=tenant, args=("alice", vector_add_job)),
                   threading.Thread(target=tenant, args=("bob", matmul_job))]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        if errors:
            print(f"demo failed: {errors[0]!r}")
            print(broker.log_tail())
            return 1
        ok = True
        for name, rows in sorted(results.items()):
            print(f"tenant {name}: {rows[0]['job']}")
            for i, row in enumerate(rows[1:]):
                ok &= row["ok"]
                label = "first run" if i == 0 else "second run"
                print(f"  {row['job']:<28} {label:<10} {'OK' if row['ok'] else 'WRONG':<6} "
                      f"compile {row['compile_s'] * 1e3:7.1f} ms  copy+run+copy {row['run_s'] * 1e3:7.1f} ms")
        print("all results match numpy" if ok else "SOME RESULTS ARE WRONG")
        return 0 if ok else 1
