"""Chaos: workers, clients and the broker killed in the middle of kernels and copies.

In each case the other tenant's data and results stay correct, the killed tenant's device memory goes back to
zero, shared segments are unmapped, and nobody waits on the dead: calls fail with a status instead of hanging.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gpubroker.broker import samples
from gpubroker.broker.launcher import BrokerProcess, TenantSpec
from gpubroker.client import (
    AdminClient,
    NotFound,
    RemoteGpu,
    Unavailable,
    WorkerCrashed,
    connect,
)
from gpubroker.client._channel import make_channel
from gpubroker.v1 import broker_pb2 as pb
from gpubroker.v1 import broker_pb2_grpc as pb_grpc

from ..conftest import worker_pids
from ..helpers import wait_for

MIB = 1 << 20
TENANTS = [TenantSpec("alice", memory_quota=1 << 30), TenantSpec("bob", memory_quota=1 << 30),
           TenantSpec("root", admin=True)]

# A client that starts a copy and then waits to be killed in the middle of it.
CLIENT = str(Path(__file__).with_name("killable_client.py"))


def _broker(backend: str, **settings: object) -> BrokerProcess:
    return BrokerProcess(TENANTS, backend=backend, settings={"lease_seconds": 1.0, **settings})


def _bystander(gpu: RemoteGpu, backend: str) -> Callable[[], None]:
    """Bob's data and a kernel over it; the returned check reruns the kernel and verifies every value and his memory."""
    data = np.arange(1 << 16, dtype=np.float32)
    buf = gpu.allocate_memory(data.nbytes)
    gpu.copy_h2d(data, buf)
    kernel = gpu.compile_kernel(samples.source(backend), "scale_inplace")
    used = gpu.device_info().memory_used
    expected = [data]

    def check() -> None:
        gpu.execute_kernel(kernel, data.size // 256, 256, [buf, np.float32(2), np.int32(data.size)])
        expected[0] = expected[0] * 2 + 1
        out = np.empty_like(data)
        gpu.copy_d2h(buf, out)
        np.testing.assert_array_equal(out, expected[0])
        assert gpu.device_info().memory_used == used

    check()
    return check


def _stub(broker: BrokerProcess, tenant: str) -> pb_grpc.GpuBrokerStub:
    return pb_grpc.GpuBrokerStub(make_channel(broker.target, broker.tokens[tenant])[0])


def _memory(broker: BrokerProcess, tenant: str) -> int:
    with AdminClient(broker.target, broker.tokens["root"]) as admin:
        return sum(u.memory_used for u in admin.usage().tenants if u.tenant == tenant)


def _segments(pid: int, client_pid: int) -> list[str]:
    """The worker's mappings of the client's shared segments (memfds named after the client's pid)."""
    with open(f"/proc/{pid}/maps") as maps:
        return [line for line in maps if f"gpubroker-seg-{client_pid}-" in line]


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


@pytest.mark.parametrize("async_commands", [False, True], ids=["sync", "async"])
def test_worker_killed_mid_kernel_fails_only_its_tenant(backend: str, async_commands: bool) -> None:
    with _broker(backend) as broker, connect(broker.target, token=broker.tokens["bob"]) as bob:
        check_bob = _bystander(bob, backend)
        with connect(broker.target, token=broker.tokens["alice"], async_commands=async_commands) as alice:
            spin = alice.compile_kernel(samples.source(backend), "spin")
            work = alice.allocate_memory(MIB)
            # Hours of work: only the kill ends it. A launch returns once queued, so the kernel is in flight now
            # (an asynchronous one once the batch holding it is acknowledged, which device_info waits for).
            alice.execute_kernel(spin, 64, 64, [work, np.int64(1 << 40)])
            alice.device_info()
            (pid,) = worker_pids(broker, "alice")
            os.kill(pid, signal.SIGKILL)
            with pytest.raises(WorkerCrashed) as info:
                alice.synchronize()
            assert "SIGKILL" in info.value.message
            check_bob()
            assert _memory(broker, "alice") == 0
        with connect(broker.target, token=broker.tokens["alice"]) as again:  # a fresh worker, nothing charged
            assert again.device_info().memory_used == 0
            buf = again.allocate_memory(64)
            again.copy_h2d(b"a" * 64, buf)
            out = bytearray(64)
            again.copy_d2h(buf, out)
            assert out == b"a" * 64
        check_bob()


def test_worker_killed_mid_streamed_copy_fails_that_copy_with_aborted(backend: str) -> None:
    with _broker(backend) as broker, connect(broker.target, token=broker.tokens["bob"]) as bob:
        check_bob = _bystander(bob, backend)
        stub = _stub(broker, "alice")
        with connect(broker.target, token=broker.tokens["alice"], shared_memory=False) as alice:
            ref = pb.BufferRef(handle=alice.allocate_memory(32 * MIB).handle)
            flowing, killed = threading.Event(), threading.Event()

            def chunks() -> Iterator[pb.HostToDeviceChunk]:
                header = pb.HostToDeviceHeader(session=alice.session, buffer=ref, size=32 * MIB)
                yield pb.HostToDeviceChunk(header=header, data=bytes(MIB))
                flowing.set()
                killed.wait(60)
                for _ in range(31):
                    yield pb.HostToDeviceChunk(data=bytes(MIB))

            upload = stub.CopyHostToDevice.future(chunks(), timeout=120)
            assert flowing.wait(60)
            (pid,) = worker_pids(broker, "alice")
            os.kill(pid, signal.SIGKILL)
            killed.set()
            with pytest.raises(grpc.RpcError) as info:
                upload.result()
            assert info.value.code() == grpc.StatusCode.ABORTED
        check_bob()
        with connect(broker.target, token=broker.tokens["alice"], shared_memory=False) as alice:
            buf = alice.allocate_memory(32 * MIB)
            reads = stub.CopyDeviceToHost(pb.CopyDeviceToHostRequest(
                session=alice.session, buffer=pb.BufferRef(handle=buf.handle), size=32 * MIB), timeout=120)
            next(reads)  # the download is under way, held back by flow control until this client reads on
            (pid,) = worker_pids(broker, "alice")
            os.kill(pid, signal.SIGKILL)
            with pytest.raises(grpc.RpcError) as info:
                for _ in reads:
                    pass
            assert info.value.code() == grpc.StatusCode.ABORTED
        check_bob()
        assert _memory(broker, "alice") == 0


def test_a_copy_given_up_mid_stream_leaves_the_next_copy_intact(backend: str) -> None:
    """Reads the client gave up on (its deadline passed) may still be queued in the worker behind a kernel: they
    must not write into memory the next copy already uses."""
    with _broker(backend) as broker, \
            connect(broker.target, token=broker.tokens["alice"], shared_memory=False) as gpu:
        spin = gpu.compile_kernel(samples.source(backend), "spin")
        work, big, target = gpu.allocate_memory(4096), gpu.allocate_memory(8 * MIB), gpu.allocate_memory(4 * MIB)
        gpu.copy_h2d(np.zeros(8 * MIB, np.uint8), big)
        gpu.execute_kernel(spin, 1, 1, [work, np.int64(400_000_000)])  # holds the worker's reads for a while
        reads = _stub(broker, "alice").CopyDeviceToHost(pb.CopyDeviceToHostRequest(
            session=gpu.session, buffer=pb.BufferRef(handle=big.handle), size=8 * MIB), timeout=0.2)
        with pytest.raises(grpc.RpcError) as info:
            for _ in reads:
                pass
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        data = np.random.default_rng(3).integers(0, 256, 4 * MIB, dtype=np.uint8)
        gpu.copy_h2d(data, target)
        out = np.empty_like(data)
        gpu.copy_d2h(target, out)
        np.testing.assert_array_equal(out, data)


@pytest.mark.parametrize("mode", ["h2d", "d2h", "shm"])
def test_client_killed_mid_copy_is_reaped_and_everything_it_held_freed(backend: str, mode: str) -> None:
    """A streamed upload or download over gRPC, or a loop of shared-memory copies (memory mapped, on CUDA pinned)."""
    with _broker(backend) as broker, connect(broker.target, token=broker.tokens["bob"]) as bob, \
            connect(broker.target, token=broker.tokens["alice"]) as observer:
        check_bob = _bystander(bob, backend)
        child = subprocess.Popen([sys.executable, CLIENT, broker.target, broker.tokens["alice"], mode],
                                 stdout=subprocess.PIPE)
        try:
            assert child.stdout is not None and child.stdout.readline().strip() == b"copying"
            (worker,) = worker_pids(broker, "alice")
            assert observer.device_info().memory_used == 32 * MIB
            if mode == "shm":
                assert _segments(worker, child.pid)
        finally:
            child.kill()
            child.wait()
        wait_for(lambda: observer.device_info().memory_used == 0, 15, "the killed client's session to be reaped")
        wait_for(lambda: not _segments(worker, child.pid), 15, "its shared segments to be unmapped")
        assert worker_pids(broker, "alice") == [worker]  # the tenant's worker lives on and serves
        buf = observer.allocate_memory(MIB)
        observer.copy_h2d(np.full(MIB, 7, np.uint8), buf)
        out = np.empty(MIB, np.uint8)
        observer.copy_d2h(buf, out)
        assert (out == 7).all()
        check_bob()


def _health(broker: BrokerProcess) -> str:
    channel, _ = make_channel(broker.target, None)
    with channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def test_sigterm_lets_a_copy_in_flight_finish_to_its_last_byte(backend: str) -> None:
    data = np.random.default_rng(7).integers(0, 256, 16 * MIB, dtype=np.uint8)
    with _broker(backend, lease_seconds=10.0, drain_grace_seconds=60.0) as broker:
        gpu = connect(broker.target, token=broker.tokens["alice"], shared_memory=False)
        buf = gpu.allocate_memory(data.nbytes)
        ref = pb.BufferRef(handle=buf.handle)
        flowing, draining = threading.Event(), threading.Event()

        def chunks() -> Iterator[pb.HostToDeviceChunk]:
            header = pb.HostToDeviceHeader(session=gpu.session, buffer=ref, size=data.nbytes)
            yield pb.HostToDeviceChunk(header=header, data=data[:MIB].tobytes())
            flowing.set()
            draining.wait(60)
            for start in range(MIB, data.nbytes, MIB):
                yield pb.HostToDeviceChunk(data=data[start:start + MIB].tobytes())

        upload = _stub(broker, "alice").CopyHostToDevice.future(chunks(), timeout=120)
        assert flowing.wait(60)
        assert broker.process is not None
        broker.process.send_signal(signal.SIGTERM)
        wait_for(lambda: _health(broker) == "NOT_SERVING", 15, "the broker to drain")
        with pytest.raises(Unavailable):
            connect(broker.target, token=broker.tokens["bob"])
        draining.set()
        upload.result()  # the rest of the copy goes through during the drain
        out = np.empty_like(data)
        gpu.copy_d2h(buf, out)
        np.testing.assert_array_equal(out, data)
        gpu.close()  # the last session ends: the drain is over and the broker exits
        assert broker.process.wait(timeout=60) == 0


def test_broker_killed_outright_clients_get_unavailable_and_a_restart_starts_clean(backend: str) -> None:
    with _broker(backend, lease_seconds=10.0) as broker:
        gpu = connect(broker.target, token=broker.tokens["alice"], timeout=60)
        buf = gpu.allocate_memory(MIB)
        host = gpu.host_array(MIB, np.uint8)  # the shared-memory segments channel is connected too
        gpu.copy_h2d(host, buf)
        workers = worker_pids(broker, "alice")
        assert broker.process is not None
        os.kill(broker.process.pid, signal.SIGKILL)
        broker.process.wait()
        # Its workers see their front's socket close and exit: nothing holds the device for a dead broker.
        wait_for(lambda: all(_state(p) in ("gone", "Z") for p in workers), 30, "the orphaned workers to exit")
        with pytest.raises(Unavailable):
            gpu.allocate_memory(16)  # gRPC
        with pytest.raises(Unavailable):
            gpu.synchronize()  # the direct link to the dead worker, then gRPC
        with pytest.raises(Unavailable):
            gpu.copy_h2d(host, buf)  # the shared-memory path
        assert broker.workdir is not None
        ready = broker.workdir / "restarted.json"
        with open(broker.workdir / "restarted.log", "wb") as log:
            restarted = subprocess.Popen(
                [sys.executable, "-m", "gpubroker.broker.cli", "serve", "--config", str(broker.config_path),
                 "--ready-file", str(ready)], stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True)
        try:
            wait_for(lambda: ready.exists() or restarted.poll() is not None, 120, "the broker to restart")
            assert restarted.poll() is None, (broker.workdir / "restarted.log").read_text()[-3000:]

            def old_session_refused() -> bool:
                try:
                    gpu.allocate_memory(16)
                except Unavailable:
                    return False  # the old channel waits out its reconnection backoff
                except NotFound:
                    return True  # the same socket path, a new broker: the old session is gone
                raise AssertionError("the old session lived on in the restarted broker")

            wait_for(old_session_refused, 60, "the old client to reach the restarted broker")
            with connect(broker.target, token=broker.tokens["alice"]) as fresh, \
                    AdminClient(broker.target, broker.tokens["root"]) as admin:
                assert fresh.device_info().memory_used == 0
                assert [s.session for s in admin.list_sessions()] == [fresh.session]
                again = fresh.allocate_memory(64)
                fresh.copy_h2d(b"r" * 64, again)
                out = bytearray(64)
                fresh.copy_d2h(again, out)
                assert out == b"r" * 64
        finally:
            gpu.close()
            restarted.terminate()
            try:
                restarted.wait(30)
            finally:
                try:
                    os.killpg(restarted.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
