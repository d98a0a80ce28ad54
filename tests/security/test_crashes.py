"""A tenant that keeps crashing its own worker is that tenant's problem: backed off, never the device's.

Real crashes on PoCL, where a tenant's kernel and its compile run as native code inside its worker: a kernel
that writes through a wild pointer (SIGSEGV at launch), and a source whose 20,000 nested ``~`` overflow
clang's recursive parser (SIGSEGV in the middle of the compile).
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import signal
import struct
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import msgpack
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gpubroker.broker import samples
from gpubroker.broker.front._health import device_service
from gpubroker.broker.front.workers._replies import (
    WorkerLied,
    check_ack,
    decode_control,
    decode_error,
    decode_reply,
    device_info_from_dict,
    error_from_worker,
)
from gpubroker.broker.launcher import BrokerProcess, TenantSpec
from gpubroker.client import GpuBrokerError, RemoteGpu, Unavailable, WorkerCrashed, connect
from gpubroker.client._channel import make_channel
from gpubroker.wire.commands import Ack, Allocate, Batch, CommandError, Launch, LoadModule, Read, encode
from gpubroker.wire.errors import WireError
from gpubroker.wire.worker import CONTROL, PeerExport, PeerOpen, RunBatch, Usage

from ..conftest import worker_pids
from ..helpers import wait_for

TENANTS = [TenantSpec("mallory"), TenantSpec("bob")]
WILD_POINTER = "__kernel void boom(__global int* x) { *(__global int*)(0x10) = 1; }"
# clang parses unary operators recursively: this many nested exhaust the compiling thread's stack.
COMPILER_CRASH = "__kernel void deep(__global int* x) { x[0] = " + "~" * 20000 + "x[1]; }"
CRASHES = 10


@pytest.fixture
def broker() -> Iterator[BrokerProcess]:
    settings = {"tenant_crash_budget": CRASHES, "tenant_crash_window_seconds": 60.0, "device_failure_threshold": 3,
                "metrics_listen": "127.0.0.1:0", "lease_seconds": 5.0}
    with BrokerProcess(TENANTS, backend="opencl", settings=settings) as proc:
        yield proc


def _device_health(broker: BrokerProcess) -> str:
    channel, _ = make_channel(broker.target, broker.tokens["bob"])
    with channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=device_service(0)), timeout=10)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def _metric(broker: BrokerProcess, name: str, tenant: str) -> float:
    text = urllib.request.urlopen(broker.metrics_url, timeout=10).read().decode()
    found = re.search(rf'^{name}\{{tenant="{tenant}"\}} (\S+)$', text, re.MULTILINE)
    assert found is not None, f"{name} for {tenant} not in the metrics"
    return float(found.group(1))


def _crash(broker: BrokerProcess, how: int) -> None:
    """One of mallory's sessions, ended by a crash of her worker: at launch or in the compiler."""
    with connect(broker.target, token=broker.tokens["mallory"], device=0) as gpu:
        buf = gpu.allocate_memory(64)
        with pytest.raises(WorkerCrashed):
            if how % 2:
                gpu.compile_kernel(COMPILER_CRASH, "deep")
            else:
                gpu.execute_kernel(gpu.compile_kernel(WILD_POINTER, "boom"), 1, 1, [buf])
                gpu.synchronize()


def _work(gpu: RemoteGpu) -> None:
    data = np.arange(4096, dtype=np.float32)
    buf = gpu.allocate_memory(data.nbytes)
    gpu.copy_h2d(data, buf)
    kernel = gpu.compile_kernel(samples.source("opencl"), "scale_inplace")
    gpu.execute_kernel(kernel, data.size // 256, 256, [buf, np.float32(2), np.int32(data.size)])
    out = np.empty_like(data)
    gpu.copy_d2h(buf, out)
    np.testing.assert_array_equal(out, data * 2 + 1)
    gpu.free_memory(buf)


def test_a_tenant_that_crashes_its_worker_is_backed_off_and_the_device_serves_on(broker: BrokerProcess) -> None:
    with connect(broker.target, token=broker.tokens["bob"], device=0) as bob:
        _work(bob)
        for i in range(CRASHES):
            _crash(broker, i)
            assert _device_health(broker) == "SERVING", broker.log_tail()
            _work(bob)  # bob's session goes on...
            if i % 3 == 2:  # ...and he opens new ones throughout
                with connect(broker.target, token=broker.tokens["bob"], device=0) as again:
                    _work(again)
        with pytest.raises(Unavailable, match=rf"tenant 'mallory' crashed its workers {CRASHES} times within 60 s"
                           ) as refused:
            connect(broker.target, token=broker.tokens["mallory"], device=0)
        assert 1 <= refused.value.details["retry_after_seconds"] <= 60
        assert [d.health for d in bob.list_devices()] == ["SERVING"]
        assert _device_health(broker) == "SERVING"
        with connect(broker.target, token=broker.tokens["bob"], device=0) as again:
            _work(again)
        _work(bob)
    assert _metric(broker, "gpubroker_tenant_worker_crashes_total", "mallory") == CRASHES
    assert _metric(broker, "gpubroker_tenant_worker_crashes_total", "bob") == 0
    assert _metric(broker, "gpubroker_tenant_backoff_seconds", "mallory") > 0
    log = broker.log_tail(200_000)
    assert "its new sessions are refused" in log and "failed before running any tenant code" not in log


def test_a_drains_stop_signal_to_the_workers_is_no_failure() -> None:
    settings = {"tenant_crash_budget": 1, "drain_grace_seconds": 2.0, "device_failure_threshold": 1}
    with BrokerProcess(TENANTS, backend="opencl", settings=settings) as broker:
        assert broker.process is not None
        sessions = [connect(broker.target, token=broker.tokens[t], device=0) for t in ("mallory", "bob")]
        try:
            for gpu in sessions:
                _work(gpu)  # both workers have run their tenants' code: a death now would be their failure
            workers = worker_pids(broker, "mallory") + worker_pids(broker, "bob")
            assert len(workers) == 2
            # What a service manager that signals the whole group does (systemd's default KillMode, Ctrl-C). The
            # sandboxed workers (PID 1 of their namespaces) ignore it; unsandboxed, they die of it. Either way
            # the broker drains, stops what is left and exits, and no death is anybody's failure.
            os.killpg(broker.process.pid, signal.SIGTERM)
            assert broker.process.wait(30) == 0
            log = broker.log_tail(200_000)
            assert "worker crash of its own" not in log and "failed before running any tenant code" not in log
            assert "is not serving new sessions" not in log and "crashed its workers" not in log
        finally:
            for gpu in sessions:
                with contextlib.suppress(GpuBrokerError):  # (their workers are gone)
                    gpu.close()


# From inside a kernel, write(2) straight onto the worker's socket to the front: a frame the worker never sent.
FORGE = r"""
__kernel void forge(__global const uchar* frame, const long len, const long fd, __global long* ret) {
    long r;
    __asm__ volatile ("syscall" : "=a"(r) : "a"(1L), "D"(fd), "S"(frame), "d"(len) : "rcx", "r11", "memory");
    ret[0] = r;
}"""


def _front_fd(pid: int) -> int:
    args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    return int(args[args.index(b"--fd") + 1])


LIES = {
    "a lease message the protocol lacks": msgpack.packb([CONTROL, 0, ["grant-me-everything"]]),
    "a reply to a request the front never made": msgpack.packb([987654, 0, "buf_forged"]),
    "a frame of 2 GiB": b"",  # (only the header: the front must refuse it before buffering a byte)
}


def test_a_worker_that_forges_frames_to_the_front_is_killed_and_charged_to_its_tenant(broker: BrokerProcess) -> None:
    for lies, (what, frame) in enumerate(LIES.items(), start=1):
        with connect(broker.target, token=broker.tokens["mallory"], device=0) as gpu:
            [pid] = worker_pids(broker, "mallory")
            header = struct.pack("!I", len(frame) if frame else 0x7FFFFFFF)
            wire = np.frombuffer(header + frame, dtype=np.uint8)
            data, ret = gpu.allocate_memory(wire.nbytes), gpu.allocate_memory(8)
            gpu.copy_h2d(wire, data)
            kernel = gpu.compile_kernel(FORGE, "forge")
            with pytest.raises(GpuBrokerError):  # its worker dies under it (this call, or the next)
                gpu.execute_kernel(kernel, 1, 1, [data, np.int64(wire.nbytes), np.int64(_front_fd(pid)), ret])
                gpu.synchronize()
                wait_for(lambda: not worker_pids(broker, "mallory"), 10, f"the worker that sent {what} to be killed")
                gpu.synchronize()
        wait_for(lambda n=lies: _metric(broker, "gpubroker_tenant_worker_crashes_total", "mallory") == n, 10,
                 f"{what} to be charged to mallory")
        assert _device_health(broker) == "SERVING"
    log = broker.log_tail(200_000)
    for reason in ("(an unknown lease message (Invalid value 'grant-me-everything'",
                   "(a reply to request 987654, which the front never made) and was killed",
                   "(a frame of 2147483647 bytes, over the front's limit of"):
        assert reason in log
    assert _metric(broker, "gpubroker_tenant_worker_crashes_total", "bob") == 0
    with connect(broker.target, token=broker.tokens["bob"], device=0) as bob:
        _work(bob)


def test_what_the_front_takes_from_a_worker_is_bounded() -> None:
    # The checks each reply passes before the front uses it (the lies above end in these, inside the front).
    with pytest.raises(WorkerLied, match="status no worker reports"):
        error_from_worker(WireError("UNAUTHENTICATED", "log in again", "Unauthenticated"))
    error = error_from_worker(WireError("NOT_FOUND", "x" * 100_000, "SystemExit", {"log": "y" * 1000, "nan": math.nan}))
    assert type(error).__name__ == "NotFound" and len(error.message) < 5000  # never an arbitrary class
    assert error.details == {"log": "y" * 1000}
    # Details of other shapes (a nested map, a key that is no string, text past 256 KiB) are no WireError: lies.
    for details in ({"obj": {"nested": 1}}, {7: "key"}, {"log": "y" * 10_000_000}):
        with pytest.raises(WorkerLied, match="an error reply of the wrong shape"):
            decode_error(msgpack.packb({"code": "NOT_FOUND", "message": "m", "details": details}))
    read = Batch(7, 100, [Launch("k1", (1,), (1,), []), Read(("b1", 0), 0, 16)])
    internal, denied = WireError("INTERNAL", "m"), WireError("PERMISSION_DENIED", "m")
    lies = {
        "not an ack of its batch": b"\x93garbage",
        "not the batch 7": encode(Ack(8, 2, None, b"x" * 16)),
        "3 of a batch's 2": encode(Ack(7, 3, None, b"x" * 16)),
        "did not hold": encode(Ack(7, 0, CommandError(99, "launch of 'k'", internal))),
        "status no worker reports": encode(Ack(7, 0, CommandError(100, "launch", denied))),
        "with no error": encode(Ack(7, 1, None)),
        "bytes asked for": encode(Ack(7, 2, None, b"x" * (1 << 20))),
        "no result to a read": encode(Ack(7, 2, None)),
        "Expected `bytes | null`, got `array`": encode(Ack(7, 2, None, [[]] * 1000)),
    }
    for why, answer in lies.items():
        with pytest.raises(WorkerLied, match=why.replace("|", "\\|")):
            check_ack(read, answer)
    honest = check_ack(read, encode(Ack(7, 1, CommandError(101, "read of 16 bytes", WireError(
        "OUT_OF_RANGE", "m", "SystemExit", {"x": 1}))))).error
    assert honest is not None and honest.type == "OutOfRange" and honest.details == {"x": 1}  # never arbitrary
    assert check_ack(read, encode(Ack(7, 2, None, b"y" * 16))).result == b"y" * 16
    with pytest.raises(WorkerLied, match="Expected `null`, got `str`"):
        check_ack(Batch(1, 0, [Allocate("b1", 8)]), encode(Ack(1, 1, None, "b_forged")))
    with pytest.raises(WorkerLied, match=r"Expected `array \| null`, got `object`"):  # (a module's kernel names)
        check_ack(Batch(1, 0, [LoadModule("m1", "opencl_c", b"")]), encode(Ack(1, 1, None, {"k": 1})))
    with pytest.raises(WorkerLied, match="a result to 'batch' of the wrong shape"):  # (not an encoded ack)
        decode_reply(RunBatch, msgpack.packb({"done": 2}))
    with pytest.raises(WorkerLied, match="a result to 'peer_export' of the wrong shape"):
        decode_reply(PeerExport, msgpack.packb([b"ipc" * 2000, 8]))
    with pytest.raises(WorkerLied, match="a result to 'peer_open' of the wrong shape"):
        decode_reply(PeerOpen, msgpack.packb(""))
    with pytest.raises(WorkerLied, match="a result to 'usage' of the wrong shape"):
        decode_reply(Usage, msgpack.packb([1, {"s": -1}]))
    with pytest.raises(WorkerLied, match="an unknown lease message"):
        decode_control(msgpack.packb(["released", -1]))
    with pytest.raises(WorkerLied, match="total_memory"):
        device_info_from_dict({"id": 0, "name": "gpu", "total_memory": -1})
