"""A per-call timeout is not honoured once four waits have timed out, and the commands queued before the fifth are lost.

The hole (issue 24's per-call timeouts, attacked over every transport): ``BatchingTransport.call``
(client/_transports/_core.py) sends the call's batch with ``_flush`` BEFORE it computes its own deadline and outside
its ``try``; ``_send_batch`` first waits for room in the window (4 unacknowledged batches) with ``_read_ack()``,
which uses the session's ``timeout``, not the call's. A ``synchronize(timeout=)`` that expires leaves its batch
unacknowledged (by design: "the session goes on"), so after 4 of them the window is full and:

1. the 5th ``synchronize(timeout=0.1)`` waits the session's whole ``timeout`` (measured: 3.00 s with
   ``connect(timeout=3)``; with the default 300 s, 300 s; with ``timeout=None``, for ever behind an endless
   kernel: Ctrl-C is then the only way out), and ``synchronize(timeout=60)`` (the message's own advice: "wait
   again, with a longer timeout=") gives up after the session's 3 s instead;
2. the DeadlineExceeded raised there comes from ``_send_batch`` after ``_flush`` took the pending commands off
   ``_pending``: the commands queued before the wait (``async_commands``: a memset, launches, frees) and the wait
   itself are never sent, and nothing reports it: the message still says "the work is still running and the
   session goes on". Measured: a ``memset(buf, 7)`` queued then is silently dropped; the later
   ``synchronize(timeout=60)`` succeeds and the buffer does not hold 7s.

Measured over "ring" and "grpc" alike (the one batching core). Only the tenant's own session is hurt (no
cross-tenant effect), but a timeout that does not bound the wait, and commands dropped without an error, break
issue 24's contract ("after DeadlineExceeded the session must stay usable").

Suggested fix: compute the call's ``end`` first and pass it (and ``limit``) to the window's wait in
``_send_batch``; and never drop what ``_flush`` took: put the commands back on ``_pending`` (or keep them queued
until sent) when the wait for room raises, so the next wait sends them.

The fix (client/_transports/_core.py): the call's bound is set before its flush, which waits for room in the window
within it; past it DeadlineExceeded with the queued commands back on the queue (sent by the next flush) and the
call's own command withdrawn.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np
import pytest

from gpubroker.broker import samples
from gpubroker.broker.launcher import BrokerProcess, TenantSpec
from gpubroker.client import DeadlineExceeded, RemoteGpu, connect

from ..helpers import spin_iterations

ENDLESS = 1 << 50


@pytest.fixture(scope="module")
def broker() -> Iterator[BrokerProcess]:
    settings = {"lone_kernel_seconds": 3600.0}
    with BrokerProcess([TenantSpec("alice"), TenantSpec("bob")], backend="opencl", settings=settings) as proc:
        yield proc


def _spin(gpu: RemoteGpu) -> tuple[object, object]:
    kernel, buf = gpu.compile_kernel(samples.source("opencl"), "spin"), gpu.allocate_memory(4096)
    gpu.execute_kernel(kernel, 1, 1, [buf, np.int64(1)])  # type: ignore[arg-type]
    gpu.synchronize()  # (the first launch builds the kernel)
    return kernel, buf


@pytest.mark.parametrize("transport", ["ring", "grpc"])
def test_every_timed_wait_is_bounded_by_its_own_timeout(broker: BrokerProcess, transport: str) -> None:
    gpu = connect(broker.target, token=broker.tokens["alice"], transport=transport, timeout=5.0)
    try:
        kernel, buf = _spin(gpu)
        gpu.execute_kernel(kernel, 1, 1, [buf, np.int64(ENDLESS)])  # type: ignore[arg-type]
        took = []
        for _ in range(6):
            start = time.monotonic()
            with pytest.raises(DeadlineExceeded):
                gpu.synchronize(timeout=0.2)
            took.append(round(time.monotonic() - start, 2))
        # measured: [0.2, 0.2, 0.2, 0.2, 5.0, 5.0] (the 5th and later wait the session's timeout)
        assert max(took) < 1.5, took
    finally:
        gpu.cancel()


@pytest.mark.parametrize("transport", ["ring", "grpc"])
def test_commands_queued_before_a_timed_out_wait_are_not_lost(broker: BrokerProcess, transport: str) -> None:
    gpu = connect(broker.target, token=broker.tokens["bob"], transport=transport, timeout=3.0, async_commands=True)
    try:
        kernel, buf = _spin(gpu)
        iters = spin_iterations(gpu, kernel, buf, seconds=6.0)
        gpu.execute_kernel(kernel, 1, 1, [buf, np.int64(iters)])  # type: ignore[arg-type]
        ends = time.monotonic() + 8.0
        for _ in range(4):
            with pytest.raises(DeadlineExceeded):
                gpu.synchronize(timeout=0.1)  # the window fills with unacknowledged waits
        gpu.memset(buf, 7)  # queued (async_commands)
        with pytest.raises(DeadlineExceeded):
            gpu.synchronize(timeout=0.1)  # "the work is still running and the session goes on"
        time.sleep(max(0.0, ends - time.monotonic()))  # the kernel has finished
        gpu.synchronize(timeout=60)
        out = bytearray(4096)
        gpu.copy_d2h(buf, out)
        # (the spin kernel writes only the buffer's first float; the memset, queued after it, all of it)
        assert bytes(out[4:]) == b"\x07" * 4092, "the memset queued before the timed-out wait was never sent"
    finally:
        gpu.cancel()
