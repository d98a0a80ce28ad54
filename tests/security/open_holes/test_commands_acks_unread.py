"""A tenant's Commands streams whose acknowledgements it never reads grow the front ~24 MiB a stream, past every
per-tenant bound (its read-ahead budget, its memory quota): 1.5 GiB for 64 streams of one token.

The hole: a ``Commands`` stream reads up to READ_AHEAD (4) batches ahead and runs them; the tenant's read-ahead
budget (``max_read_ahead_bytes_per_tenant``) counts a batch's REQUEST bytes until it has run. A ``Read`` command is a
few bytes of request whose acknowledgement carries up to ``max_message_bytes`` of data, so four tiny batches each
reading 4 MiB make four 4 MiB acks, which the front holds (the worker's reply, the BatchAck built from it, its
serialised copy in gRPC) for as long as the client does not take them: HTTP/2 flow control stops gRPC sending,
nothing stops the front running the batches and keeping their results. Every stream is a call within the limits
(``max_concurrent_rpcs_per_session`` 32, ``max_inflight_per_tenant`` 256), so one token holds up to 256 of them.
``test_front_limits.py`` bounds the read-ahead of Write batches (big requests), not of Read batches (big replies).

Measured (2-core VM, PoCL; alice with a 256 MiB quota, ``max_read_ahead_bytes_per_tenant`` 16 MiB, one 4 MiB
buffer per session, each stream sending 4 batches of one ``Read`` of 4 MiB - 4 KiB and reading nothing, gRPC's BDP
probing off in the client so that the client's own window stays 64 KiB): 16 streams in one session grew the front
71 -> 456 MiB (+385 MiB, ~24 MiB a stream); 64 streams in two sessions +1,539 MiB. At ``max_inflight_per_tenant``
(256): ~6 GiB for one tenant, and as much for each other tenant. The same holds, smaller, for
``CopyDeviceToHost`` streams whose chunks are not read (READ_DEPTH 3 chunks read ahead per call): 16 calls reading
a 64 MiB buffer, nothing read, +97 MiB (~6 MiB a call; ~1.5 GiB at 256).

Suggested fix: count what a stream holds for its client (acks computed and not yet taken: their result bytes)
against the same per-tenant read-ahead budget as the batches coming in, and run a batch whose reply would exceed it
only once the client has taken the acks before it (a Read's size is known from its command before it runs); or
hold at most one unsent ack per stream (READ_AHEAD for requests, 1 for replies).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from gpubroker.broker.launcher import BrokerProcess, TenantSpec
from gpubroker.v1 import broker_pb2 as pb
from gpubroker.v1 import broker_pb2_grpc as pb_grpc
from gpubroker.wire.commands import Batch, Read, encode

STREAMS = 16  # in one session: within max_concurrent_rpcs_per_session (32)
BATCHES = 4  # per stream: its READ_AHEAD
READ = 4 * 1024**2 - 4096  # one Read per batch: its ack just under max_message_bytes (4 MiB)
BUDGET = 16 * 1024**2  # max_read_ahead_bytes_per_tenant
# What the tenant's streams may hold of the front: its read-ahead budget a few times over (copies of it in gRPC and
# the front), plus the streams' own state. Unfixed: 385 MiB.
ALLOWED_GROWTH = 6 * BUDGET
STALL_SECONDS = 8.0  # how long the client leaves the acks unread while the front's memory is watched


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerProcess]:
    tmp = tmp_path_factory.mktemp("acks")
    settings = {"cache_dir": str(tmp / "caches"), "max_read_ahead_bytes_per_tenant": BUDGET}
    with BrokerProcess([TenantSpec("alice", memory_quota=256 * 1024**2)], backend="opencl",
                       settings=settings) as proc:
        yield proc


def _rss(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return next(int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("VmRSS:"))


def test_unread_acks_of_a_tenants_read_batches_are_bounded(broker: BrokerProcess) -> None:
    assert broker.process is not None
    pid = broker.process.pid
    credentials = grpc.composite_channel_credentials(grpc.local_channel_credentials(grpc.LocalConnectionType.UDS),
                                                     grpc.access_token_call_credentials(broker.tokens["alice"]))
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
            # The batches did run: every stream gives its acks once the client reads them.
            acks = [sum(1 for ack in call if not ack.HasField("error")) for call in calls]
        finally:
            done.set()
            for call in calls:
                call.cancel()
    growth = peak - before
    print(f"\n{STREAMS} Commands streams of one session, each {BATCHES} Read batches of {READ / 2**20:.1f} MiB and its "
          f"acks unread: the front grew {before >> 20} -> {peak >> 20} MiB (+{growth >> 20} MiB; the tenant's "
          f"read-ahead budget {BUDGET >> 20} MiB); acks taken afterwards: {sum(acks)} of {STREAMS * BATCHES}")
    assert growth <= ALLOWED_GROWTH, (
        f"a tenant's unread acks grew the front by {growth >> 20} MiB ({STREAMS} streams), past "
        f"{ALLOWED_GROWTH >> 20} MiB (its read-ahead budget {BUDGET >> 20} MiB)")
