"""`gpubroker bench arrays --quick` on PoCL (against NumPy, there being no native OpenCL array library): both
workloads run natively and through a broker, with medians and spreads, ratios, the sizes and the targets; the
namespace's results agree with NumPy's. And the MLP's hand-written backward pass is checked against finite
differences, so the benchmark trains what it says it trains; and through a broker its training steps only queue
commands, the loss read at the end being the one wait. (Timings are the benchmark's figures, never a test's.)"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import array_api_compat.numpy as xp_numpy
import numpy as np
import pytest
from gpubroker_bench.arrays import MlpPlan, MlpState, Plan, mlp_host_data, mlp_upload, train_mlp

import gpubroker.client.array
from gpubroker.broker import cli
from gpubroker.client import RemoteGpu

STAT = {"median", "min", "max"}


def _loss(xp: Any, host: dict[str, Any]) -> float:
    """The loss at ``host``'s parameters (one step's loss is computed before its update)."""
    return float(train_mlp(xp, mlp_upload(xp, host), 1, 0.0))


def test_mlp_backward_matches_finite_differences() -> None:
    plan = MlpPlan((5, 7, 6, 3), batch=8, steps=1, learning_rate=1.0, dtype="float64")
    host = mlp_host_data(plan, seed=3)
    state: MlpState = mlp_upload(xp_numpy, host)
    train_mlp(xp_numpy, state, 1, plan.learning_rate)  # one step at rate 1: parameter - gradient
    rng = np.random.default_rng(0)
    for group, updated in (("weights", state.weights), ("biases", state.biases)):
        for layer, after in enumerate(updated):
            analytic = host[group][layer] - np.asarray(after)
            for index in zip(*(rng.integers(0, n, 4) for n in after.shape), strict=True):
                h = 1e-6
                up = {k: [a.copy() for a in v] if isinstance(v, list) else v for k, v in host.items()}
                down = {k: [a.copy() for a in v] if isinstance(v, list) else v for k, v in host.items()}
                up[group][layer][index] += h
                down[group][layer][index] -= h
                numeric = (_loss(xp_numpy, up) - _loss(xp_numpy, down)) / (2 * h)
                assert analytic[index] == pytest.approx(numeric, rel=1e-4, abs=1e-7), (group, layer, index)


def test_mlp_training_lowers_the_loss() -> None:
    plan = Plan.make(quick=True).mlp
    host = mlp_host_data(plan)
    first = _loss(xp_numpy, host)
    last = float(train_mlp(xp_numpy, mlp_upload(xp_numpy, host), 30, plan.learning_rate))
    assert last < 0.8 * first


# The RemoteGpu calls that wait for the device or the worker (a round trip) rather than queue a command.
WAITING_CALLS = ("copy_d2h", "synchronize", "synchronize_event", "load_module", "get_kernel", "device_info")


def test_mlp_steps_queue_without_waiting_for_the_device(open_gpu: Callable[..., RemoteGpu],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    # What the benchmark's ratio rests on: once its kernels are compiled, a training step is only queued commands
    # (launches, library calls, allocations, frees); reading the loss is the one wait.
    plan = Plan.make(quick=True).mlp
    host = mlp_host_data(plan)
    gpu = open_gpu("alice", "ring", async_commands=True)
    try:
        xp = gpubroker.client.array.namespace(gpu)
        train_mlp(xp, mlp_upload(xp, host), 2, plan.learning_rate)  # compiles every kernel the steps use
        state = mlp_upload(xp, host)
        waits: Counter[str] = Counter()

        def counting(name: str, call: Callable[..., Any]) -> Callable[..., Any]:
            def counted(*args: Any, **kwargs: Any) -> Any:
                waits[name] += 1
                return call(*args, **kwargs)
            return counted

        for name in WAITING_CALLS:
            monkeypatch.setattr(gpu, name, counting(name, getattr(gpu, name)))
        loss = train_mlp(xp, state, 3, plan.learning_rate)
        assert not waits, f"a training step waited for the device: {dict(waits)}"
        assert np.isfinite(float(loss))
        assert waits == Counter(copy_d2h=1)
    finally:
        monkeypatch.undo()
        gpu.close()


def test_bench_arrays_quick_reports_both_workloads_against_native(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "arrays.json"
    assert cli.main(["bench", "arrays", "--backend", "opencl", "--quick", "--runs", "2", "--out", str(out)]) == 0
    printed = capsys.readouterr()
    result = json.loads(out.read_text())
    assert json.loads(printed.out) == result
    assert (result["bench"], result["backend"], result["quick"], result["runs"]) == ("arrays", "opencl", True, 2)
    assert "NumPy" in result["native"] and "same-host ring" in result["ours"]
    assert result["host"]["device"] and result["host"]["versions"]["scikit-learn"]
    assert len(result["source"].get("commit", "")) == 40 or result["source"].get("version")
    mlp, pca = result["workloads"]["mlp"], result["workloads"]["pca"]
    assert mlp["sizes"] == list(Plan.make(quick=True).mlp.sizes) and mlp["dtype"] == "float32"
    assert (pca["samples"], pca["features"], pca["n_components"]) == (2000, 32, 4)
    for figures in (result["native_figures"], result["ours_figures"]):
        assert set(figures) == {"mlp_s", "mlp_queued_s", "pca_s"}
        for stat in figures.values():
            assert set(stat) == STAT and 0 < stat["min"] <= stat["median"] <= stat["max"]
        assert figures["mlp_queued_s"]["max"] <= figures["mlp_s"]["max"]
    assert set(result["ours_over_native"]) == set(result["targets"]) == {"mlp", "pca"}
    for name, target in result["targets"].items():
        assert target["ratio"] == result["ours_over_native"][name]["median"]
        assert target["met"] == (target["ratio"] <= 1.5)
    # The same code gave the same answers on both sides.
    assert len(result["checks"]) == 2
    for check in result["checks"]:
        losses = check["mlp_final_loss"]
        assert losses["ours"] == pytest.approx(losses["native"], rel=1e-3)
        assert check["pca_solver"]["ours"] == check["pca_solver"]["native"]
        assert check["pca_agreement"]["explained_variance_rel"] < 1e-3
        assert check["pca_agreement"]["components_1_minus_cos"] < 1e-4
    assert "MLP 64-128-128-10" in printed.err and "PCA(4).fit 2000x32" in printed.err
