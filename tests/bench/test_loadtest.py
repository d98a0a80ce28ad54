"""`gpubroker loadtest`: mix assignment, local targets (remote ones over TLS), verified workloads, and real runs on
PoCL."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from gpubroker.broker import cli
from gpubroker.broker.backends import open_backend
from gpubroker.broker.config import TlsConfig
from gpubroker.broker.launcher import BrokerProcess, TenantSpec
from gpubroker.client import InvalidArgument, TlsOptions
from gpubroker.loadtest import (
    LoadTestConfig,
    WorkloadSpec,
    WrongResult,
    assign_workloads,
    check_target,
    loadtest,
    make_workload,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_mix_is_round_robin_or_weighted() -> None:
    assert assign_workloads("copies,long", 5) == ["copies", "long", "copies", "long", "copies"]
    weighted = assign_workloads("sync=3,long=1", 8)
    assert Counter(weighted) == {"sync": 6, "long": 2}
    assert weighted[:4].count("long") == 1  # interleaved, not bunched at the end
    assert assign_workloads("copies=0,short", 2) == ["short", "short"]
    for bad in ("copies,bogus", "copies,copies", "short=x", "short=-1", "copies=0", ""):
        with pytest.raises(InvalidArgument):
            assign_workloads(bad, 3)


def test_local_targets_are_accepted_and_remote_ones_only_over_tls() -> None:
    for ok in ("unix:/run/gpubroker.sock", "127.0.0.1:7070", "127.8.9.10:1", "[::1]:7070", "localhost:7070"):
        assert check_target(ok) == ok
    remote = ("10.0.0.5:7070", "example.org:7070", "[2001:db8::1]:7070")
    for bad in (*remote, "0.0.0.0:7070", "unix:", "127.0.0.1", "127.0.0.1:0", "dns:///localhost:7070",
                "vsock:2:7070"):
        with pytest.raises(InvalidArgument, match=r"Unix socket .* or a loopback address.*with --tls-ca"):
            check_target(bad)
    for ok in remote:
        assert check_target(ok, remote=True) == ok
    for bad in ("0.0.0.0:7070", "example.org:0"):
        with pytest.raises(InvalidArgument):
            check_target(bad, remote=True)
    with pytest.raises(InvalidArgument, match="--tls-ca"):
        LoadTestConfig(target="gpu-host.example:7070", tokens_file="t.json").check()
    LoadTestConfig(target="gpu-host.example:7070", tokens_file="t.json", tls_ca="ca.pem").check()
    with pytest.raises(InvalidArgument, match="host:port --target"):
        LoadTestConfig(target="unix:/run/gpubroker.sock", tokens_file="t.json", tls_ca="ca.pem").check()
    with pytest.raises(InvalidArgument, match="go together"):
        LoadTestConfig(target="gpu-host.example:7070", tokens_file="t.json", tls_ca="ca.pem", tls_cert="c.pem").check()


def test_workloads_check_what_the_device_computed() -> None:
    gpu = open_backend("opencl")
    try:
        for name in ("copies", "short", "sync", "async"):
            workload = make_workload(WorkloadSpec(name, copy_bytes=1 << 16))
            workload.setup(gpu)
            moved = sum(workload.step(gpu) for _ in range(64))
            assert moved > 0, name  # every workload reads results back within 64 steps
        # A counting kernel whose buffer changed behind its back is caught at its next check.
        counting = make_workload(WorkloadSpec("sync"))
        counting.setup(gpu)
        counting.step(gpu)
        gpu.copy_h2d(np.full(256, 7.0, dtype=np.float32), counting.y)  # type: ignore[attr-defined]
        with pytest.raises(WrongResult, match="elements wrong"):
            for _ in range(64):
                counting.step(gpu)
        counting.step(gpu)  # recovered: counting starts again from a zeroed buffer
        # The long kernel's result must match the calibrated one exactly.
        long_ = make_workload(WorkloadSpec("long", long_iters=1000, long_expected=12345.0))
        long_.setup(gpu)
        with pytest.raises(WrongResult, match=r"expected 12345\.0"):
            long_.step(gpu)
    finally:
        gpu.close()


def test_loadtest_command_runs_mixed_tenants_on_pocl(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "lt.json"
    code = cli.main(["loadtest", "--tenants", "3", "--duration", "3", "--mix", "copies,long,async",
                     "--backend", "opencl", "--copy-size", "1MiB", "--long-ms", "2", "--out", str(out)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    report = json.loads(out.read_text())
    assert Path(report["png"]) == out.with_suffix(".png")
    assert out.with_suffix(".png").read_bytes()[:8] == PNG_MAGIC
    tenants = report["tenants"]
    assert [r["workload"] for r in tenants.values()] == ["copies", "long", "async"]
    for name, row in tenants.items():
        assert row["ops"] > 0 and row["errors"] == 0, (name, row)
        assert row["latency_ms"]["p50"] <= row["latency_ms"]["p99"]
        assert 0.0 <= row["share"] <= 1.0, (name, row)
        assert name in printed
    assert sum(r["share"] for r in tenants.values()) == pytest.approx(1.0)
    assert tenants["t01"]["bytes"] >= tenants["t01"]["ops"] * 2 * (1 << 20)  # copies: H2D + D2H of 1 MiB each
    timeline = report["timeline"]
    assert len(timeline) >= 3
    assert [p["t"] for p in timeline] == sorted(p["t"] for p in timeline)
    assert timeline[-1]["tenants"]["t02"]["ops"] == tenants["t02"]["ops"]
    assert any(p["tenants"]["t03"].get("share") is not None for p in timeline)


def test_loadtest_against_a_running_broker_counts_a_tenant_that_fails(
        tmp_path: Path, server_tls: tuple[TlsConfig, TlsOptions]) -> None:
    """Against a running broker over TCP with TLS, as a remote one is reached (its CA given): the tenants' processes,
    the calibration and the admin's usage all take the TLS options."""
    specs = [TenantSpec("ops", admin=True), TenantSpec("good"), TenantSpec("stale")]
    with BrokerProcess(specs, backend="opencl", tcp=["127.0.0.1:0"], settings={"tls": server_tls[0]}) as broker:
        tokens = tmp_path / "tokens.json"
        tokens.write_text(json.dumps({"ops": broker.tokens["ops"], "good": broker.tokens["good"],
                                      "stale": broker.tokens["good"][:-4] + "AAAA"}))
        config = LoadTestConfig(tenants=2, duration=1.5, mix="sync", target=broker.tcp_target,
                                tokens_file=str(tokens), admin_tenant="ops", out=str(tmp_path / "run.json"),
                                tls_ca=str(server_tls[1].ca_file))
        code, report = loadtest(config)
    assert code == 1  # any tenant's error fails the run
    assert report["broker"]["embedded"] is False and report["broker"]["target"] == broker.tcp_target
    good, stale = report["tenants"]["good"], report["tenants"]["stale"]
    assert good["ops"] > 0 and good["errors"] == 0
    assert good["share"] == pytest.approx(1.0)  # the only tenant that ran
    assert stale["ops"] == 0 and stale["errors"] == 1
    assert "Unauthenticated" in stale["error_messages"][0]
    assert json.loads((tmp_path / "run.json").read_text())["totals"]["errors"] == 1
