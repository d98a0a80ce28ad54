"""Events through a broker on every transport: a stream waits on the device for another stream's event, the host
waits for one, and an event is the session's own (an unknown, destroyed or foreign one is NOT_FOUND)."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from gpubroker.broker import samples
from gpubroker.client import Event, Kernel, NotFound, RemoteGpu

from ..conftest import TRANSPORTS, OpenGpu

N = 256
ITERS = np.int64(100_000)  # enough that a read which did not wait for the spin would see the memset's zeros


@pytest.fixture(scope="module", params=TRANSPORTS)
def transport(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def gpu(open_gpu: OpenGpu, transport: str) -> Iterator[RemoteGpu]:
    # Queued commands: record and wait must order the streams on the device, not by round trips.
    with open_gpu("alice", transport, async_commands=True) as g:
        yield g


@pytest.fixture(scope="module")
def spin(gpu: RemoteGpu) -> Kernel:
    return gpu.compile_kernel(samples.source(gpu.device_info().backend), "spin")


def test_a_stream_waits_for_another_streams_event_then_reads_what_it_wrote(gpu: RemoteGpu, spin: Kernel) -> None:
    a, b = gpu.create_stream(), gpu.create_stream()
    ref, buf = gpu.allocate_memory(N * 4), gpu.allocate_memory(N * 4)
    ev = gpu.create_event()
    gpu.memset(ref, 0)
    gpu.execute_kernel(spin, N // 64, 64, [ref, ITERS])
    expected = np.empty(N, dtype=np.float32)
    gpu.copy_d2h(ref, expected)
    assert np.all(expected > 0)

    gpu.memset(buf, 0)
    gpu.synchronize()
    gpu.execute_kernel(spin, N // 64, 64, [buf, ITERS], stream=a)
    gpu.record_event(ev, a)
    gpu.wait_event(ev, b)
    got = np.empty(N, dtype=np.float32)
    gpu.copy_d2h(buf, got, stream=b)
    np.testing.assert_array_equal(got, expected)
    gpu.synchronize_event(ev)

    gpu.destroy_event(ev)
    with pytest.raises(NotFound, match=f"no event '{ev.handle}' in this session"):
        gpu.synchronize_event(ev)
    for obj in (ref, buf):
        gpu.free_memory(obj)
    gpu.destroy_stream(a)
    gpu.destroy_stream(b)


def test_an_event_never_recorded_is_complete(gpu: RemoteGpu) -> None:
    ev, s = gpu.create_event(), gpu.create_stream()
    gpu.wait_event(ev, s)
    gpu.synchronize_event(ev)
    gpu.synchronize(s)
    gpu.destroy_event(ev)
    gpu.destroy_stream(s)
    gpu.synchronize()


def test_an_unknown_event_is_not_found_at_the_next_synchronize(gpu: RemoteGpu) -> None:
    ghost = Event("e" + "0" * 16)
    gpu.record_event(ghost)  # queued: its error is deferred, as a launch's is
    with pytest.raises(NotFound, match="no event 'e0000000000000000' in this session"):
        gpu.synchronize()
    with pytest.raises(NotFound, match="no event"):
        gpu.synchronize_event(ghost)
    gpu.synchronize()  # the session serves on


def test_another_sessions_event_is_not_found(gpu: RemoteGpu, open_gpu: OpenGpu, transport: str) -> None:
    ev = gpu.create_event()
    gpu.synchronize()  # created (the same tenant, so the same worker: only the session tells them apart)
    with open_gpu("alice", transport) as other:
        with pytest.raises(NotFound, match=f"no event '{ev.handle}' in this session"):
            other.synchronize_event(ev)
        with pytest.raises(NotFound, match="no event"):
            other.destroy_event(ev)
    gpu.synchronize_event(ev)  # still this session's
    gpu.destroy_event(ev)
    gpu.synchronize()
