"""The load test's outputs: a per-tenant summary, the table on stdout, the JSON file and the PNG."""

from __future__ import annotations

import itertools
import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from gpubroker.loadtest._runner import RawRun
from gpubroker.loadtest._workloads import WORKLOADS

__all__ = ["build_report", "format_table", "plot_report", "write_json"]


def _ms(values: np.ndarray, q: float) -> float | None:
    return float(np.percentile(values, q) * 1e3) if values.size else None


def _rates(timeline: list[dict[str, Any]], tenants: list[str]) -> None:
    """Per interval and tenant: ops/s and the share of the interval's device time charged to the load's tenants."""
    for prev, cur in itertools.pairwise(timeline):
        dt = max(cur["t"] - prev["t"], 1e-9)
        dev = {t: (cur["tenants"][t]["device_seconds"], prev["tenants"][t]["device_seconds"]) for t in tenants}
        known = all(a is not None and b is not None for a, b in dev.values())
        used = {t: max(0.0, a - b) for t, (a, b) in dev.items()} if known else {}
        whole = sum(used.values())
        for t in tenants:
            row = cur["tenants"][t]
            row["ops_per_s"] = (row["ops"] - prev["tenants"][t]["ops"]) / dt
            row["share"] = used[t] / whole if whole > 0 else None


def build_report(run: RawRun) -> dict[str, Any]:
    """Everything the JSON file holds: config, per-tenant summary, totals and the time series."""
    names = list(run.tenants)
    base, end = run.usage_start, run.usage_end
    device_s = {t: (end[t].device_seconds if t in end else 0.0) - (base or {}).get(t, 0.0)
                for t in names} if end is not None and base is not None else None
    load_device_s = sum(device_s.values()) if device_s else 0.0
    others_s = None
    if end is not None and base is not None:
        others_s = sum(u.device_seconds - base.get(t, 0.0) for t, u in end.items() if t not in run.tenants)
    tenants: dict[str, Any] = {}
    for t, s in run.tenants.items():
        lat = np.asarray(s.latencies, dtype=np.float64)
        use = end.get(t) if end is not None else None
        tenants[t] = {
            "workload": s.workload,
            "ops": s.ops,
            "seconds": round(s.seconds, 4),
            "ops_per_s": s.ops / s.seconds if s.seconds > 0 else 0.0,
            "bytes": s.bytes,
            "gb": s.bytes / 1e9,
            "device_seconds": device_s[t] if device_s else None,
            "share": device_s[t] / load_device_s if device_s and load_device_s > 0 else None,
            "latency_ms": {"p50": _ms(lat, 50), "p99": _ms(lat, 99), "mean": float(lat.mean() * 1e3) if lat.size
                           else None, "max": float(lat.max() * 1e3) if lat.size else None},
            "queue_wait_ms": {"p50": use.wait_p50_ms, "p99": use.wait_p99_ms} if use is not None else None,
            "errors": s.errors,
            "error_messages": s.messages,
        }
    _rates(run.timeline, names)
    config = {k: v for k, v in asdict(run.config).items() if k not in ("tokens_file",)}
    total_ops = sum(r["ops"] for r in tenants.values())
    return {
        "config": config,
        "broker": {"embedded": run.embedded, "target": run.target, "backend": run.backend, "device": run.config.device,
                   "device_name": run.device_name, "fair_scheduling": run.fair_scheduling,
                   "quantum_ms": run.quantum_ms},
        "workloads": {w: WORKLOADS[w] for w in dict.fromkeys(s.workload for s in run.tenants.values())},
        "calibration": run.calibration,
        "started": run.started,
        "elapsed_s": round(run.elapsed, 4),
        "share_of": "the device time the broker charged to this load's tenants on the device, over the run",
        "tenants": tenants,
        "totals": {"ops": total_ops, "ops_per_s": total_ops / run.elapsed if run.elapsed > 0 else 0.0,
                   "gb": sum(r["gb"] for r in tenants.values()), "errors": sum(r["errors"] for r in tenants.values()),
                   "device_seconds": load_device_s if device_s else None, "device_seconds_others": others_s},
        "timeline": run.timeline,
    }


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def format_table(report: dict[str, Any]) -> str:
    head = (f"{'tenant':<12} {'workload':<8} {'ops':>9} {'ops/s':>9} {'GB moved':>9} {'share':>6} "
            f"{'p50 ms':>8} {'p99 ms':>8} {'errors':>6}")
    lines = [head, "-" * len(head)]
    for t, r in report["tenants"].items():
        lines.append(f"{t:<12} {r['workload']:<8} {r['ops']:>9,} {r['ops_per_s']:>9,.1f} {r['gb']:>9.3f} "
                     f"{_num(r['share'], '>6.1%'):>6} {_num(r['latency_ms']['p50'], '>8.2f'):>8} "
                     f"{_num(r['latency_ms']['p99'], '>8.2f'):>8} {r['errors']:>6}")
    tot = report["totals"]
    lines.append("-" * len(head))
    lines.append(f"{'total':<12} {'':<8} {tot['ops']:>9,} {tot['ops_per_s']:>9,.1f} {tot['gb']:>9.3f} "
                 f"{'':>6} {'':>8} {'':>8} {tot['errors']:>6}")
    b = report["broker"]
    lines.append(f"\n{len(report['tenants'])} tenants for {report['elapsed_s']:.1f} s on {b['backend']} "
                 f"({b['device_name']}, device {b['device']}); {'embedded broker' if b['embedded'] else b['target']}")
    for t, r in report["tenants"].items():
        lines.extend(f"  {t}: {m}" for m in r["error_messages"])
    return "\n".join(lines)


def write_json(report: dict[str, Any], path: str) -> str:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(report, indent=2) + "\n")
    return path


def plot_report(report: dict[str, Any], path: str) -> str | None:
    """Two panels over time: ops/s per tenant, and each tenant's share of device time. None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    timeline = report["timeline"][1:]  # the first point is the baseline, with no interval before it
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    rates = [p["tenants"][t].get("ops_per_s", 0.0) for p in timeline for t in report["tenants"]]
    positive = [y for y in rates if y > 0]
    log = bool(positive) and max(positive) / min(positive) > 50  # op rates differ by orders of magnitude
    for t, r in report["tenants"].items():
        label = f"{t} ({r['workload']})"
        xs = [p["t"] for p in timeline]
        ys = [p["tenants"][t].get("ops_per_s", 0.0) for p in timeline]
        # On a log scale a zero is a gap; markers keep sparse points (a few long kernels) visible.
        top.plot(xs, [y if y > 0 or not log else float("nan") for y in ys], ".-", ms=3, label=label)
        shares = [(p["t"], p["tenants"][t].get("share")) for p in timeline]
        bottom.plot([x for x, y in shares if y is not None], [y for _, y in shares if y is not None], ".-", ms=3,
                    label=label)
    if log:
        top.set_yscale("log")
    top.set_ylabel("ops/s")
    top.set_title("throughput per tenant")
    top.legend(fontsize=7, loc="upper right")
    bottom.set_ylabel("share")
    bottom.set_ylim(0, 1)
    bottom.set_xlabel("seconds")
    bottom.set_title("device-time share per tenant (per sample interval)")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
