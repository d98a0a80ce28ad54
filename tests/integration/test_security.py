"""Admin authorization, tenant reload and removal, limits, the audit log, and the socket's mode."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from gpubroker.broker import samples
from gpubroker.broker.launcher import BrokerProcess, TenantSpec
from gpubroker.client import (
    Aborted,
    AdminClient,
    DeadlineExceeded,
    ModuleFormat,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
    connect,
)
from gpubroker.v1 import broker_pb2 as pb

from ..conftest import worker_pids
from ..helpers import wait_for

LIMITS = {"lease_seconds": 30.0, "max_sessions_per_tenant": 3, "max_handles_per_session": 8,
          "max_concurrent_rpcs_per_session": 2, "max_module_bytes": 64 * 1024,
          # A cold build of the sample module takes 0.7-1.9 s on a loaded 2-core host (PoCL); the slow kernel below,
          # far longer.
          "compile_timeout_seconds": 4.0}


@pytest.fixture
def guarded(backend: str) -> Iterator[BrokerProcess]:
    tenants = [TenantSpec("ops", admin=True), TenantSpec("alice"), TenantSpec("bob")]
    with BrokerProcess(tenants, backend=backend, settings=dict(LIMITS)) as proc:
        yield proc


def _cli(*args: str) -> str:
    return subprocess.run([sys.executable, "-m", "gpubroker.broker.cli", *args], capture_output=True, text=True,
                          check=True).stdout


def test_socket_is_created_with_mode_0660(broker: BrokerProcess) -> None:
    path = Path(broker.target.removeprefix("unix:"))
    assert stat.S_ISSOCK(path.stat().st_mode)
    assert stat.S_IMODE(path.stat().st_mode) == 0o660


def test_admin_calls_need_an_admin(guarded: BrokerProcess) -> None:
    with AdminClient(guarded.target, guarded.tokens["alice"]) as not_admin, pytest.raises(PermissionDenied):
        not_admin.list_sessions()
    with AdminClient(guarded.target, "gpb_nope_nope") as stranger, pytest.raises(Unauthenticated):
        stranger.list_sessions()
    with AdminClient(guarded.target, guarded.tokens["ops"]) as admin, \
            connect(guarded.target, token=guarded.tokens["alice"]) as alice:
        alice.allocate_memory(4096)
        (summary,) = admin.list_sessions("alice")
        assert summary.session == alice.session and summary.memory_used == 4096
        resp = admin.end_session(alice.session)
        assert resp.tenant == "alice" and resp.memory_freed == 4096
        with pytest.raises(NotFound):
            alice.allocate_memory(16)
        with pytest.raises(NotFound):
            admin.end_session(alice.session)
    log = guarded.log_tail(200_000)
    assert "gpubroker.audit" in log and "action=end-session" in log and "admin=ops" in log
    assert "denied: tenant=alice action=ListSessions" in log
    assert "auth failure" in log and "method=ListSessions" in log


def test_drain_refuses_new_sessions_while_running_ones_go_on(guarded: BrokerProcess) -> None:
    with connect(guarded.target, token=guarded.tokens["bob"]) as bob:
        buf = bob.allocate_memory(64)
        with AdminClient(guarded.target, guarded.tokens["ops"]) as admin:
            assert admin.drain().sessions_running == 1
        with pytest.raises(Unavailable, match="draining"):
            connect(guarded.target, token=guarded.tokens["alice"])
        bob.copy_h2d(b"z" * 64, buf)
        out = bytearray(64)
        bob.copy_d2h(buf, out)
        assert out == b"z" * 64


def test_removed_tenant_is_ended_and_its_memory_freed(guarded: BrokerProcess) -> None:
    alice = connect(guarded.target, token=guarded.tokens["alice"])
    alice.allocate_memory(1 << 20)
    (pid,) = worker_pids(guarded, "alice")
    _cli("tenant", "remove", "alice", "--config", str(guarded.config_path))
    with AdminClient(guarded.target, guarded.tokens["ops"]) as admin:
        result = admin.reload()
        assert list(result.removed) == ["alice"] and result.sessions_ended == 1
        assert admin.list_sessions("alice") == []
    with pytest.raises((NotFound, Unauthenticated)):
        alice.allocate_memory(16)
    with pytest.raises(Unauthenticated):
        connect(guarded.target, token=guarded.tokens["alice"])
    assert pid not in worker_pids(guarded, "alice")  # its worker (and device context) is gone
    alice.close()


def test_rotated_token_and_added_tenant_take_effect_on_sighup(guarded: BrokerProcess) -> None:
    out = _cli("tenant", "rotate-token", "bob", "--config", str(guarded.config_path))
    new_token = out.strip().splitlines()[-1]
    out = _cli("tenant", "add", "dave", "--config", str(guarded.config_path), "--memory", "1GiB")
    dave_token = out.strip().splitlines()[-1]
    assert guarded.process is not None
    os.kill(guarded.process.pid, signal.SIGHUP)
    wait_for(lambda: "action=reload added=['dave']" in guarded.log_tail(200_000), 20, "the SIGHUP reload")
    with pytest.raises(Unauthenticated):
        connect(guarded.target, token=guarded.tokens["bob"])
    with connect(guarded.target, token=new_token) as bob, connect(guarded.target, token=dave_token) as dave:
        assert bob.device_info().memory_quota == 2 * 1024**3
        assert dave.device_info().memory_quota == 1024**3


def test_tenant_edits_reload_the_running_broker_when_asked(guarded: BrokerProcess) -> None:
    """`tenant add | rotate-token | remove --reload` reload the broker through its Admin service with an admin's token
    (GPUBROKER_TOKEN); without one (the first admin) the edit stands, the token is still shown, the exit is 1 and
    the message says how the first admin comes (a signal)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUBROKER_")}

    def cli(*args: str, token: str | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "gpubroker.broker.cli", *args, "--config",
                               str(guarded.config_path), "--reload", "--target", guarded.target],
                              env=env if token is None else {**env, "GPUBROKER_TOKEN": token},
                              capture_output=True, text=True, timeout=120)

    first = cli("tenant", "add", "erin")
    assert first.returncode == 1, first.stderr
    assert "Not reloaded: --reload needs an admin tenant's token" in first.stdout and "SIGHUP" in first.stdout
    erin = first.stdout.strip().splitlines()[-1]
    with pytest.raises(Unauthenticated):  # added to the file, not yet served
        connect(guarded.target, token=erin)
    second = cli("tenant", "add", "frank", token=guarded.tokens["ops"])
    assert second.returncode == 0, second.stdout + second.stderr
    assert "reloaded (added ['erin', 'frank']" in second.stdout and "it serves it now" in second.stdout
    frank = second.stdout.strip().splitlines()[-1]
    with connect(guarded.target, token=erin) as a, connect(guarded.target, token=frank) as b:
        assert a.allocate_memory(16) and b.allocate_memory(16)
    removed = cli("tenant", "remove", "frank", token=guarded.tokens["ops"])
    assert removed.returncode == 0 and "removed ['frank']" in removed.stdout, removed.stdout + removed.stderr
    with pytest.raises(Unauthenticated):
        connect(guarded.target, token=frank)
    elsewhere = subprocess.run([sys.executable, "-m", "gpubroker.broker.cli", "tenant", "add", "gus", "--config",
                                str(guarded.config_path.with_name("other.toml")), "--reload", "--target",
                                guarded.target], env={**env, "GPUBROKER_TOKEN": guarded.tokens["ops"]},
                               capture_output=True, text=True, timeout=120)
    assert elsewhere.returncode == 1 and "did not see this change: it reads another config file" in elsewhere.stdout
    refused = cli("tenant", "rotate-token", "erin", token=guarded.tokens["alice"])  # not an admin: the edit stands
    assert refused.returncode == 1 and "Not reloaded (PermissionDenied)" in refused.stdout
    with connect(guarded.target, token=erin) as a:  # the old token until a reload
        assert a.allocate_memory(16)


def test_broken_config_on_sighup_keeps_the_old_tenants(guarded: BrokerProcess) -> None:
    guarded.config_path.write_text("[broker\n")
    assert guarded.process is not None
    os.kill(guarded.process.pid, signal.SIGHUP)
    wait_for(lambda: "reload on SIGHUP failed" in guarded.log_tail(200_000), 60, "the failed reload")
    with connect(guarded.target, token=guarded.tokens["alice"]) as alice:
        alice.allocate_memory(8)


def test_session_and_handle_limits(guarded: BrokerProcess) -> None:
    token = guarded.tokens["alice"]
    sessions = [connect(guarded.target, token=token) for _ in range(3)]
    with pytest.raises(ResourceExhausted, match="sessions"):
        connect(guarded.target, token=token)
    sessions.pop().close()
    sessions.append(connect(guarded.target, token=token))  # room again once one closed
    gpu = sessions[0]
    bufs = [gpu.allocate_memory(8) for _ in range(8)]
    with pytest.raises(ResourceExhausted, match="handles"):
        gpu.allocate_memory(8)
    with pytest.raises(ResourceExhausted, match="handles"):
        gpu.create_stream()
    gpu.free_memory(bufs.pop())
    gpu.allocate_memory(8)
    assert gpu.device_info().memory_used == 8 * 8
    for s in sessions:
        s.close()


def test_concurrent_rpcs_per_session(guarded: BrokerProcess) -> None:
    # Typed calls through the front (a link carries one batch at a time; test_fast_path bounds links per session).
    with connect(guarded.target, token=guarded.tokens["bob"], transport="grpc") as bob:
        size = 32 << 20
        buf = bob.allocate_memory(size)
        # The session's Commands stream (its allocate above) holds one of its two calls, like every call. Hold the
        # other open: a device-to-host stream we read one chunk of, then leave (flow control stalls it).
        stream = bob._stub.CopyDeviceToHost(pb.CopyDeviceToHostRequest(session=bob.session, buffer=pb.BufferRef(
            handle=buf.handle), size=size), metadata=bob._metadata)
        next(stream)
        with pytest.raises(ResourceExhausted, match="in flight"):
            bob.device_info()
        stream.cancel()
        wait_for(lambda: _answers(bob), 10, "the slot to be released")


def _answers(gpu) -> bool:
    try:
        gpu.device_info()
        return True
    except ResourceExhausted:
        return False


def test_module_size_and_compile_timeout(guarded: BrokerProcess, backend: str) -> None:
    fmt = ModuleFormat.CUDA_C if backend == "cuda" else ModuleFormat.OPENCL_C
    with connect(guarded.target, token=guarded.tokens["bob"]) as bob:
        with pytest.raises(ResourceExhausted, match="exceeds the limit"):
            bob.load_module("//" + "x" * (64 * 1024), fmt)
        bob.compile_kernel(samples.source(backend), "empty_kernel")  # still serving
        # 300,000 unrolled statements (PoCL builds them in ~12 s on an idle 2-core host; a third of that took 4.5 s,
        # too close to the 4 s limit); a unique constant defeats the runtime's compile cache.
        slow = ("#define A(x) x x x x x x x x x x\n#define B(x) A(A(x))\n#define C(x) B(B(x))\n#define D(x) x x x\n"
                f"#define SALT {uuid.uuid4().int % 1000003}.0f\n")
        body = "{ float v = p[0]; C(A(D(v = v * SALT + 0.5f;))) p[0] = v; }"
        if backend == "cuda":
            slow += 'extern "C" __global__ void slow(float* p) ' + body
        else:
            slow += "__kernel void slow(__global float* p) " + body
        t0 = time.monotonic()
        with pytest.raises(DeadlineExceeded, match="longer than"):
            bob.compile_kernel(slow, "slow")
        assert time.monotonic() - t0 < 15
    with connect(guarded.target, token=guarded.tokens["bob"]) as bob2:  # a fresh worker serves the next session
        bob2.compile_kernel(samples.source(backend), "empty_kernel")


def test_fault_spares_another_tenants_work_in_flight(guarded: BrokerProcess, backend: str) -> None:
    """alice's kernel writes far out of bounds while bob copies 64 MiB and runs kernels: bob's results hold."""
    src = samples.source(backend)
    with connect(guarded.target, token=guarded.tokens["bob"]) as bob, \
            connect(guarded.target, token=guarded.tokens["alice"]) as alice:
        bad = alice.compile_kernel(src, "write_far")
        small = alice.allocate_memory(16)
        scale = bob.compile_kernel(src, "scale_inplace")
        data = np.random.default_rng(9).random(16 << 20, dtype=np.float32)
        big = bob.allocate_memory(data.nbytes)
        bob_errors: list[BaseException] = []
        started = threading.Event()

        def bob_work() -> None:
            try:
                started.set()
                bob.copy_h2d(data, big)
                args = [big, np.float32(1.0), np.int32(data.size)]
                for _ in range(3):
                    bob.execute_kernel(scale, (data.size + 255) // 256, 256, args)
                bob.synchronize()
                out = np.empty_like(data)
                bob.copy_d2h(big, out)
                np.testing.assert_allclose(out, data + 3.0, rtol=1e-6)
            except BaseException as exc:
                bob_errors.append(exc)

        worker = threading.Thread(target=bob_work)
        worker.start()
        started.wait()
        with pytest.raises(Aborted):
            alice.execute_kernel(bad, 1, 1, [small, np.int64(1 << 40)])
            alice.synchronize()
        worker.join()
        assert not bob_errors, bob_errors
