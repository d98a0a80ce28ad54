"""A tenant's ``CopyDeviceToHost`` calls whose chunks it never reads hold no more of the front than its budget of
unsent replies (``max_unsent_reply_bytes_per_tenant``), however many calls it makes.

The hole it closes (issue 21, with test_commands_acks_unread.py): a copy reads READ_DEPTH (3) chunks ahead of the
one gRPC is sending, and HTTP/2 flow control stops gRPC sending chunks a client does not read, not the front reading
them from the worker and keeping them: 16 calls with nothing read grew the front ~6 MiB a call at 1 MiB chunks (+97
MiB), ~24 MiB a call at 4 MiB chunks. Now each chunk's bytes are taken from the tenant's reply budget before its
read starts and given back once gRPC has written it out.

(gRPC's BDP probing is off in the client so that its window stays 64 KiB: what it does not read stays in the
front.)
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from gpubroker.broker.launcher import BrokerProcess, TenantSpec
from gpubroker.v1 import broker_pb2 as pb
from gpubroker.v1 import broker_pb2_grpc as pb_grpc

from ._probes import tenant_credentials

CALLS = 16  # in one session: within max_concurrent_rpcs_per_session (32)
CHUNK = 4 * 1024**2 - 4096  # chunk_bytes: the largest the broker allows
SIZE = 8 * CHUNK  # each call's copy: more chunks than a call reads ahead
BUDGET = 16 * 1024**2  # max_unsent_reply_bytes_per_tenant
# What the tenant's calls may hold of the front: its reply budget a few times over (copies of the chunks in the
# worker client, the front and gRPC), plus the calls' own state. Measured: unfixed +305 MiB; fixed +40 MiB.
ALLOWED_GROWTH = 6 * BUDGET
# How long the client leaves the chunks unread while the front's memory is watched: the front's growth reached its
# peak within 0.1 s on a 2-core VM (it reads from the worker at hundreds of MiB/s, so the unfixed front passes
# ALLOWED_GROWTH within a fraction of a second too); 3 s is many times that.
STALL_SECONDS = 3.0


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerProcess]:
    tmp = tmp_path_factory.mktemp("chunks")
    settings = {"cache_dir": str(tmp / "caches"), "chunk_bytes": CHUNK, "max_unsent_reply_bytes_per_tenant": BUDGET}
    with BrokerProcess([TenantSpec("alice", memory_quota=256 * 1024**2)], backend="opencl",
                       settings=settings) as proc:
        yield proc


def _rss(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return next(int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("VmRSS:"))


def test_unread_chunks_of_a_tenants_copies_are_bounded(broker: BrokerProcess) -> None:
    assert broker.process is not None
    pid = broker.process.pid
    credentials = tenant_credentials(broker, "alice")
    # (no BDP probing: the client's window stays 64 KiB, so what it does not read stays in the front)
    with grpc.secure_channel(broker.target, credentials, options=[("grpc.http2.bdp_probe", 0)]) as channel:
        stub = pb_grpc.GpuBrokerStub(channel)
        session = stub.OpenSession(pb.OpenSessionRequest(device=0), timeout=60).session
        buf = stub.Allocate(pb.AllocateRequest(session=session, size=SIZE), timeout=60).handle
        ref = pb.BufferRef(handle=buf)
        stub.Memset(pb.MemsetRequest(session=session, buffer=ref, value=7, size=SIZE), timeout=60)
        before = peak = _rss(pid)
        request = pb.CopyDeviceToHostRequest(session=session, buffer=ref, size=SIZE, chunk_bytes=CHUNK)
        calls = [stub.CopyDeviceToHost(request, timeout=120) for _ in range(CALLS)]
        try:
            deadline = time.monotonic() + STALL_SECONDS
            while time.monotonic() < deadline and peak - before <= 3 * ALLOWED_GROWTH:  # (then it has failed)
                peak = max(peak, _rss(pid))
                time.sleep(0.05)
            # The copies do finish: every call gives its bytes once the client reads them (all at once: one call's
            # chunks wait for the others' to be taken).
            with ThreadPoolExecutor(CALLS) as pool:
                copied = list(pool.map(lambda call: sum(len(chunk.data) for chunk in call), calls))
        finally:
            for call in calls:
                call.cancel()
    growth = peak - before
    print(f"\n{CALLS} CopyDeviceToHost calls of {SIZE >> 20} MiB in {CHUNK / 2**20:.1f} MiB chunks, none read: the "
          f"front grew {before >> 20} -> {peak >> 20} MiB (+{growth >> 20} MiB; the tenant's reply budget "
          f"{BUDGET >> 20} MiB); copied afterwards: {sum(copied) >> 20} of {CALLS * SIZE >> 20} MiB")
    assert copied == [SIZE] * CALLS
    assert growth <= ALLOWED_GROWTH, (
        f"a tenant's unread copy chunks grew the front by {growth >> 20} MiB ({CALLS} calls), past "
        f"{ALLOWED_GROWTH >> 20} MiB (its reply budget {BUDGET >> 20} MiB)")
