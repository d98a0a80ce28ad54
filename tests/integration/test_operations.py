"""Operating a broker: health and reflection, draining (admin and SIGTERM), failing devices, the admin CLI, and
clients that place sessions across several brokers."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from gpubroker.broker import samples
from gpubroker.broker.config import load_config
from gpubroker.broker.launcher import BrokerProcess, TenantSpec
from gpubroker.client import (
    AdminClient,
    Buffer,
    GpuBrokerError,
    Kernel,
    NotFound,
    RemoteGpu,
    Unavailable,
    connect,
)

from ..conftest import worker_pids
from ..helpers import wait_for

BROKER = "gpubroker.v1.GpuBroker"
DEVICE0 = "gpubroker.v1.GpuBroker/device/0"
TENANTS = [TenantSpec("ops", admin=True), TenantSpec("alice"), TenantSpec("bob")]
SETTINGS = {"drain_grace_seconds": 120.0, "device_failure_threshold": 2, "device_failure_window_seconds": 600.0}


@pytest.fixture
def ops_broker(backend: str) -> Iterator[BrokerProcess]:
    with BrokerProcess(TENANTS, backend=backend, settings=dict(SETTINGS)) as proc:
        yield proc


def _health(target: str, service: str = "") -> str:
    """The health status of ``service``, asked without a token (local credentials on the Unix socket)."""
    with grpc.secure_channel(target, grpc.local_channel_credentials(grpc.LocalConnectionType.UDS)) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def _scaled(gpu: RemoteGpu, n: int = 256) -> tuple[Kernel, Buffer, np.ndarray]:
    """The kernel ``x = 2x + 1`` and a buffer holding 0..n-1; returns (kernel, buffer, its contents)."""
    kernel = gpu.compile_kernel(samples.source(gpu.device_info().backend), "scale_inplace")
    x = np.arange(n, dtype=np.float32)
    buf = gpu.allocate_memory(x.nbytes)
    gpu.copy_h2d(x, buf)
    return kernel, buf, x


def _scale(gpu: RemoteGpu, kernel: Kernel, buf: Buffer, before: np.ndarray, launched: bool = False) -> np.ndarray:
    """Run (unless ``launched`` already) the kernel on ``buf`` and check the result; returns the new contents."""
    if not launched:
        gpu.execute_kernel(kernel, grid=before.size // 256, block=256, args=[buf, np.float32(2), np.int32(before.size)])
    gpu.synchronize()
    out = np.empty_like(before)
    gpu.copy_d2h(buf, out)
    np.testing.assert_array_equal(out, before * 2 + 1)
    return out


def test_health_names_and_reflection_need_no_token(ops_broker: BrokerProcess) -> None:
    for service in ("", BROKER, DEVICE0):
        assert _health(ops_broker.target, service) == "SERVING"
    with pytest.raises(grpc.RpcError) as unknown:
        _health(ops_broker.target, "gpubroker.v1.GpuBroker/device/1")  # PoCL serves one device
    assert unknown.value.code() == grpc.StatusCode.NOT_FOUND
    with grpc.secure_channel(ops_broker.target, grpc.local_channel_credentials(grpc.LocalConnectionType.UDS)) as ch:
        reflected = ProtoReflectionDescriptorDatabase(ch)
        assert set(reflected.get_services()) >= {BROKER, "gpubroker.v1.Admin", "grpc.health.v1.Health",
                                                  "grpc.reflection.v1alpha.ServerReflection"}
        broker_file = reflected.FindFileContainingSymbol(BROKER)
        (service,) = [s for s in broker_file.service if s.name == "GpuBroker"]
        assert {"OpenSession", "LaunchKernel", "CopyHostToDevice"} <= {m.name for m in service.method}


def test_admin_drain_refuses_new_sessions_while_a_running_one_finishes(ops_broker: BrokerProcess) -> None:
    with connect(ops_broker.target, token=ops_broker.tokens["alice"]) as alice, \
            AdminClient(ops_broker.target, ops_broker.tokens["ops"]) as admin:
        kernel, buf, x = _scaled(alice)
        drained = admin.drain()
        assert drained.sessions_running == 1 and [s.session for s in drained.sessions] == [alice.session]
        assert not drained.HasField("seconds_left")  # no grace: running sessions go on until they close
        for service in ("", BROKER, DEVICE0):
            assert _health(ops_broker.target, service) == "NOT_SERVING"
        with pytest.raises(Unavailable, match="draining") as refused:
            connect(ops_broker.target, token=ops_broker.tokens["bob"])
        assert "retry on another broker" in refused.value.message
        assert refused.value.details["retry_after_seconds"] > 0
        _scale(alice, kernel, buf, x)  # the running session still computes, correctly
        status = admin.status()
        assert status.draining and status.health == "NOT_SERVING" and status.devices[0].health == "NOT_SERVING"


def test_sigterm_drains_then_exits_once_the_running_session_is_done(ops_broker: BrokerProcess) -> None:
    assert ops_broker.process is not None
    alice = connect(ops_broker.target, token=ops_broker.tokens["alice"])
    kernel, buf, x = _scaled(alice, 1024)
    spin = alice.compile_kernel(samples.source(alice.device_info().backend), "spin")
    work = alice.allocate_memory(1024 * 4)
    alice.memset(work, 0)
    # Work still queued on the device when SIGTERM arrives: a long kernel, then the one whose result we check.
    alice.execute_kernel(spin, grid=4, block=256, args=[work, np.int64(200_000)])
    alice.execute_kernel(kernel, grid=4, block=256, args=[buf, np.float32(2), np.int32(1024)])
    ops_broker.process.send_signal(signal.SIGTERM)
    wait_for(lambda: _health(ops_broker.target) == "NOT_SERVING", 30, "health to go NOT_SERVING on SIGTERM")
    assert _health(ops_broker.target, DEVICE0) == "NOT_SERVING"
    with pytest.raises(Unavailable, match="draining"):
        connect(ops_broker.target, token=ops_broker.tokens["bob"])
    x = _scale(alice, kernel, buf, x, launched=True)
    _scale(alice, kernel, buf, x)  # and new work of the running session still runs
    assert ops_broker.process.poll() is None  # the drain waits for the open session
    alice.close()
    assert ops_broker.process.wait(timeout=60) == 0  # once it closed: long before the 120 s grace


def test_sigterm_ends_the_sessions_left_when_the_grace_is_over(backend: str) -> None:
    with BrokerProcess(TENANTS, backend=backend, settings={"drain_grace_seconds": 1.0}) as proc:
        assert proc.process is not None
        idle = connect(proc.target, token=proc.tokens["alice"])  # keeps heartbeating, never closes
        idle.allocate_memory(4096)
        proc.process.send_signal(signal.SIGTERM)
        assert proc.process.wait(timeout=60) == 0
        assert "drain grace over: ending 1 sessions still running" in proc.log_tail(200_000)
        with pytest.raises(GpuBrokerError):
            idle.allocate_memory(16)
        idle.close()


def test_device_out_of_service_after_repeated_worker_crashes(ops_broker: BrokerProcess) -> None:
    with connect(ops_broker.target, token=ops_broker.tokens["bob"]) as bob, \
            AdminClient(ops_broker.target, ops_broker.tokens["ops"]) as admin:
        kernel, buf, x = _scaled(bob)
        for crashes in (1, 2):  # device_failure_threshold = 2
            # No link, which would let tenant code run unseen: a death then would be alice's, not the device's.
            with connect(ops_broker.target, token=ops_broker.tokens["alice"], transport="grpc"):
                (pid,) = worker_pids(ops_broker, "alice")
                os.kill(pid, signal.SIGKILL)
                wait_for(lambda n=crashes: admin.status().devices[0].recent_worker_failures == n, 30,
                         f"worker failure {crashes} to be counted")
        wait_for(lambda: _health(ops_broker.target, DEVICE0) == "NOT_SERVING", 30, "device 0 to go NOT_SERVING")
        assert _health(ops_broker.target) == "NOT_SERVING"  # no device serves, so neither does the broker
        with pytest.raises(Unavailable, match="device 0 is not serving") as refused:
            connect(ops_broker.target, token=ops_broker.tokens["alice"])
        assert "2 worker failures" in refused.value.message and "SIGKILL" in refused.value.message
        assert refused.value.details["retry_after_seconds"] > 0
        _scale(bob, kernel, buf, x)  # a session already open goes on
        (device,) = admin.status().devices
        assert device.health == "NOT_SERVING" and "worker failures" in device.reason


def _cli(proc: BrokerProcess, *args: str) -> str:
    env = {**os.environ, "GPUBROKER_TOKEN": proc.tokens["ops"]}
    return subprocess.run([sys.executable, "-m", "gpubroker.broker.cli", *args, "--target", proc.target], env=env,
                          capture_output=True, text=True, check=True, timeout=60).stdout


def _row(output: str, first: str) -> str:
    return next(line for line in output.splitlines() if line.split()[:1] == [first])


def test_cli_status_sessions_end_session_and_drain(ops_broker: BrokerProcess) -> None:
    with connect(ops_broker.target, token=ops_broker.tokens["alice"]) as alice, \
            connect(ops_broker.target, token=ops_broker.tokens["bob"]) as bob:
        alice.allocate_memory(4096)
        status = _cli(ops_broker, "status")
        lines = status.splitlines()
        assert ": SERVING; up " in lines[0]
        assert {"devices", "tenants", "sessions"} <= set(lines) and any(line.startswith("usage (") for line in lines)
        assert "SERVING" in _row(status, "0").split()
        assert _row(status, "alice").split()[4:6] == ["1", "4KiB"]  # tenants: sessions, memory used
        header = next(line for line in status.splitlines() if line.startswith("session "))
        row = _row(status, alice.session)
        assert header.index("tenant") == row.index("alice")  # columns line up under their headings
        assert bob.session in status

        listed = _cli(ops_broker, "sessions", "--tenant", "alice")
        assert alice.session in listed and bob.session not in listed

        assert f"ended session {bob.session} of tenant bob" in _cli(ops_broker, "end-session", bob.session)
        with pytest.raises(NotFound):
            bob.allocate_memory(16)

        drained = _cli(ops_broker, "drain", "--grace", "300")
        assert "draining" in drained and "1 sessions still running" in drained and alice.session in drained
        after = _cli(ops_broker, "status")
        assert "NOT_SERVING, draining" in after.splitlines()[0] and "NOT_SERVING" in _row(after, "0").split()
        assert alice.session in _cli(ops_broker, "admin", "sessions")  # `gpubroker admin ...` still works

        # The drain ends: new sessions are taken again, and the health is SERVING again.
        assert "drain ended: new sessions are taken again" in _cli(ops_broker, "undrain")
        assert ": SERVING; up " in _cli(ops_broker, "status").splitlines()[0]
        with grpc.insecure_channel(ops_broker.target) as channel:
            answer = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
            assert answer.status == health_pb2.HealthCheckResponse.SERVING
        with connect(ops_broker.target, token=ops_broker.tokens["bob"]) as bob_again:
            bob_again.allocate_memory(16)
        assert "the broker was not draining" in _cli(ops_broker, "undrain")


def test_the_cli_takes_its_target_from_the_environment_and_exits_1_on_failure_2_on_a_bad_request(
        ops_broker: BrokerProcess, tmp_path: Path) -> None:
    """GPUBROKER_TARGET as the quickstart exports it, beside GPUBROKER_TOKEN; exit 1 when the broker fails the call
    (nobody listening), 2 when the command cannot be done as asked (a config file that is not there)."""
    def cli(*args: str, target: str) -> subprocess.CompletedProcess[str]:
        env = {**os.environ, "GPUBROKER_TOKEN": ops_broker.tokens["ops"], "GPUBROKER_TARGET": target}
        return subprocess.run([sys.executable, "-m", "gpubroker.broker.cli", *args], env=env, capture_output=True,
                              text=True, timeout=60)

    status = cli("status", target=ops_broker.target)
    assert status.returncode == 0, status.stderr
    assert f" at {ops_broker.target}: " in status.stdout.splitlines()[0]
    # --json: what the broker answered, for scripts; usage and reload at the top level too.
    answered = json.loads(cli("status", "--json", target=ops_broker.target).stdout)
    assert answered["target"] == ops_broker.target and answered["status"]["devices"][0]["device"] == 0
    assert {t["tenant"] for t in answered["status"]["tenants"]} >= {"alice", "bob", "ops"}
    with connect(ops_broker.target, token=ops_broker.tokens["alice"]) as alice:
        sessions = json.loads(cli("sessions", "--json", "--tenant", "alice", target=ops_broker.target).stdout)
        assert [s["session"] for s in sessions["sessions"]] == [alice.session]
    assert "tenants" in json.loads(cli("usage", "--json", "--window", "5", target=ops_broker.target).stdout)
    assert json.loads(cli("reload", "--json", target=ops_broker.target).stdout)["sessions_ended"] == 0
    nobody = cli("sessions", target=f"unix:{tmp_path}/nobody-listens.sock")
    assert nobody.returncode == 1 and nobody.stderr.startswith("gpubroker: error: "), nobody
    typo = cli("serve", "--config", str(tmp_path / "gpubrokr.toml"), target=ops_broker.target)
    assert typo.returncode == 2 and "no config file at" in typo.stderr and "tenant add" in typo.stderr, typo
    assert not (tmp_path / "gpubrokr.toml").exists()


def test_connect_places_the_session_on_the_first_healthy_broker_with_room(backend: str) -> None:
    with BrokerProcess(TENANTS, backend=backend) as drained:
        tenants = load_config(drained.config_path).tenants  # the same tenants and tokens on both brokers
        with BrokerProcess([], backend=backend, settings={"tenants": tenants, "max_sessions_per_tenant": 1}) as full, \
                AdminClient(drained.target, drained.tokens["ops"]) as admin:
            admin.drain()
            missing = f"unix:{drained.workdir}/nobody-listens.sock"
            token = drained.tokens["alice"]
            with connect([missing, drained.target, full.target], token=token) as gpu:
                assert gpu.target == full.target
                kernel, buf, x = _scaled(gpu)
                _scale(gpu, kernel, buf, x)
                # Now every broker refuses: missing, draining, and full (alice's one session is the limit).
                with pytest.raises(Unavailable) as none:
                    connect(f"{missing}, {drained.target}, {full.target}", token=token)
            reasons = none.value.details["endpoints"]
            assert list(reasons) == [missing, drained.target, full.target]
            assert "health check failed: UNAVAILABLE" in reasons[missing]
            assert "NOT_SERVING" in reasons[drained.target]
            assert reasons[full.target].startswith("RESOURCE_EXHAUSTED")
