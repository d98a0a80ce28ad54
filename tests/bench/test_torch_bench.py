"""`gpubroker bench torch --quick` on PoCL (against eager PyTorch on the host CPU, the worker running PyTorch's CPU
kernels): every workload runs natively and through a real broker, with medians and spreads, ratios, the plans and
every target of issue 23 judged; both sides computed the same. The ResNet is ResNet-18's shape, and a workload
the device cannot run is skipped with its reason rather than ending the benchmark. (Timings are the benchmark's
figures, never a test's.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from gpubroker_bench import torch_bench  # noqa: E402
from gpubroker_bench.torch_bench import Plan, ResnetPlan, resnet18  # noqa: E402

from gpubroker.broker import cli  # noqa: E402

STAT = {"median", "min", "max"}
WORKLOADS = {"mlp", "gpt", "resnet", "launch"}


def test_resnet18_has_resnet18s_parameters() -> None:
    # torchvision's resnet18(): 11,689,512 parameters at width 64 with 1,000 classes.
    model = resnet18(ResnetPlan(batch=1, image=64, width=64, classes=1000, batches=1))
    assert sum(p.numel() for p in model.parameters()) == 11_689_512
    assert model.eval()(torch.randn(1, 3, 64, 64)).shape == (1, 1000)


def test_a_workload_the_device_cannot_run_is_skipped_with_its_reason() -> None:
    skipped: dict[str, str] = {}
    with torch_bench._skipping("gpt", skipped, lambda _: None):
        raise NotImplementedError("the torch operator 'aten::frobnicate' is not on the broker's allowlist")
    assert skipped == {"gpt": "NotImplementedError: the torch operator 'aten::frobnicate' is not on the broker's "
                              "allowlist"}
    plan = Plan.make(quick=True)
    empty: dict[str, list[float]] = {name: [] for name in (*WORKLOADS, "client_cpu_us")}
    workloads = torch_bench._workloads(plan, empty, empty, {name: {"native": [], "ours": []} for name in WORKLOADS},
                                       {name: [] for name in WORKLOADS}, skipped)
    assert workloads["gpt"]["skipped"] == skipped["gpt"] and "ours_s" not in workloads["gpt"]
    targets = torch_bench._targets(workloads, 3)
    assert targets["gpt"] == {"target": "<= 1.3x native (median of 3)", "ratio": None, "met": False,
                              "skipped": skipped["gpt"]}


def test_bench_torch_quick_reports_every_workload_against_native(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "torch.json"
    assert cli.main(["bench", "torch", "--backend", "opencl", "--quick", "--runs", "2", "--out", str(out)]) == 0
    printed = capsys.readouterr()
    result = json.loads(out.read_text())
    assert json.loads(printed.out) == result
    assert (result["bench"], result["backend"], result["quick"], result["runs"]) == ("torch", "opencl", True, 2)
    assert "eager PyTorch" in result["native"] and "host CPU" in result["native"]
    assert "same-host ring" in result["ours"]
    assert result["date"] and result["host"]["device"] and result["host"]["versions"]["torch"]
    assert len(result["source"].get("commit", "")) == 40 or result["source"].get("version")
    workloads = result["workloads"]
    assert set(workloads) == WORKLOADS | {"client_cpu"}
    plan = Plan.make(quick=True)
    assert workloads["mlp"]["plan"]["sizes"] == list(plan.mlp.sizes)
    assert workloads["gpt"]["plan"]["layers"] == plan.gpt.layers
    assert workloads["resnet"]["plan"]["image"] == plan.resnet.image
    assert workloads["launch"]["plan"]["ops"] == plan.launch.ops
    for name in WORKLOADS:
        entry = workloads[name]
        assert "skipped" not in entry, entry.get("skipped")  # the device runs every workload on PoCL
        for stat in (entry["native_s"], entry["ours_s"], entry["queued_s"]["native"], entry["queued_s"]["ours"],
                     entry["ours_over_native"]):
            assert set(stat) == STAT and 0 < stat["min"] <= stat["median"] <= stat["max"]
        assert len(entry["checks"]) == 2
    cpu = workloads["client_cpu"]
    for stat in (cpu["ours_us_per_op"], cpu["native_us_per_op"]):
        assert set(stat) == STAT and 0 < stat["min"] <= stat["median"] <= stat["max"]
    # Every target is judged on its median.
    assert set(result["targets"]) == WORKLOADS | {"client_cpu"}
    for name, limit in torch_bench.TARGETS.items():
        target = result["targets"][name]
        assert target["ratio"] == workloads[name]["ours_over_native"]["median"]
        assert target["met"] == (target["ratio"] <= limit)
    assert result["targets"]["client_cpu"]["us"] == cpu["ours_us_per_op"]["median"]
    assert result["targets"]["client_cpu"]["met"] == (cpu["ours_us_per_op"]["median"] <= 15)
    # The same code computed the same on both sides (the worker runs PyTorch's CPU kernels here).
    for name in ("mlp", "gpt", "launch"):
        for check in workloads[name]["checks"]:
            assert check["ours"] == pytest.approx(check["native"], rel=1e-4), name
    assert all(check["logits_max_abs_diff_rel"] < 1e-4 for check in workloads["resnet"]["checks"])
    assert workloads["launch"]["checks"][0]["native"] == plan.launch.ops
    assert "MLP 64-128-128-10" in printed.err and "ResNet-18" in printed.err and "client_cpu" in printed.err
