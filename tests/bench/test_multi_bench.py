"""`gpubroker bench multi` on two PoCL devices: every part runs and reports correct results."""

from __future__ import annotations

import json
from pathlib import Path

from gpubroker.broker import cli


def test_bench_multi_reports_placement_results_copies_and_fairness_per_device(tmp_path: Path) -> None:
    out = tmp_path / "multi.json"
    assert cli.main(["bench", "multi", "--backend", "opencl", "--copy-size", "3MiB", "--repeats", "2",
                     "--seconds", "2", "--tenants", "2", "--elements", "65536", "--launches", "10",
                     "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [d["id"] for d in result["devices"]] == [0, 1]
    assert result["placement"] == [0, 1, 0, 1]
    assert [(r["device"], r["correct"]) for r in result["sessions_at_once"]] == [(0, True), (1, True)]
    for way in ("0->1", "1->0"):
        copy = result["peer_copy"][way]
        assert copy["correct"] and copy["path"] == "host" and copy["gb_per_s_best"] > 0
    assert "peer_copy_host_path" not in result  # PoCL has no peer path to compare it with
    assert result["fairness"]["kernels_per_s"] > 0
    fairness = result["fairness"]["devices"]
    # (How much each got is the benchmark's figure, not a test's: a busy CI host may charge little in 2 s.)
    assert {d: set(row["shares"]) for d, row in fairness.items()} == {"0": {"d0t0", "d0t1"}, "1": {"d1t0", "d1t1"}}
    assert all("light_wait_ms" in row and "jain_index" in row for row in fairness.values())
