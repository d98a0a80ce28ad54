"""The gRPC front bounded per session, per tenant and per connection: a tenant's Commands streams are calls like
any other (the call limits refuse those past them) and its read-ahead shares one byte budget, so many streams
cannot grow the front's memory; a flood of raw HTTP/2 connections that never make a call is capped and timed out,
and a tenant still opens a session and launches during it."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import numpy as np
import pytest

from gpubroker.broker import samples
from gpubroker.broker.launcher import BrokerProcess, TenantSpec
from gpubroker.client import RemoteGpu, TlsOptions, connect
from gpubroker.v1 import broker_pb2 as pb
from gpubroker.v1 import broker_pb2_grpc as pb_grpc
from gpubroker.wire.commands import Batch, Write, encode

from ..helpers import wait_for
from ._probes import tenant_credentials

CALL_LIMIT = 8  # max_concurrent_rpcs_per_session
READ_AHEAD_BUDGET = 16 * 1024**2  # max_read_ahead_bytes_per_tenant
STREAMS = 12
BATCHES = 6  # per stream: more than its read-ahead of 4
CHUNK = 4 * 1024**2 - 64 * 1024  # one Write per batch, just under max_message_bytes (4 MiB)
# The flood: raw TCP connections from another local user (a local TCP peer is its uid, whatever loopback address it
# uses) that send the HTTP/2 preface and SETTINGS, then nothing, against a broker that may open 1024 descriptors
# (systemd's default soft limit).
FLOOD = 1000
FLOOD_FROM = "127.0.0.2"
FLOOD_UID = 65533
DESCRIPTORS = 1024
GRPC_CONNECTIONS = 64  # max_grpc_connections (the two listeners together)
PER_PEER = 8  # max_grpc_connections_per_peer
GRPC_IDLE = 5.0  # grpc_idle_seconds (the flood is capped within ~0.1 s: 0.8 x this leaves it 4 s)
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])  # + an empty SETTINGS frame
NAP_SECONDS = 6.0  # how long the tenant's kernel holds its worker while the streams pile up behind it
# A kernel that sleeps in its worker (a syscall from OpenCL C on PoCL): every batch after it waits in the front.
NAP_SOURCE = r"""
__kernel void nap(__global long *out, long ns) {
    long ts[2] = {ns / 1000000000L, ns % 1000000000L};
    long r;
    __asm__ volatile("syscall" : "=a"(r) : "a"(35L), "D"(ts), "S"(0L) : "rcx", "r11", "memory");
    out[0] = r;
}
"""


@pytest.fixture(scope="module")
def front(backend: str) -> Iterator[BrokerProcess]:
    settings: dict[str, object] = {
        "max_concurrent_rpcs_per_session": CALL_LIMIT, "max_read_ahead_bytes_per_tenant": READ_AHEAD_BUDGET,
        "max_grpc_connections": GRPC_CONNECTIONS, "max_grpc_connections_per_peer": PER_PEER,
        "grpc_idle_seconds": GRPC_IDLE, "lease_seconds": 60.0}
    with BrokerProcess([TenantSpec("alice"), TenantSpec("bob")], backend=backend, settings=settings,
                       tcp=["127.0.0.1:0"], wrapper=["prlimit", f"--nofile={DESCRIPTORS}:{DESCRIPTORS}", "--"]) as proc:
        yield proc


def _channel(broker: BrokerProcess, tenant: str) -> grpc.Channel:
    credentials = tenant_credentials(broker, tenant)
    return grpc.secure_channel(broker.target, credentials, options=[("grpc.max_send_message_length", -1)])


def _memory(pid: int) -> int:
    """The front's resident memory now, in bytes."""
    status = Path(f"/proc/{pid}/status").read_text()
    return next(int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("VmRSS:"))


class _PeakMemory:
    """The front's largest resident memory while the block runs, sampled every 20 ms by a thread."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.before = self.peak = _memory(pid)
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._done.wait(0.02):
            self.peak = max(self.peak, _memory(self.pid))

    def __enter__(self) -> _PeakMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()

    @property
    def growth(self) -> int:
        return self.peak - self.before


def _stream_batches(session: str, buf: str) -> Iterator[pb.CommandBatch]:
    data = bytes(CHUNK)
    for k in range(BATCHES):
        yield pb.CommandBatch(session=session if k == 0 else "", batch=k + 1,
                              encoded=encode(Batch(k + 1, k, [Write((buf, 0), 0, data)])))


def test_commands_streams_past_the_call_limit_are_refused_and_read_ahead_is_bounded(front: BrokerProcess) -> None:
    if front.backend != "opencl":
        pytest.skip("the stalling kernel is OpenCL C for PoCL")
    assert front.process is not None
    with _channel(front, "alice") as channel:
        stub = pb_grpc.GpuBrokerStub(channel)
        session = stub.OpenSession(pb.OpenSessionRequest(device=0), timeout=60).session
        module = stub.LoadModule(pb.LoadModuleRequest(session=session, format=pb.MODULE_FORMAT_OPENCL_C,
                                                      image=NAP_SOURCE.encode()), timeout=60).handle
        kernel = stub.GetKernel(pb.GetKernelRequest(session=session, module=module, name="nap"), timeout=60).handle
        out = stub.Allocate(pb.AllocateRequest(session=session, size=8), timeout=60).handle
        buf = stub.Allocate(pb.AllocateRequest(session=session, size=4 * 1024**2), timeout=60).handle
        nap = np.int64(int(NAP_SECONDS * 1e9)).tobytes()
        args = [pb.KernelArg(buffer=pb.BufferRef(handle=out)),
                pb.KernelArg(scalar=pb.ScalarArg(dtype="<i8", value=nap))]

        def stream(_: int) -> tuple[grpc.StatusCode, int]:
            call = stub.Commands(_stream_batches(session, buf), timeout=120)
            acks = 0
            with contextlib.suppress(grpc.RpcError):
                for _ack in call:
                    acks += 1
            return call.code(), acks

        with _PeakMemory(front.process.pid) as memory:
            started = time.monotonic()
            stub.LaunchKernel(pb.LaunchKernelRequest(session=session, kernel=kernel, grid=[1], block=[1], args=args),
                              timeout=60)
            with ThreadPoolExecutor(STREAMS) as pool:
                results = list(pool.map(stream, range(STREAMS)))
            took = time.monotonic() - started
        codes = [code for code, _ in results]
        print(f"streams: {[c.name for c in codes]}; front grew by {memory.growth / 2**20:.0f} MiB (peak), "
              f"took {took:.1f} s")
        assert took >= NAP_SECONDS * 0.9, "the kernel did not hold the worker: the streams did not pile up"
        # Every stream within the limit ran all its batches; the rest were refused at their first batch.
        assert codes.count(grpc.StatusCode.OK) <= CALL_LIMIT
        assert all(acks == BATCHES for code, acks in results if code == grpc.StatusCode.OK)
        refused = [code for code in codes if code != grpc.StatusCode.OK]
        assert len(refused) >= STREAMS - CALL_LIMIT and set(refused) == {grpc.StatusCode.RESOURCE_EXHAUSTED}, codes
        # Unbounded, 12 streams read 4 batches ahead each (48 x 4 MiB, decoded several times over: ~760 MiB).
        # Bounded: each admitted stream holds about one message in gRPC and one in the front (~5 x 4 MiB once
        # copied and parsed), and the tenant's decoded read-ahead is its budget (a few times 16 MiB): ~280 MiB here.
        assert memory.growth < 420 * 1024**2, f"the front grew by {memory.growth / 2**20:.0f} MiB"
        # The streams' slots came back with them: the session takes calls again.
        stub.Heartbeat(pb.SessionRequest(session=session), timeout=60)
        stub.CloseSession(pb.SessionRequest(session=session), timeout=60)


def _open_flood(target: str) -> tuple[list[socket.socket], int]:
    """FLOOD raw connections of FLOOD_UID from FLOOD_FROM, each sent the preface and SETTINGS; those connect refused
    or timed out are counted, not kept."""
    host, port = target.rsplit(":", 1)
    flood, failed = [], 0
    os.setegid(FLOOD_UID)
    os.seteuid(FLOOD_UID)  # (a socket is owned by whoever created it: each of these is FLOOD_UID's)
    try:
        for _ in range(FLOOD):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.settimeout(2)
            try:
                sock.bind((FLOOD_FROM, 0))
                sock.connect((host, int(port)))
                sock.sendall(PREFACE)
            except OSError:
                sock.close()
                failed += 1
                continue
            sock.setblocking(False)
            flood.append(sock)
    finally:
        os.seteuid(0)
        os.setegid(0)
    return flood, failed


def _still_open(flood: list[socket.socket]) -> int:
    """How many of the flood's connections the broker has not closed (reading whatever it sent them)."""
    count = 0
    for sock in flood:
        try:
            while sock.recv(65536):
                pass  # the server's SETTINGS, a GOAWAY: then the end, or nothing more yet
        except BlockingIOError:
            count += 1
        except OSError:
            pass  # reset: closed
    return count


def _launch_and_sync(gpu: RemoteGpu) -> None:
    kernel = gpu.compile_kernel(samples.source(gpu.device_info().backend), "saxpy")
    x = np.arange(256, dtype=np.float32)
    dx, dy = gpu.allocate_memory(x.nbytes), gpu.allocate_memory(x.nbytes)
    gpu.copy_h2d(x, dx)
    gpu.memset(dy, 0)
    gpu.execute_kernel(kernel, 2, 128, [np.float32(2), dx, dy, np.int32(x.size)])
    gpu.synchronize()
    out = np.empty_like(x)
    gpu.copy_d2h(dy, out)
    np.testing.assert_array_equal(out, 2 * x)


def test_a_flood_of_idle_http2_connections_is_capped_per_peer_and_timed_out(front: BrokerProcess) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to flood as another local user")
    began = time.monotonic()
    flood, failed = _open_flood(front.tcp_target)
    try:
        # Past the broker's cap, connections are closed as they come; one peer keeps at most PER_PEER of the rest,
        # long before any of them is idle for GRPC_IDLE.
        wait_for(lambda: _still_open(flood) <= PER_PEER, 5.0,
                 f"the flood held to {PER_PEER} connections (its peer's cap)")
        assert _still_open(flood) > 0 and time.monotonic() - began < GRPC_IDLE * 0.8, \
            "too slow to tell the per-peer cap from the idle timeout"
        # A tenant of another uid gets a new connection, a session and a launch meanwhile.
        started = time.monotonic()
        with connect(front.tcp_target, token=front.tokens["bob"], tls=TlsOptions(insecure=True), timeout=30) as gpu:
            _launch_and_sync(gpu)
        print(f"flood: {len(flood)} connected, {failed} refused at connect; tenant served in "
              f"{time.monotonic() - started:.1f} s")
        # Connections that never make a call are closed after grpc_idle_seconds.
        wait_for(lambda: _still_open(flood) == 0, GRPC_IDLE + 10.0, "the flood's connections closed when idle")
    finally:
        for sock in flood:
            sock.close()
