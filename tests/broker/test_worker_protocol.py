"""The worker's one execution path, driven as the front drives it: a real worker process (WorkerClient, sandbox
off) on PoCL, fed encoded protocol batches (``RunBatch``), the front's own requests, and a link handed over with
``AttachLink`` that serves Batch / Ack frames under the lease."""

from __future__ import annotations

import asyncio
import os
import socket
import threading
from collections.abc import Coroutine, Iterator
from typing import Any, TypeVar

import msgpack
import numpy as np
import pytest

from gpubroker.broker import samples
from gpubroker.broker.backends import open_backend
from gpubroker.broker.front.workers import WorkerClient
from gpubroker.broker.sandbox import WorkerSandbox
from gpubroker.broker.worker._executor import Executor
from gpubroker.broker.worker._handles import HandleTables
from gpubroker.broker.worker._segments import SegmentTable
from gpubroker.client import InvalidArgument, NotFound
from gpubroker.wire.commands import (
    Ack,
    Allocate,
    Batch,
    BufferArg,
    Command,
    CopyShared,
    CreateEvent,
    CreateStream,
    DestroyEvent,
    DestroyStream,
    DeviceInfoQuery,
    Free,
    GetKernel,
    Launch,
    LoadModule,
    Memset,
    Read,
    ScalarArg,
    Synchronize,
    Write,
    commands,
    decode_ack,
    encode,
    link_commands,
    new_handle,
)
from gpubroker.wire.frames import FRAME_HEADER
from gpubroker.wire.worker import (
    AttachLink,
    CloseSession,
    Grant,
    LeaseToFront,
    Pin,
    RegisterSegment,
    ReleaseSegment,
    Revoke,
    RunBatch,
    SetLimits,
    Unpin,
    Usage,
    WorkerRequest,
    Yield,
)
from tests.helpers import recv_payload, send_payload, spin_iterations, wait_for

T = TypeVar("T")
SCALE = b"""__kernel void scale(__global float* x, const float a, const int n) {
    int i = get_global_id(0); if (i < n) x[i] *= a; }"""
N = 256


class Worker:
    """One worker process and an event loop of its own in a thread, for synchronous tests."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.client = WorkerClient("t", 0, "opencl", sandbox=WorkerSandbox(enabled=False, backend="opencl"))
        self.control: list[str] = []
        self.client.on_control = self.on_control
        self.run(self.client.start(60.0))
        self.ids = 0

    def on_control(self, message: LeaseToFront) -> None:
        self.control.append(type(message).__name__.lower())

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(60)

    def call(self, request: WorkerRequest[T], session: str = "", fd: int | None = None) -> T:
        return self.run(self.client.call(request, session, fd))

    def batch(self, session: str, *commands: Command, first: int = 0) -> Ack:
        self.ids += 1
        batch = Batch(self.ids, first, list(commands))
        return self.run(self.client.run_batch(session, batch, encode(batch)))

    def close(self) -> None:
        self.run(self.client.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()
        self.loop.close()


@pytest.fixture(scope="module")
def worker() -> Iterator[Worker]:
    w = Worker()
    yield w
    w.close()


@pytest.fixture
def session(worker: Worker) -> Iterator[str]:
    sid = f"ses_{os.urandom(6).hex()}"
    yield sid
    worker.call(CloseSession(), sid)


def _scale_kernel(worker: Worker, session: str) -> str:
    module, kernel = new_handle("module"), new_handle("kernel")
    ack = worker.batch(session, LoadModule(module, "opencl_c", SCALE), GetKernel(kernel, module, "scale"))
    assert ack.error is None and ack.done == 2
    return kernel


def _launch(kernel: str, buf: str, factor: float, n: int = N, offset: int = 0) -> Launch:
    return Launch(kernel, (1,), (n,), [BufferArg(buf, offset), ScalarArg("<f4", np.float32(factor).tobytes()),
                                        ScalarArg("<i4", np.int32(n).tobytes())])


def test_allocate_write_launch_read_is_numpys_result(worker: Worker, session: str) -> None:
    kernel, buf = _scale_kernel(worker, session), new_handle("buf")
    x = np.arange(N, dtype=np.float32)
    ack = worker.batch(session, Allocate(buf, x.nbytes), Write((buf, 0), 0, x.tobytes()),
                       _launch(kernel, buf, 3.0), _launch(kernel, buf, 0.5), Read((buf, 0), 0, x.nbytes), first=40)
    assert ack.error is None and ack.done == 5
    assert np.array_equal(np.frombuffer(ack.result, np.float32), x * 3.0 * 0.5)
    # A stream, a memset to the end of a view, and a device query: memory_used is the worker's.
    stream = new_handle("stream")
    ack = worker.batch(session, CreateStream(stream), Memset((buf, 512), 0, -1, stream=stream),
                       Synchronize(stream), DestroyStream(stream), Read((buf, 0), 0, x.nbytes))
    assert ack.error is None
    assert np.array_equal(np.frombuffer(ack.result, np.float32), np.where(np.arange(N) < 128, x * 1.5, 0))
    info = worker.batch(session, DeviceInfoQuery()).result
    assert info["memory_used"] >= x.nbytes and info["backend"] == "opencl"


def test_the_first_failure_stops_the_batch_and_names_the_command(worker: Worker, session: str) -> None:
    kernel, buf = _scale_kernel(worker, session), new_handle("buf")
    bad = Launch(kernel, (1,), (N,), [BufferArg(buf)])  # one argument of three
    ack = worker.batch(session, Allocate(buf, 4 * N), bad, Free(buf), first=100)
    assert ack.done == 1 and ack.error is not None
    assert (ack.error.seq, ack.error.command, ack.error.code) == (101, "launch of 'scale'", "INVALID_ARGUMENT")
    assert "takes 3 argument(s), got 1" in ack.error.message
    # The Free after it never ran: the buffer is still there.
    assert worker.batch(session, Read((buf, 0), 0, 4)).error is None
    ack = worker.batch(session, Read((buf, 0), 0, 8 * N), first=7)
    assert (ack.error.seq, ack.error.command, ack.error.code) == (7, f"read of {8 * N} bytes", "OUT_OF_RANGE")
    ack = worker.batch(session, Read((buf, 0), 0, 1 << 62))  # refused before any host memory is made for it
    assert ack.error is not None and ack.error.code == "OUT_OF_RANGE" and "run past the end" in ack.error.message


def test_unknown_foreign_and_duplicate_handles(worker: Worker, session: str) -> None:
    buf = new_handle("buf")
    assert worker.batch(session, Allocate(buf, 64)).error is None
    other = f"ses_{os.urandom(6).hex()}"
    try:
        ack = worker.batch(other, Read((buf, 0), 0, 4))  # another session's handle is no handle there
        assert ack.error is not None and ack.error.code == "NOT_FOUND"
        assert ack.error.message == f"no buf {buf!r} in this session"
    finally:
        worker.call(CloseSession(), other)
    ack = worker.batch(session, Allocate(buf, 64))
    assert ack.error is not None and ack.error.code == "INVALID_ARGUMENT" and "already in use" in ack.error.message
    stream = new_handle("stream")
    ack = worker.batch(session, CreateStream(buf))  # one namespace for every kind
    assert ack.error is not None and ack.error.code == "INVALID_ARGUMENT"
    for command, kind in ((Free(stream), "buf"), (Synchronize(stream), "stream"), (DestroyStream(stream), "stream"),
                          (Launch("k0", (1,), (1,), []), "kernel"), (GetKernel("k1", "m0", "scale"), "module")):
        ack = worker.batch(session, command)
        assert ack.error is not None and ack.error.code == "NOT_FOUND" and f"no {kind} " in ack.error.message
    ack = worker.batch(session, Free(buf), Free(buf), first=3)
    assert ack.done == 1 and ack.error is not None and (ack.error.seq, ack.error.code) == (4, "NOT_FOUND")


def test_a_freed_handle_taken_again_is_the_new_buffer_in_a_repeated_launch(worker: Worker, session: str) -> None:
    kernel, buf = _scale_kernel(worker, session), new_handle("buf")
    ones = np.ones(N, dtype=np.float32)
    worker.batch(session, Allocate(buf, ones.nbytes), Write((buf, 0), 0, ones.tobytes()), _launch(kernel, buf, 2.0))
    twos = np.full(2 * N, 7, dtype=np.float32)
    ack = worker.batch(session, Free(buf), Allocate(buf, twos.nbytes), Write((buf, 0), 0, twos.tobytes()),
                       _launch(kernel, buf, 2.0), Read((buf, 0), 0, twos.nbytes))
    assert ack.error is None
    assert np.array_equal(np.frombuffer(ack.result, np.float32), np.where(np.arange(2 * N) < N, 14, 7))


def test_the_memory_quota_is_the_workers_and_fails_the_allocation_naming_it(worker: Worker, session: str) -> None:
    worker.call(SetLimits(memory_quota=4096, max_handles=100, max_streams=4, device=2))
    try:
        a, b = new_handle("buf"), new_handle("buf")
        assert worker.batch(session, Allocate(a, 3000)).error is None
        ack = worker.batch(session, Allocate(b, 2000), first=9)
        assert ack.error is not None and (ack.error.seq, ack.error.command) == (9, "allocate of 2000 bytes")
        assert ack.error.code == "RESOURCE_EXHAUSTED" and ack.error.type == "ResourceExhausted"
        assert ack.error.message == ("memory quota exceeded for tenant 't' on device 2: quota 4096 bytes, used 3000, "
                                     "requested 2000")
        assert ack.error.details == {"quota": 4096, "used": 3000, "requested": 2000, "device": 2}
        usage = worker.call(Usage())  # (its counters are the module's worker's, since it started)
        assert (usage.memory_used, usage.sessions) == (3000, {session: 3000})
        assert worker.run(worker.client.take_device_time()) >= 0
        assert worker.batch(session, Free(a), Allocate(b, 2000)).error is None  # freed memory counts no more
        assert worker.call(Usage()).memory_used == 2000
    finally:
        worker.call(SetLimits(memory_quota=1 << 40, max_handles=4096, max_streams=64))
    worker.call(CloseSession(), session)
    usage = worker.call(Usage())
    assert (usage.memory_used, usage.sessions) == (0, {})


def test_handle_and_stream_limits_are_per_session(worker: Worker, session: str) -> None:
    worker.call(SetLimits(memory_quota=1 << 30, max_handles=3, max_streams=1))
    try:
        s1, s2 = new_handle("stream"), new_handle("stream")
        ack = worker.batch(session, CreateStream(s1), CreateStream(s2))
        assert ack.done == 1 and ack.error is not None and ack.error.code == "RESOURCE_EXHAUSTED"
        assert ack.error.message == "this session already has 1 streams, the limit"
        ack = worker.batch(session, Allocate(new_handle("buf"), 8), Allocate(new_handle("buf"), 8),
                           Allocate(new_handle("buf"), 8))
        assert ack.done == 2 and ack.error is not None and ack.error.code == "RESOURCE_EXHAUSTED"
        assert "already holds 3 handles" in ack.error.message
        other = f"ses_{os.urandom(6).hex()}"
        assert worker.batch(other, CreateStream(s2)).error is None  # another session has room of its own
        worker.call(CloseSession(), other)
    finally:
        worker.call(SetLimits(memory_quota=1 << 40, max_handles=4096, max_streams=64))


def test_events_count_toward_the_handle_limit_and_go_with_their_session(worker: Worker, session: str) -> None:
    worker.call(SetLimits(memory_quota=1 << 30, max_handles=2, max_streams=4))
    try:
        e1, e2, e3 = new_handle("event"), new_handle("event"), new_handle("event")
        ack = worker.batch(session, CreateEvent(e1), CreateEvent(e2), CreateEvent(e3))
        assert ack.done == 2 and ack.error is not None and ack.error.code == "RESOURCE_EXHAUSTED"
        assert "already holds 2 handles" in ack.error.message
        ack = worker.batch(session, CreateEvent(e1))
        assert ack.error is not None and ack.error.code == "INVALID_ARGUMENT" and "(an event)" in ack.error.message
        ack = worker.batch(session, DestroyEvent(e1), CreateEvent(e3))  # a destroyed event frees its handle
        assert ack.error is None and ack.done == 2
        worker.call(CloseSession(), session)
        ack = worker.batch(session, DestroyEvent(e2))  # closed with its session: the id starts afresh
        assert ack.error is not None and ack.error.code == "NOT_FOUND"
        assert ack.error.message == f"no event {e2!r} in this session"
    finally:
        worker.call(SetLimits(memory_quota=1 << 40, max_handles=4096, max_streams=64))


class FormatDisk(WorkerRequest[None], tag="format_disk", frozen=True):
    """A request no worker knows (the front has no such request: a worker answers it as malformed)."""


def test_a_malformed_batch_is_invalid_argument_and_the_worker_serves_on(worker: Worker, session: str) -> None:
    for data in (b"\x93\x01", msgpack.packb([1, 0, [["launch", "k", [1, 1, 1, 1], [1], [], 0, ""]]]),
                 msgpack.packb([1, 0, [["format_disk"]]]), b"junk"):
        with pytest.raises(InvalidArgument, match="malformed batch"):
            worker.call(RunBatch(data), session)
    with pytest.raises(InvalidArgument, match="malformed worker request"):
        worker.call(FormatDisk(), session)
    assert worker.batch(session, Allocate(new_handle("buf"), 8)).error is None


def test_a_pinned_buffer_cannot_be_freed(worker: Worker, session: str) -> None:
    buf = new_handle("buf")
    worker.batch(session, Allocate(buf, 64))
    worker.call(Pin([buf]), session)
    ack = worker.batch(session, Free(buf))
    assert ack.error is not None and ack.error.code == "FAILED_PRECONDITION"
    assert ack.error.message == "buffer in use by a copy to another device"
    with pytest.raises(NotFound):
        worker.call(Pin([new_handle("buf")]), session)
    worker.call(Unpin([buf]), session)
    assert worker.batch(session, Free(buf)).error is None


def test_segments_by_the_clients_handle(worker: Worker, session: str) -> None:
    fd = os.memfd_create("test-segment")
    try:
        os.ftruncate(fd, 4096)
        os.pwrite(fd, np.arange(256, dtype=np.float32).tobytes(), 0)
        seg, buf = new_handle("segment"), new_handle("buf")
        worker.call(RegisterSegment(seg, 4096), session, fd)
        with pytest.raises(InvalidArgument, match="already in use"):
            worker.call(RegisterSegment(seg, 4096), session, fd)
        ack = worker.batch(session, Allocate(buf, 1024), CopyShared(seg, 0, (buf, 0), 0, 1024, True),
                           CopyShared(seg, 1024, (buf, 0), 0, 1024, False))
        assert ack.error is None
        assert os.pread(fd, 1024, 1024) == np.arange(256, dtype=np.float32).tobytes()
        ack = worker.batch(session, CopyShared(seg, 4000, (buf, 0), 0, 200, True))
        assert ack.error is not None and ack.error.code == "OUT_OF_RANGE"
        worker.call(ReleaseSegment(seg), session)
        ack = worker.batch(session, CopyShared(seg, 0, (buf, 0), 0, 4, True))
        assert ack.error is not None and ack.error.message == f"no segment {seg!r} in this session"
    finally:
        os.close(fd)


# -- links ---------------------------------------------------------------------------------------------------


def _attach(worker: Worker, session: str) -> socket.socket:
    ours, theirs = socket.socketpair()
    ours.settimeout(30)
    try:
        assert worker.call(AttachLink(), session, theirs.fileno()) is None
    finally:
        theirs.close()  # the worker holds its own copy
    hello = msgpack.unpackb(recv_payload(ours))
    assert hello[:2] == [0, 0] and hello[2]["link"] == 1 and hello[2]["max_frame"] > 1 << 20
    return ours


def test_a_link_serves_batches_under_the_lease(worker: Worker, session: str) -> None:
    kernel, buf = _scale_kernel(worker, session), new_handle("buf")
    link = _attach(worker, session)
    with link:
        x = np.arange(N, dtype=np.float32)
        send_payload(link, encode(Batch(5, 0, [Allocate(buf, x.nbytes), Write((buf, 0), 0, x.tobytes()),
                                        _launch(kernel, buf, 2.0), Read((buf, 0), 0, x.nbytes)])))
        # Without the tenant's turn the worker only asks for it; the batch waits.
        wait_for(lambda: worker.control == ["want"], 10, "the worker's lease request")
        link.setblocking(False)
        with pytest.raises(BlockingIOError):
            link.recv(1)
        link.settimeout(30)
        worker.run(worker.client.send_control(Grant()))
        ack = decode_ack(recv_payload(link))
        assert ack.id == 5 and ack.error is None and ack.done == 4
        assert np.array_equal(np.frombuffer(ack.result, np.float32), x * 2)
        # Holding the turn, a batch runs at once; a failure is reported by its sequence number.
        send_payload(link, encode(Batch(6, 4, [_launch(kernel, buf, 2.0), Read((buf, 0), 4 * N, 4)])))
        ack = decode_ack(recv_payload(link))
        assert (ack.id, ack.done, ack.error.seq, ack.error.command) == (6, 1, 5, "read of 4 bytes")
        # Others wait: the worker gives the turn back; the next batch asks again and runs once granted.
        worker.run(worker.client.send_control(Yield()))
        wait_for(lambda: worker.control == ["want", "released"], 10, "the turn given back")
        send_payload(link, encode(Batch(7, 6, [Read((buf, 0), 0, 8)])))
        wait_for(lambda: worker.control[-1] == "want", 10, "a second lease request")
        worker.run(worker.client.send_control(Grant()))
        assert decode_ack(recv_payload(link)).result == (x[:2] * 4).tobytes()
        worker.run(worker.client.send_control(Revoke()))
        wait_for(lambda: worker.control[-1] == "released", 10, "the turn revoked")


def test_a_link_refuses_front_only_commands_and_malformed_frames(worker: Worker, session: str) -> None:
    link = _attach(worker, session)
    worker.control.clear()
    with link:
        send_payload(link, encode(Batch(1, 0, [Allocate(new_handle("buf"), 8), LoadModule(new_handle("module"),
                                                                                      "opencl_c", SCALE)])))
        wait_for(lambda: worker.control == ["want"], 10, "the worker's lease request")
        worker.run(worker.client.send_control(Grant()))
        ack = decode_ack(recv_payload(link))
        assert ack.done == 1 and ack.error is not None and ack.error.seq == 1
        assert ack.error.code == "INVALID_ARGUMENT" and "cannot be sent on a link" in ack.error.message
        send_payload(link, b"\x92\x01")  # no batch: answered with Ack id 0, then the link is closed
        ack = decode_ack(recv_payload(link))
        assert ack.id == 0 and ack.done == 0 and ack.error is not None and ack.error.code == "INVALID_ARGUMENT"
        with pytest.raises(EOFError):
            recv_payload(link)
    big = _attach(worker, session)
    with big:
        big.sendall(FRAME_HEADER.pack(1 << 30))  # refused from its header, before a byte of it is read
        ack = decode_ack(recv_payload(big))
        assert ack.id == 0 and ack.error is not None and "over the link's limit" in ack.error.message
        with pytest.raises(EOFError):
            recv_payload(big)
    worker.run(worker.client.send_control(Revoke()))
    wait_for(lambda: worker.control[-1] == "released", 10, "the turn revoked")


def test_closing_the_session_closes_its_links_and_frees_its_memory(worker: Worker, session: str) -> None:
    links = [_attach(worker, session) for _ in range(8)]
    ours, theirs = socket.socketpair()
    with ours, theirs, pytest.raises(Exception, match="already has 8 links"):
        worker.call(AttachLink(), session, theirs.fileno())
    worker.batch(session, Allocate(new_handle("buf"), 1000))
    assert worker.call(CloseSession(), session) == 1
    for link in links:
        with link, pytest.raises(EOFError):
            recv_payload(link)
    assert session not in worker.call(Usage()).sessions


def test_a_link_must_be_a_stream_socket(worker: Worker, session: str) -> None:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    with ours, theirs, pytest.raises(InvalidArgument, match="must be a Unix or vsock stream socket"):
        worker.call(AttachLink(), session, theirs.fileno())


def test_a_link_that_ends_while_its_batches_wait_still_gets_their_acks_in_order(worker: Worker, session: str) -> None:
    worker.control.clear()
    buf = new_handle("buf")
    with _attach(worker, session) as link:
        # Batches, then a malformed frame, then the client's end, all before the worker holds the turn.
        send_payload(link, encode(Batch(1, 0, [Allocate(buf, 64)])))
        send_payload(link, encode(Batch(2, 1, [Read((buf, 0), 0, 4)])))
        send_payload(link, b"\xc1")
        link.shutdown(socket.SHUT_WR)
        wait_for(lambda: worker.control == ["want"], 10, "the worker's lease request")
        worker.run(worker.client.send_control(Grant()))
        assert [decode_ack(recv_payload(link)).id for _ in range(3)] == [1, 2, 0]
        with pytest.raises(EOFError):
            recv_payload(link)
    worker.run(worker.client.send_control(Revoke()))
    wait_for(lambda: worker.control[-1] == "released", 10, "the turn revoked")
    assert worker.call(Usage()).sessions[session] == 64  # the batches ran


def test_a_paced_batch_stops_for_a_revoke_and_goes_on_at_the_next_grant(worker: Worker, session: str) -> None:
    """Others wait (a Yield came): the worker paces its link batches, and a Revoke mid-batch ends its turn after at
    most the kernel in hand, not after the whole batch; the batch goes on at the next grant, answered once, whole."""
    with open_backend("opencl", 0) as gpu:  # (the worker's device, measured in this process)
        probe = gpu.compile_kernel(samples.source("opencl"), "spin")
        iters = spin_iterations(gpu, probe, gpu.allocate_memory(4), 0.02)
    module, spin, scale, buf = new_handle("module"), new_handle("kernel"), new_handle("kernel"), new_handle("buf")
    ack = worker.batch(session, LoadModule(module, "opencl_c", samples.source("opencl").encode()),
                       GetKernel(spin, module, "spin"), GetKernel(scale, module, "scale_inplace"))
    assert ack.error is None
    worker.control.clear()
    link = _attach(worker, session)
    with link:
        send_payload(link, encode(Batch(1, 0, [Allocate(buf, 4 * N), Memset((buf, 0), 0, 4 * N)])))
        wait_for(lambda: worker.control == ["want"], 10, "the worker's lease request")
        worker.run(worker.client.send_control(Grant()))
        assert decode_ack(recv_payload(link)).done == 2
        worker.run(worker.client.send_control(Yield()))  # others wait: the turn goes back, pacing starts
        wait_for(lambda: worker.control == ["want", "released"], 10, "the turn given back")
        # Six 20 ms kernels (each also doubles x and adds 1), then the result: a batch of some 120 ms.
        n = np.int32(N).tobytes()
        steps: list[Command] = []
        for _ in range(6):
            steps += [Launch(spin, (1,), (1,), [BufferArg(buf, 0), ScalarArg("<i8", np.int64(iters).tobytes())]),
                      Launch(scale, (1,), (N,), [BufferArg(buf, 0), ScalarArg("<f4", np.float32(2).tobytes()),
                                                 ScalarArg("<i4", n)])]
        send_payload(link, encode(Batch(2, 2, [*steps, Read((buf, 4), 0, 4 * (N - 1))])))
        wait_for(lambda: worker.control[-1] == "want", 10, "a second lease request")
        worker.run(worker.client.send_control(Grant()))
        worker.run(worker.client.send_control(Revoke()))  # sent while the first kernels run
        wait_for(lambda: worker.control == ["want", "released", "want", "released", "want"], 10,
                 "the turn given back mid-batch")
        link.setblocking(False)
        with pytest.raises(BlockingIOError):
            link.recv(1)  # no answer: the batch stopped, and asked for the turn to go on
        link.settimeout(30)
        worker.run(worker.client.send_control(Grant()))
        ack = decode_ack(recv_payload(link))
        assert (ack.id, ack.done, ack.error) == (2, 13, None)
        assert np.array_equal(np.frombuffer(ack.result, np.float32), np.full(N - 1, 63, np.float32))
    worker.run(worker.client.send_control(Revoke()))
    wait_for(lambda: worker.control[-1] == "released", 10, "the turn revoked")


def test_batches_that_came_while_one_was_stopped_run_once_it_ends(worker: Worker, session: str) -> None:
    """A paced batch stops for any message of the front's (a request here, not a revoke) and goes on once it is
    answered; a batch that came on another link meanwhile runs right after it, in the same turn."""
    with open_backend("opencl", 0) as gpu:
        probe = gpu.compile_kernel(samples.source("opencl"), "spin")
        iters = spin_iterations(gpu, probe, gpu.allocate_memory(4), 0.02)
    module, spin, buf = new_handle("module"), new_handle("kernel"), new_handle("buf")
    ack = worker.batch(session, LoadModule(module, "opencl_c", samples.source("opencl").encode()),
                       GetKernel(spin, module, "spin"))
    assert ack.error is None
    worker.control.clear()
    with _attach(worker, session) as first, _attach(worker, session) as second:
        send_payload(first, encode(Batch(1, 0, [Allocate(buf, 64)])))
        wait_for(lambda: worker.control == ["want"], 10, "the worker's lease request")
        worker.run(worker.client.send_control(Grant()))
        assert decode_ack(recv_payload(first)).done == 1
        worker.run(worker.client.send_control(Yield()))  # others wait: the turn goes back, pacing starts
        wait_for(lambda: worker.control == ["want", "released"], 10, "the turn given back")
        launch = Launch(spin, (1,), (1,), [BufferArg(buf, 0), ScalarArg("<i8", np.int64(iters).tobytes())])
        send_payload(first, encode(Batch(2, 1, [launch] * 6)))  # some 120 ms
        send_payload(second, encode(Batch(3, 0, [Memset((buf, 0), 0, 4)])))
        wait_for(lambda: worker.control[-1] == "want", 10, "a second lease request")
        worker.run(worker.client.send_control(Grant()))
        assert worker.call(Usage()).sessions[session] == 64  # answered mid-batch: the batch stopped for it
        ack = decode_ack(recv_payload(first))
        assert (ack.id, ack.done, ack.error) == (2, 6, None)
        second.settimeout(10)  # (no second grant comes: the batch runs in this turn, or never)
        ack = decode_ack(recv_payload(second))
        assert (ack.id, ack.done, ack.error) == (3, 1, None)
    worker.run(worker.client.send_control(Revoke()))
    wait_for(lambda: worker.control[-1] == "released", 10, "the turn revoked")


def test_every_command_has_one_handler_and_links_take_only_link_commands() -> None:
    backend = open_backend("opencl", 0)
    try:
        executor = Executor(backend, HandleTables(), SegmentTable(backend))
        assert set(executor.handlers) == set(commands())
        assert set(executor.link_handlers) == link_commands()
    finally:
        backend.close()
