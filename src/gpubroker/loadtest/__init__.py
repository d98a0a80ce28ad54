"""`gpubroker loadtest`: many tenants with mixed workloads against one broker, with a live progress line,
a per-tenant table, a JSON file and a PNG of throughput and device-time share over time.

Each tenant runs in a process of its own; the parent samples the broker's per-tenant device time through the
Admin ``Usage`` RPC. Loops are bounded in time and count, and targets are local only (a Unix socket or loopback).
"""

from __future__ import annotations

import sys
from typing import Any, TextIO

from gpubroker.loadtest._config import (
    MAX_DURATION_S,
    MAX_TENANTS,
    LoadTestConfig,
    assign_workloads,
    check_target,
    load_tokens,
)
from gpubroker.loadtest._report import build_report, format_table, plot_report, write_json
from gpubroker.loadtest._runner import RawRun, TenantState, run_loadtest
from gpubroker.loadtest._workloads import WORKLOADS, Workload, WorkloadSpec, WrongResult, make_workload

__all__ = [
    "MAX_DURATION_S",
    "MAX_TENANTS",
    "WORKLOADS",
    "LoadTestConfig",
    "RawRun",
    "TenantState",
    "Workload",
    "WorkloadSpec",
    "WrongResult",
    "assign_workloads",
    "build_report",
    "check_target",
    "format_table",
    "load_tokens",
    "loadtest",
    "make_workload",
    "plot_report",
    "run_loadtest",
    "write_json",
]


def loadtest(config: LoadTestConfig, out: TextIO | None = None,
             err: TextIO | None = None) -> tuple[int, dict[str, Any]]:
    """Run, print the table to ``out``, write the JSON and PNG; exit status 1 if any tenant had errors."""
    out = out if out is not None else sys.stdout
    err = err if err is not None else sys.stderr
    report = build_report(run_loadtest(config, err))
    report["png"] = plot_report(report, config.png_path)
    if report["png"] is None:
        print("loadtest: no PNG: matplotlib is not installed (pip install gpubroker[bench])", file=err)
    write_json(report, config.out)
    print(format_table(report), file=out)
    print(f"\nwrote {config.out}" + (f" and {report['png']}" if report["png"] else ""), file=out)
    return (1 if report["totals"]["errors"] else 0), report
