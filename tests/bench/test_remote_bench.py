"""`gpubroker bench remote --quick` on PoCL: every measure of issue 13's targets is there, as a median of 3 runs
with its spread, beside the native baseline it is compared with; the host and the commit are named. (Timings are
the benchmark's figures, never a test's.)"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from gpubroker_bench.remote_vs_local import summarize

from gpubroker.broker import cli

SIZES = {"1MiB", "4MiB"}  # --quick's copy sizes
LINK = {"launch_sync_p50_us", "launch_sync_async_p50_us", "copies"}


def _stats(tree: Any, path: str = "") -> Iterator[tuple[str, dict[str, float]]]:
    if isinstance(tree, dict) and "median" not in tree:
        for key, value in tree.items():
            yield from _stats(value, f"{path}/{key}")
    else:
        yield path, tree


def test_summarize_gives_each_number_its_median_and_spread() -> None:
    runs = [{"a": 3.0, "b": {"c": 1}}, {"a": 1.0, "b": {"c": 5}}, {"a": 2.0, "b": {"c": 2}}]
    assert summarize(runs) == {"a": {"median": 2.0, "min": 1.0, "max": 3.0},
                               "b": {"c": {"median": 2.0, "min": 1.0, "max": 5.0}}}


def test_bench_remote_quick_reports_every_target_against_native(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "remote.json"
    assert cli.main(["bench", "remote", "--backend", "opencl", "--quick", "--out", str(out)]) == 0
    printed = capsys.readouterr()
    result = json.loads(out.read_text())
    assert json.loads(printed.out) == result  # the same JSON on stdout
    assert (result["bench"], result["backend"], result["quick"], result["runs"]) == ("remote", "opencl", True, 3)
    assert "pyopencl" in result["native"]  # no CUDA here: the JSON says what the baseline was
    assert result["host"]["hostname"] and result["host"]["device"] and result["host"]["driver"]
    assert len(result["source"].get("commit", "")) == 40 or result["source"].get("version")
    assert "standing in for vsock" in result["transports"]["vsock_standin"]

    native, remote, ratios = result["native_figures"], result["remote_figures"], result["remote_over_native"]
    assert set(native) == {"launch_sync_p50_us", "async_launches_per_s", "cpu_us_per_launch",
                           "dependent_small_kernels_s", "large_kernels_s", "copies_pinned", "copies_pageable"}
    assert set(remote) == {"launch_sync_p50_us", "launch_sync_async_p50_us", "grpc_launch_sync_p50_us",
                           "async_launches_per_s", "cpu_us_per_launch", "dependent_small_kernels_s",
                           "large_kernels_s", "copies_host_array", "copies_numpy", "tcp_tls", "vsock_standin"}
    assert set(remote["tcp_tls"]) == set(remote["vsock_standin"]) == LINK
    for copies in (native["copies_pinned"], native["copies_pageable"], remote["copies_host_array"],
                   remote["copies_numpy"], ratios["host_array_vs_pinned"], ratios["numpy_vs_pageable"]):
        assert set(copies) == SIZES
    assert set(ratios) == {"launch_sync_p50", "launch_sync_async_p50", "grpc_launch_sync_p50", "async_launch_rate",
                           "cpu_per_launch", "dependent_small_kernels_time", "large_kernels_time",
                           "host_array_vs_pinned", "numpy_vs_pageable", "tcp_tls_launch_sync_p50",
                           "vsock_standin_launch_sync_p50"}
    leaves = [leaf for tree in (native, remote, ratios) for leaf in _stats(tree)]
    assert len(leaves) > 50
    for path, stat in leaves:
        assert set(stat) == {"median", "min", "max"}, path
        assert all(math.isfinite(v) and v >= 0 for v in stat.values()), (path, stat)
        assert stat["min"] <= stat["median"] <= stat["max"], (path, stat)
    for path, stat in leaves:
        if "cpu" not in path:  # (a launch may cost less CPU than the clock resolves)
            assert stat["min"] > 0, path

    assert result["kernels"]["small"]["iters"] >= 1 and result["kernels"]["large"]["iters"] >= 1
    assert set(result["targets"]) == {"same_host_launch_sync", "async_launches", "dependent_small_kernels",
                                      "large_kernels", "host_array_copies", "numpy_copies", "tcp_tls",
                                      "vsock_standin"}
    for name, target in result["targets"].items():
        assert isinstance(target["met"], bool) and target["target"] and target["values"], name
    for row in ("launch+sync p50", "async launches per s", "dependent small kernels", "host_array H2D 4MiB",
                "numpy D2H 1MiB", "TCP + TLS H2D 1MiB", "vsock stand-in D2H 1MiB", "targets"):
        assert row in printed.err, row
