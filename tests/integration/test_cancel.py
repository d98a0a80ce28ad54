"""Abandoned work and per-call time limits (issue 24): a wait past its own ``timeout`` raises DeadlineExceeded and
leaves the session usable, over every transport; ``cancel()``, and leaving a ``with`` block by an exception (Ctrl-C's
KeyboardInterrupt), do not wait for the work, and the tenant's next session does not wait behind it; a session that
ended says why to its client's next call."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from gpubroker.broker import samples
from gpubroker.broker.launcher import BrokerProcess, TenantSpec
from gpubroker.client import DeadlineExceeded, GpuBrokerError, RemoteGpu, connect
from gpubroker.client._channel import make_channel
from gpubroker.v1 import broker_pb2 as pb
from gpubroker.v1 import broker_pb2_grpc as pb_grpc

from ..conftest import TRANSPORTS, OpenGpu
from ..helpers import spin_iterations, wait_for

CLIENT = str(Path(__file__).with_name("killable_client.py"))

ENDLESS = 1 << 50  # iterations of the sample spin kernel: days, on any device


def _spin(gpu: RemoteGpu, backend: str) -> tuple[object, object]:
    return gpu.compile_kernel(samples.source(backend), "spin"), gpu.allocate_memory(4096)


def _works(gpu: RemoteGpu, kernel: object, buf: object) -> None:
    """A small kernel, waited for, and a round trip of data: the session (and its worker) serves."""
    gpu.execute_kernel(kernel, 1, 1, [buf, np.int64(1)])  # type: ignore[arg-type]
    gpu.synchronize(timeout=60)
    mem = gpu.allocate_memory(64)
    gpu.memset(mem, 7)
    out = bytearray(64)
    gpu.copy_d2h(mem, out)
    assert out == b"\x07" * 64


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_wait_past_its_own_timeout_leaves_the_session_usable(open_gpu: OpenGpu, backend: str,
                                                               transport: str) -> None:
    with open_gpu("alice", transport) as gpu:
        kernel, buf = _spin(gpu, backend)
        iters = spin_iterations(gpu, kernel, buf, seconds=1.5)
        gpu.execute_kernel(kernel, 1, 1, [buf, np.int64(iters)])  # type: ignore[arg-type]
        start = time.monotonic()
        with pytest.raises(DeadlineExceeded, match="still running and the session goes on"):
            gpu.synchronize(timeout=0.1)
        assert time.monotonic() - start < 1.0  # its own bound, not the session's 300 s
        gpu.synchronize(timeout=60)  # the same session waits again, and the work finishes
        _works(gpu, kernel, buf)


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf"), "1", True])
def test_a_bad_timeout_is_refused_before_anything_is_sent(open_gpu: OpenGpu, bad: object) -> None:
    with open_gpu("alice", "ring") as gpu, pytest.raises(Exception, match="timeout must be a positive number"):
        gpu.synchronize(timeout=bad)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def cancel_broker(backend: str) -> Iterator[BrokerProcess]:
    # (a short lease: the expiry test waits for one; a limit for the lone tenant far beyond the tests' kernels)
    settings = {"lease_seconds": 2.0, "lone_kernel_seconds": 3600.0}
    with BrokerProcess([TenantSpec("alice"), TenantSpec("bob")], backend=backend, settings=settings) as proc:
        yield proc


def test_cancel_abandons_a_running_kernel_and_the_next_session_does_not_wait_behind_it(
        cancel_broker: BrokerProcess, backend: str) -> None:
    gpu = connect(cancel_broker.target, token=cancel_broker.tokens["alice"])
    kernel, buf = _spin(gpu, backend)
    gpu.execute_kernel(kernel, 1, 1, [buf, np.int64(ENDLESS)])  # type: ignore[arg-type]
    with pytest.raises(DeadlineExceeded):
        gpu.synchronize(timeout=0.2)  # it runs
    start = time.monotonic()
    gpu.cancel()
    assert time.monotonic() - start < 10.0  # the grace (1 s) and the worker's stop, not the kernel's days
    gpu.cancel()  # (twice, or after a close: nothing)
    with connect(cancel_broker.target, token=cancel_broker.tokens["alice"]) as again:
        kernel, buf = _spin(again, backend)
        _works(again, kernel, buf)  # a fresh worker: nothing to wait behind


def test_leaving_a_with_block_by_ctrl_c_abandons_the_work(cancel_broker: BrokerProcess, backend: str) -> None:
    start = 0.0
    with pytest.raises(KeyboardInterrupt), connect(cancel_broker.target, token=cancel_broker.tokens["bob"]) as gpu:
        kernel, buf = _spin(gpu, backend)
        gpu.execute_kernel(kernel, 1, 1, [buf, np.int64(ENDLESS)])  # type: ignore[arg-type]
        start = time.monotonic()
        raise KeyboardInterrupt  # as Ctrl-C in a synchronize() that waits for it
    assert time.monotonic() - start < 10.0  # (before: the close waited for the kernel)
    with connect(cancel_broker.target, token=cancel_broker.tokens["bob"]) as again:
        kernel, buf = _spin(again, backend)
        _works(again, kernel, buf)


def test_ctrl_c_in_a_scripts_wait_abandons_the_work_and_spares_the_other_tenants(cancel_broker: BrokerProcess,
                                                                                   backend: str) -> None:
    """A script (no `with` block) waits in synchronize() for a kernel that would run for days; Ctrl-C (a real
    SIGINT) abandons the work before the KeyboardInterrupt ends the script, so the tenant's next session is served
    at once, and another tenant's session, open all along, goes on as before."""
    with connect(cancel_broker.target, token=cancel_broker.tokens["bob"]) as bob:
        bob_kernel, bob_buf = _spin(bob, backend)
        _works(bob, bob_kernel, bob_buf)
        child = subprocess.Popen([sys.executable, CLIENT, cancel_broker.target, cancel_broker.tokens["alice"], "spin"],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            assert child.stdout is not None
            assert child.stdout.readline().startswith(b"waiting ")
            # Ctrl-C once its main thread waits in the synchronize (blocked in poll: the ring's wait for the ack),
            # not before it got there.
            wait_for(lambda: "poll" in Path(f"/proc/{child.pid}/wchan").read_text(), 30,
                     "the script to wait in synchronize()")
            child.send_signal(signal.SIGINT)
            _, err = child.communicate(timeout=30)
        finally:
            child.kill()
        assert b"KeyboardInterrupt" in err, err.decode(errors="replace")[-2000:]
        start = time.monotonic()
        with connect(cancel_broker.target, token=cancel_broker.tokens["alice"]) as again:
            mem = again.allocate_memory(64)
            again.memset(mem, 1)
            out = bytearray(64)
            again.copy_d2h(mem, out)  # served: a fresh worker, nothing to wait behind
            took = time.monotonic() - start
            assert out == b"\x01" * 64 and took < 2.0, f"the next session was served after {took:.2f} s"
            kernel, buf = _spin(again, backend)
            _works(again, kernel, buf)
        _works(bob, bob_kernel, bob_buf)  # the other tenant's session and worker were never touched


def test_a_script_killed_in_its_wait_leaves_nothing_running(cancel_broker: BrokerProcess, backend: str) -> None:
    """A script killed while it waits for an endless kernel (SIGKILL: no cancel) and run again at once: the
    rerun's open waits for the worker, blocked in the dead client's wait; when that client's lease expires, its
    work is stopped with the worker (a session still opening is not one to spare), the rerun is told which session
    expired, and its next session is served."""
    token = cancel_broker.tokens["alice"]
    child = subprocess.Popen([sys.executable, CLIENT, cancel_broker.target, token, "spin"], stdout=subprocess.PIPE)
    try:
        assert child.stdout is not None
        waiting, killed = child.stdout.readline().decode().split()
        assert waiting == "waiting"
        wait_for(lambda: "poll" in Path(f"/proc/{child.pid}/wchan").read_text(), 30, "the kernel to run")
    finally:
        child.kill()
        child.wait()
    start = time.monotonic()
    # (the open itself may be what fails: the worker answers it behind the kernel)
    with pytest.raises(GpuBrokerError, match=rf"session {killed} of tenant alice expired \(no heartbeat from its "
                                             r"client\) while its work ran; the worker was stopped") as stopped, \
            connect(cancel_broker.target, token=token) as rerun:
        rerun.allocate_memory(64)
        rerun.synchronize(timeout=60)
    assert time.monotonic() - start < 10, "the rerun waited for more than the lease (2 s) and the grace (1 s)"
    assert not isinstance(stopped.value, DeadlineExceeded)
    with connect(cancel_broker.target, token=token) as again:
        kernel, buf = _spin(again, backend)
        _works(again, kernel, buf)


def test_an_idle_sessions_expiry_spares_the_tenants_busy_session(cancel_broker: BrokerProcess, backend: str) -> None:
    """A session of the tenant whose client went quiet (no heartbeats) expires while another of its sessions runs a
    long kernel on the same worker: the expiry's wait sees that work, but it is not the gone client's, so the
    worker is left alone and the busy session's kernel finishes."""
    token = cancel_broker.tokens["bob"]
    with connect(cancel_broker.target, token=token) as busy:
        kernel, buf = _spin(busy, backend)
        iters = spin_iterations(busy, kernel, buf, seconds=6.0)  # past the idle one's lease (2 s) and grace (1 s)
        quiet = connect(cancel_broker.target, token=token)
        quiet._closed.set()  # its client stops heartbeating (as a suspended process): it expires
        busy.execute_kernel(kernel, 1, 1, [buf, np.int64(iters)])  # type: ignore[arg-type]
        busy.synchronize(timeout=120)
        quiet._channel.close()
        assert f"session {quiet.session} of tenant bob expired" in cancel_broker.log_tail(200_000)
        _works(busy, kernel, buf)
    assert f"session {quiet.session} of tenant bob expired (no heartbeat from its client): its work goes on" in \
        cancel_broker.log_tail(200_000)


def test_a_session_that_expired_says_so(cancel_broker: BrokerProcess) -> None:
    """A client suspended past its lease (SIGSTOP: no heartbeats) comes back to a session that expired, and is told
    so, not only "no session"."""
    token = cancel_broker.tokens["alice"]
    child = subprocess.Popen([sys.executable, CLIENT, cancel_broker.target, token, "stall"], stdout=subprocess.PIPE)
    try:
        assert child.stdout is not None
        session = child.stdout.readline().decode().strip()
        # (watched in the log: any call naming the session would renew its lease)
        wait_for(lambda: f"session {session} of tenant alice expired" in cancel_broker.log_tail(200_000), 30,
                 "the suspended client's lease (2 s) to run out")
        stub = pb_grpc.GpuBrokerStub(make_channel(cancel_broker.target, token)[0])
        with pytest.raises(grpc.RpcError) as refused:
            stub.GetDeviceInfo(pb.SessionRequest(session=session), timeout=10)
        assert refused.value.code() == grpc.StatusCode.NOT_FOUND
        details = refused.value.details() or ""
        assert "has ended: expired: no heartbeat from its client within its 2 s lease" in details, details
        assert "open a new session" in details
    finally:
        child.kill()
        child.wait()
