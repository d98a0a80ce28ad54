"""A tenant's Commands streams whose acknowledgements it never reads hold no more of the front than its budget of
unsent replies (``max_unsent_reply_bytes_per_tenant``), however many streams it opens.

The hole it closes (issue 21): a ``Commands`` stream reads up to READ_AHEAD (4) batches ahead and runs them; the
tenant's read-ahead budget counts a batch's REQUEST bytes until it has run. A ``Read`` is a few bytes of request
whose ack carries up to ``max_message_bytes`` of data, and HTTP/2 flow control stops gRPC sending acks a client
does not read, not the front running its batches and keeping their results: 16 streams of one session, each four
batches of one 4 MiB ``Read`` and its acks unread, grew the front +292-385 MiB (64 streams +1.5 GiB, ~6 GiB at
``max_inflight_per_tenant``). Now a batch takes its ack's bytes (its Reads' sizes) from the tenant's reply budget
before it runs and gives them back once gRPC has written the ack out: a stream whose client does not read stops
running batches (test_copy_chunks_unread.py: the same for ``CopyDeviceToHost`` chunks).

(gRPC's BDP probing is off in the client so that its window stays 64 KiB: what it does not read stays in the
front.)
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

import grpc
import pytest

from gpubroker.broker.launcher import BrokerProcess, TenantSpec
from gpubroker.v1 import broker_pb2 as pb
from gpubroker.v1 import broker_pb2_grpc as pb_grpc
from gpubroker.wire.commands import Batch, Read, encode

from ._probes import tenant_credentials

STREAMS = 16  # in one session: within max_concurrent_rpcs_per_session (32)
BATCHES = 4  # per stream: its READ_AHEAD
READ = 4 * 1024**2 - 4096  # one Read per batch: its ack just under max_message_bytes (4 MiB)
BUDGET = 16 * 1024**2  # max_read_ahead_bytes_per_tenant and max_unsent_reply_bytes_per_tenant
# What the tenant's streams may hold of the front: its budgets a few times over (copies of the acks in the worker
# client, the front and gRPC), plus the streams' own state. Measured: unfixed 292-385 MiB; fixed ~40 MiB.
ALLOWED_GROWTH = 6 * BUDGET
# How long the client leaves the acks unread while the front's memory is watched: the front's growth reached its
# peak within 0.1 s on a 2-core VM (it reads from the worker at hundreds of MiB/s, so the unfixed front passes
# ALLOWED_GROWTH within a fraction of a second too); 3 s is many times that.
STALL_SECONDS = 3.0


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerProcess]:
    tmp = tmp_path_factory.mktemp("acks")
    settings = {"cache_dir": str(tmp / "caches"), "max_read_ahead_bytes_per_tenant": BUDGET,
                "max_unsent_reply_bytes_per_tenant": BUDGET}
    with BrokerProcess([TenantSpec("alice", memory_quota=256 * 1024**2)], backend="opencl",
                       settings=settings) as proc:
        yield proc


def _rss(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return next(int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("VmRSS:"))


def test_unread_acks_of_a_tenants_read_batches_are_bounded(broker: BrokerProcess) -> None:
    assert broker.process is not None
    pid = broker.process.pid
    credentials = tenant_credentials(broker, "alice")
    # (no BDP probing: the client's window stays 64 KiB, so what it does not read stays in the front)
    with grpc.secure_channel(broker.target, credentials, options=[("grpc.http2.bdp_probe", 0)]) as channel:
        stub = pb_grpc.GpuBrokerStub(channel)
        session = stub.OpenSession(pb.OpenSessionRequest(device=0), timeout=60).session
        buf = stub.Allocate(pb.AllocateRequest(session=session, size=4 * 1024**2), timeout=60).handle
        done = threading.Event()

        def batches() -> Iterator[pb.CommandBatch]:
            for k in range(BATCHES):
                yield pb.CommandBatch(session=session if k == 0 else "", batch=k + 1,
                                      encoded=encode(Batch(k + 1, k, [Read((buf, 0), 0, READ)])))
            done.wait(60)  # (the stream stays open, its acks unread, until the test takes them)

        before = peak = _rss(pid)
        calls = [stub.Commands(batches(), timeout=120) for _ in range(STREAMS)]
        try:
            deadline = time.monotonic() + STALL_SECONDS
            while time.monotonic() < deadline and peak - before <= 3 * ALLOWED_GROWTH:  # (then it has failed)
                peak = max(peak, _rss(pid))
                time.sleep(0.05)
            done.set()
            # The batches do run: every stream gives its acks once the client reads them (all at once: one stream's
            # batches wait for the others' acks to be taken).
            with ThreadPoolExecutor(STREAMS) as pool:
                acks = list(pool.map(lambda call: sum(1 for ack in call if not ack.HasField("error")), calls))
        finally:
            done.set()
            for call in calls:
                call.cancel()
    growth = peak - before
    print(f"\n{STREAMS} Commands streams of one session, each {BATCHES} Read batches of {READ / 2**20:.1f} MiB and its "
          f"acks unread: the front grew {before >> 20} -> {peak >> 20} MiB (+{growth >> 20} MiB; the tenant's "
          f"reply budget {BUDGET >> 20} MiB); acks taken afterwards: {sum(acks)} of {STREAMS * BATCHES}")
    assert sum(acks) == STREAMS * BATCHES
    assert growth <= ALLOWED_GROWTH, (
        f"a tenant's unread acks grew the front by {growth >> 20} MiB ({STREAMS} streams), past "
        f"{ALLOWED_GROWTH >> 20} MiB (its reply budget {BUDGET >> 20} MiB)")


def test_acks_abandoned_unread_give_their_budget_back(broker: BrokerProcess) -> None:
    """Streams cancelled with their acks unread leave nothing of the tenant's reply budget held: a stream after
    them still runs its Reads (a budget left held would stall it until its deadline)."""
    credentials = tenant_credentials(broker, "alice")
    with grpc.secure_channel(broker.target, credentials, options=[("grpc.http2.bdp_probe", 0)]) as channel:
        stub = pb_grpc.GpuBrokerStub(channel)
        session = stub.OpenSession(pb.OpenSessionRequest(device=0), timeout=60).session
        buf = stub.Allocate(pb.AllocateRequest(session=session, size=4 * 1024**2), timeout=60).handle
        for _ in range(3):
            stop = threading.Event()

            def batches(count: int, stop: threading.Event = stop) -> Iterator[pb.CommandBatch]:
                for k in range(count):
                    yield pb.CommandBatch(session=session if k == 0 else "", batch=k + 1,
                                          encoded=encode(Batch(k + 1, k, [Read((buf, 0), 0, READ)])))
                stop.wait(60)

            calls = [stub.Commands(batches(BATCHES), timeout=60) for _ in range(STREAMS)]
            with ThreadPoolExecutor(STREAMS) as pool:
                firsts = [pool.submit(next, call) for call in calls]
                # (the batches run, the budget taken: a first ack has come; the others wait unread)
                first = next(as_completed(firsts, timeout=60)).result()
                assert not first.HasField("error")
                for call in calls:
                    call.cancel()  # (which ends the other threads' waits)
            stop.set()
        done = threading.Event()
        done.set()
        acks = list(stub.Commands(batches(2 * BATCHES, done), timeout=60))
        assert len(acks) == 2 * BATCHES and not any(ack.HasField("error") for ack in acks)
