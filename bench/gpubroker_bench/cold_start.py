"""Cold first session: how long a tenant's first ``connect()`` takes, worker start included, sandboxed or not.

Each run starts one broker per mode with ``--tenants`` tenants that have no worker yet and times each tenant's
first session (OpenSession starts the tenant's worker: the sandbox launcher, the backend's import and its device
context) plus one ``device_info`` call, one tenant after another. The modes: ``sandbox`` (the default broker:
sandboxed workers forked from the zygote, which starts with the broker, so the first tenant may wait for it to
load), ``sandbox_exec`` (``worker_zygote = false``: each launcher and worker a fresh interpreter) and
``no_sandbox``. All run in the same process on the same machine, interleaved run by run, so host-to-host
differences cancel. Prints JSON: per mode the p50 of each run, and their median and spread.

Run: ``gpubroker bench cold-start [--backend cuda] [--runs 3] [--tenants 32] [--out FILE]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

from gpubroker.broker.launcher import BrokerProcess, TenantSpec
from gpubroker.client import connect

__all__ = ["main", "measure_run"]


MODES: dict[str, dict[str, Any]] = {"sandbox": {"sandbox": True},
                                    "sandbox_exec": {"sandbox": True, "worker_zygote": False},
                                    "no_sandbox": {"sandbox": False}}


def measure_run(backend: str, tenants: int, settings: dict[str, Any]) -> list[float]:
    """Seconds to each tenant's first session on a fresh broker (``settings`` in its config), in tenant order."""
    specs = [TenantSpec(f"cold{i}") for i in range(tenants)]
    times = []
    with BrokerProcess(specs, backend=backend, settings=settings) as broker:
        for spec in specs:
            started = time.perf_counter()
            with connect(broker.target, token=broker.tokens[spec.name], device=0) as gpu:
                gpu.device_info()
                times.append(time.perf_counter() - started)
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gpubroker bench cold-start", description=__doc__)
    parser.add_argument("--backend", default="auto", choices=["auto", "cuda", "opencl"])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--tenants", type=int, default=32)
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    result: dict[str, Any] = {"backend": args.backend, "runs": args.runs, "tenants": args.tenants}
    p50s: dict[str, list[float]] = {mode: [] for mode in MODES}
    samples: dict[str, list[list[float]]] = {mode: [] for mode in MODES}
    for _ in range(args.runs):
        for mode, settings in MODES.items():
            times = measure_run(args.backend, args.tenants, settings)
            samples[mode].append([round(t, 4) for t in times])
            p50s[mode].append(statistics.median(times))
    for mode, values in p50s.items():
        result[mode] = {"p50_s_per_run": [round(v, 4) for v in values],
                        "p50_s_median": round(statistics.median(values), 4),
                        "spread_s": round(max(values) - min(values), 4), "samples_s": samples[mode]}
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(f"cold first session p50 (median of {args.runs} runs): sandboxed {result['sandbox']['p50_s_median']:.3f} s, "
          f"sandboxed without the zygote {result['sandbox_exec']['p50_s_median']:.3f} s, "
          f"unsandboxed {result['no_sandbox']['p50_s_median']:.3f} s", file=sys.stderr)
    return 0
