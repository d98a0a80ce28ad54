"""`gpubroker bench arrays --quick` on PoCL (against NumPy, there being no native OpenCL array library): the four
workloads and the table of operations run natively and through a broker, with medians and spreads, ratios, the
sizes and the targets; the namespace's results agree with NumPy's; ``--only`` refuses what is not a part. And the
MLP's hand-written backward pass, the softmax and the stencil are checked against references, so the benchmark
computes what it says it does; and through a broker the MLP's training steps only queue commands, the loss read
at the end being the one wait. (Timings are the benchmark's figures, never a test's.)"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import array_api_compat.numpy as xp_numpy
import numpy as np
import pytest
from gpubroker_bench.arrays import (
    ELEMENTWISE_OPS,
    OPS,
    MlpPlan,
    MlpState,
    Plan,
    StencilPlan,
    heat_diffusion,
    mlp_host_data,
    mlp_upload,
    softmax_rows,
    stencil_host_data,
    train_mlp,
)

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


def test_softmax_rows_and_heat_diffusion_compute_what_they_say() -> None:
    rng = np.random.default_rng(5)
    x = rng.standard_normal((7, 9))
    lse, a = softmax_rows(xp_numpy, xp_numpy.asarray(x), 2)
    np.testing.assert_allclose(np.asarray(lse)[:, 0], np.log(np.sum(np.exp(x), axis=1)), rtol=1e-12)
    np.testing.assert_array_equal(np.asarray(a), np.argmax(x, axis=1))
    # The stencil against the same step written with explicit loops; the edges stay as they were.
    plan = StencilPlan(6, 3)
    u = stencil_host_data(plan).astype(np.float64)
    expected = u.copy()
    for _ in range(plan.steps):
        before = expected.copy()
        for i in range(1, plan.size - 1):
            for j in range(1, plan.size - 1):
                expected[i, j] = before[i, j] + plan.alpha * (before[i - 1, j] + before[i + 1, j] + before[i, j - 1]
                                                              + before[i, j + 1] - 4 * before[i, j])
    np.testing.assert_allclose(heat_diffusion(xp_numpy, u.copy(), plan.steps, plan.alpha), expected, rtol=1e-12)


def test_bench_arrays_only_refuses_unknown_parts(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", "arrays", "--backend", "opencl", "--quick", "--only", "mlp,nope"])
    assert exc.value.code == 2
    assert "mlp, pca, ops, softmax, stencil" in capsys.readouterr().err


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


def test_bench_arrays_quick_reports_every_part_against_native(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "arrays.json"
    assert cli.main(["bench", "arrays", "--backend", "opencl", "--quick", "--runs", "2", "--out", str(out)]) == 0
    printed = capsys.readouterr()
    result = json.loads(out.read_text())
    assert json.loads(printed.out) == result
    assert (result["bench"], result["backend"], result["quick"], result["runs"]) == ("arrays", "opencl", True, 2)
    assert result["parts"] == ["mlp", "pca", "ops", "softmax", "stencil"]
    assert "NumPy" in result["native"] and "same-host ring" in result["ours"]
    assert result["host"]["device"] and result["host"]["versions"]["scikit-learn"]
    assert len(result["source"].get("commit", "")) == 40 or result["source"].get("version")
    mlp, pca = result["workloads"]["mlp"], result["workloads"]["pca"]
    assert mlp["sizes"] == list(Plan.make(quick=True).mlp.sizes) and mlp["dtype"] == "float32"
    assert (pca["samples"], pca["features"], pca["n_components"]) == (2000, 32, 4)
    ops, softmax, stencil = result["workloads"]["ops"], result["workloads"]["softmax"], result["workloads"]["stencil"]
    assert (ops["rows"], ops["cols"], ops["matmul"], ops["calls"]) == (64, 48, 32, 3)
    assert ops["expressions"] == {name: text for name, (text, _) in OPS.items()} and len(OPS) == 11
    assert (softmax["rows"], softmax["cols"], softmax["iterations"]) == (64, 48, 20)
    assert (stencil["size"], stencil["steps"]) == (32, 50)
    for figures in (result["native_figures"], result["ours_figures"]):
        assert set(figures) == {"mlp_s", "mlp_queued_s", "pca_s", "ops_us", "softmax_s", "softmax_queued_s",
                                "stencil_s", "stencil_queued_s"}
        assert set(figures["ops_us"]) == set(OPS)
        for stat in [*(v for k, v in figures.items() if k != "ops_us"), *figures["ops_us"].values()]:
            assert set(stat) == STAT and 0 < stat["min"] <= stat["median"] <= stat["max"]
        for name in ("mlp", "softmax", "stencil"):
            assert figures[f"{name}_queued_s"]["max"] <= figures[f"{name}_s"]["max"]
    ratios = result["ours_over_native"]
    assert set(ratios) == {"mlp", "pca", "ops", "softmax", "stencil"} and set(ratios["ops"]) == set(OPS)
    assert set(result["targets"]) == {"mlp", "pca", "softmax", "stencil", *(f"ops.{name}" for name in OPS)}
    for name, target in result["targets"].items():
        if name.startswith("ops."):
            op = name.removeprefix("ops.")
            limit = 1.0 if op in ELEMENTWISE_OPS else 1.3
            assert target["ratio"] == ratios["ops"][op]["median"]
        else:
            limit = 1.5
            assert target["ratio"] == ratios[name]["median"]
        assert target["met"] == (target["ratio"] <= limit) and f"<= {limit}x" in target["target"]
    # The same code gave the same answers on both sides.
    assert len(result["checks"]) == 2
    for check in result["checks"]:
        assert check["softmax"]["agree"] and check["softmax"]["lse_sum_rel"] < 1e-3
        assert check["softmax"]["argmax_row0"]["ours"] == check["softmax"]["argmax_row0"]["native"]
        assert check["stencil"]["agree"] and check["stencil"]["sum_rel"] < 1e-3
        losses = check["mlp_final_loss"]
        assert losses["ours"] == pytest.approx(losses["native"], rel=1e-3)
        assert check["pca_solver"]["ours"] == check["pca_solver"]["native"]
        assert check["pca_agreement"]["explained_variance_rel"] < 1e-3
        assert check["pca_agreement"]["components_1_minus_cos"] < 1e-4
    assert "MLP 64-128-128-10" in printed.err and "PCA(4).fit 2000x32" in printed.err
    assert "softmax 64x48, 20 iterations" in printed.err and "stencil 32x32, 50 steps" in printed.err
    assert "argmax_axis1" in printed.err and "x[:-2, 1:-1] + x[2:, 1:-1]" in printed.err
    assert "DISAGREE" not in printed.err
