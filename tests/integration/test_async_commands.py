"""Asynchronous batched commands on every transport: order per stream, deferred errors that name the command,
queued allocations and frees (client-chosen handles); back-pressure is tested in tests/client/test_transports.py."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from gpubroker.broker import samples
from gpubroker.client import InvalidArgument, NotFound, RemoteGpu, ResourceExhausted

from ..conftest import TRANSPORTS, OpenGpu


# Batches straight to the worker through the same-host ring and on the same-host link, relayed by the front on
# the TCP link, inside gRPC's Commands stream.
@pytest.fixture(scope="module", params=TRANSPORTS)
def gpu(open_gpu: OpenGpu, request: pytest.FixtureRequest) -> Iterator[RemoteGpu]:
    with open_gpu("carol", request.param, async_commands=True) as g:
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
    # Everything answered: the two below go out as one batch on every transport (the ring sends two queued
    # commands at once to a worker that has answered everything; the others wait for 16, or the synchronize).
    gpu.synchronize()
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


def test_a_chain_of_allocations_launches_and_frees_never_waits_for_a_round_trip(
        gpu: RemoteGpu, monkeypatch: pytest.MonkeyPatch) -> None:
    kernel = gpu.compile_kernel(samples.source(gpu.device_info().backend), "scale_inplace")
    gpu.synchronize()
    carrier = gpu.transport.carrier  # type: ignore[attr-defined]
    acks: list[object] = []
    receive = carrier.receive
    monkeypatch.setattr(carrier, "receive", lambda *args: (acks.append(1), receive(*args))[1])
    stream = gpu.create_stream()
    buf = gpu.allocate_memory(64 * 4)  # handles are the client's: usable before the broker has seen them
    gpu.memset(buf, 0, stream=stream)
    gpu.execute_kernel(kernel, 1, 64, [buf, np.float32(1), np.int32(64)], stream=stream)
    scratch = gpu.allocate_memory(1024)
    gpu.free_memory(scratch)
    assert acks == []  # nothing waited for an answer
    gpu.synchronize()
    assert len(acks) >= 1
    out = np.empty(64, dtype=np.float32)
    gpu.copy_d2h(buf, out)
    np.testing.assert_array_equal(out, 1.0)
    gpu.free_memory(buf)
    gpu.destroy_stream(stream)


def test_an_over_quota_allocation_fails_at_the_next_synchronize_naming_it(gpu: RemoteGpu) -> None:
    big = gpu.allocate_memory(128 << 20)  # carol's quota is 64 MiB: returns at once, refused by the worker
    with pytest.raises(ResourceExhausted, match=r"\(allocate of 134217728 bytes\) failed: .*quota"):
        gpu.synchronize()
    with pytest.raises(NotFound, match="no buf"):  # it never existed
        gpu.memset(big, 0)
        gpu.synchronize()
    gpu.free_memory(big)  # nothing to free, and no second error for it (as cudaFree of a failed cudaMalloc's NULL)
    gpu.synchronize()
    small = gpu.allocate_memory(4096)  # the session goes on
    gpu.memset(small, 1)
    gpu.synchronize()
    gpu.free_memory(small)
    gpu.synchronize()
