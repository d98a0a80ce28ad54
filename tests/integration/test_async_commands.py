"""Asynchronous batched commands: order per stream, deferred errors that name the command, back-pressure."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator

import numpy as np
import pytest

from gpubroker.broker import samples
from gpubroker.broker.launcher import BrokerProcess
from gpubroker.client import InvalidArgument, NotFound, RemoteGpu, connect
from gpubroker.client._commands import CommandStream
from gpubroker.v1 import broker_pb2 as pb

# Batches straight to the worker (direct link); through the front's fast path; on the gRPC Commands stream.
_PATHS = {"direct": {}, "front": {"direct": False}, "grpc": {"fast_path": False}}


@pytest.fixture(scope="module", params=list(_PATHS))
def gpu(broker: BrokerProcess, request: pytest.FixtureRequest) -> Iterator[RemoteGpu]:
    with connect(broker.target, token=broker.tokens["carol"], async_commands=True, **_PATHS[request.param]) as g:
        assert (g._direct is not None) == (request.param == "direct")
        yield g


def test_order_holds_under_10000_interleaved_commands_on_several_streams(gpu: RemoteGpu) -> None:
    kernel = gpu.compile_kernel(samples.source(gpu.device_info().backend), "scale_inplace")
    n = 256
    streams = [gpu.create_stream() for _ in range(3)]
    bufs = [gpu.allocate_memory(n * 4) for _ in streams]
    expected = [np.zeros(n, dtype=np.float32) for _ in streams]
    for buf in bufs:
        gpu.memset(buf, 0)
    rng = np.random.default_rng(10_000)
    for choice, op in zip(rng.integers(0, 3, 10_000), rng.integers(0, 10, 10_000), strict=True):
        s, buf, want = streams[choice], bufs[choice], expected[choice]
        if op == 0:
            gpu.memset(buf, 0, stream=s)
            want[:] = 0
        else:
            factor = np.float32(-1.0 if op % 2 else 1.0)  # x -> x + 1 or 1 - x: any reordering shows
            gpu.execute_kernel(kernel, 1, n, [buf, factor, np.int32(n)], stream=s)
            want[:] = want * factor + np.float32(1.0)
    gpu.synchronize()
    for buf, want in zip(bufs, expected, strict=True):
        out = np.empty(n, dtype=np.float32)
        gpu.copy_d2h(buf, out)
        np.testing.assert_array_equal(out, want)
    for s in streams:
        gpu.destroy_stream(s)


def test_error_in_a_batch_surfaces_at_the_next_synchronize_naming_the_command(gpu: RemoteGpu) -> None:
    kernel = gpu.compile_kernel(samples.source(gpu.device_info().backend), "scale_inplace")
    buf = gpu.allocate_memory(64 * 4)
    gpu.memset(buf, 0)
    gpu.execute_kernel(kernel, 1, 64, [buf, np.float32(1), np.int32(64)])  # runs
    gpu.execute_kernel(kernel, 1, 64, [buf, np.float32(1)])  # one argument short: fails on the broker
    gpu.execute_kernel(kernel, 1, 64, [buf, np.float32(1), np.int32(64)])  # same batch, after the failure
    with pytest.raises(InvalidArgument, match=r"command \d+ \(launch of 'scale_inplace'\) failed") as info:
        gpu.synchronize()
    assert info.value.details["command"] == "launch of 'scale_inplace'"
    gpu.synchronize()  # reported once
    out = np.empty(64, dtype=np.float32)
    gpu.copy_d2h(buf, out)
    np.testing.assert_array_equal(out, 1.0)  # the command before the failure ran; the rest of its batch did not
    gpu.execute_kernel(kernel, 1, 64, [buf, np.float32(1), np.int32(64)])  # later batches work
    gpu.synchronize()
    gpu.copy_d2h(buf, out)
    np.testing.assert_array_equal(out, 2.0)


def test_unknown_handle_in_a_batch_is_deferred_too(gpu: RemoteGpu) -> None:
    from gpubroker.client import Buffer

    gpu.memset(Buffer("buf_invented", 64), 0)
    with pytest.raises(NotFound, match="memset"):
        gpu.synchronize()


def test_unacknowledged_batches_are_bounded() -> None:
    """The client blocks once `window` batches wait for acknowledgement: back-pressure, not a growing queue."""
    received: queue.Queue[pb.CommandBatch] = queue.Queue()
    release = threading.Semaphore(0)

    def fake_stream(batches: Iterator[pb.CommandBatch]) -> Iterator[pb.BatchAck]:
        def pump() -> None:
            for batch in batches:
                received.put(batch)
        threading.Thread(target=pump, daemon=True).start()
        while True:
            release.acquire()
            batch = received.get()
            yield pb.BatchAck(batch=batch.batch)

    stream = CommandStream(fake_stream, "ses_x", batch_size=1, window=2)
    stream.submit(memset=pb.MemsetRequest())
    stream.submit(memset=pb.MemsetRequest())  # two in flight: the window is full
    third_sent = threading.Event()

    def third() -> None:
        stream.submit(memset=pb.MemsetRequest())
        third_sent.set()

    t = threading.Thread(target=third)
    t.start()
    assert not third_sent.wait(0.3)  # blocked by back-pressure
    release.release()  # acknowledge one batch
    assert third_sent.wait(5)
    release.release()
    release.release()
    stream.wait(raise_error=True)
    t.join()
