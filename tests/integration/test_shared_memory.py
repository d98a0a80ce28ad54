"""Same-host copies through shared memory: correctness against numpy and Write/Read commands, and segment
registration's authentication (a segments hello on the link socket), isolation, limits and cleanup."""

from __future__ import annotations

import gc
import os
import re
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from gpubroker.broker.front.auth import UNAUTHENTICATED_MESSAGE
from gpubroker.broker.launcher import BrokerProcess, TenantSpec
from gpubroker.client import (
    AdminClient,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    OutOfRange,
    RemoteGpu,
    ResourceExhausted,
    Unauthenticated,
    connect,
)
from gpubroker.client._shm import (
    STAGE_MIN,
    STAGING_BYTES,
    STAGING_SLOTS,
    SegmentChannel,
    create_segment_fd,
    staged_pieces,
)
from gpubroker.wire.commands import CopyShared, Read, Write

from ..conftest import worker_pids
from ..helpers import wait_for
from .test_metrics import scrape, value

SIZES = [0, 1, 1001, 3 * 1024 * 1024 + 7]


@pytest.fixture(scope="module")
def gpu(broker: BrokerProcess) -> Iterator[RemoteGpu]:
    with connect(broker.target, token=broker.tokens["alice"]) as g:
        yield g


def _bytes(size: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)


def _segment_names(broker: BrokerProcess, tenant: str, pid: int | None = None) -> set[str]:
    """The client memfds (by name) that the tenant's worker has mapped now."""
    (worker,) = worker_pids(broker, tenant)
    prefix = f"gpubroker-seg-{pid}-" if pid is not None else "gpubroker-seg-"
    maps = Path(f"/proc/{worker}/maps").read_text()
    return set(re.findall(re.escape(prefix) + r"\d+-?\d*", maps))


def _streams_only(gpu: RemoteGpu, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gpu, "_shm", None)


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("host", ["numpy", "host_array"])
def test_shared_and_streamed_copies_match_numpy(gpu: RemoteGpu, size: int, host: str,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    data = _bytes(size, size)
    # A device view at an odd offset, and an odd copy offset within it.
    buf = gpu.allocate_memory(size + 64)
    view = buf.at(3)
    # Host memory at an odd offset inside a larger array too: a view, not the array itself.
    backing = gpu.host_array(size + 11) if host == "host_array" else np.zeros(size + 11, dtype=np.uint8)
    src = backing[5:5 + size]
    src[:] = data
    gpu.copy_h2d(src, view, offset=17)
    out = (gpu.host_array(size + 3) if host == "host_array" else np.zeros(size + 3, dtype=np.uint8))[2:2 + size]
    gpu.copy_d2h(view, out, offset=17)
    np.testing.assert_array_equal(out, data)
    # Cross-check on the same session: what shared memory wrote, Read commands read back, and vice versa.
    with monkeypatch.context() as m:
        _streams_only(gpu, m)
        streamed = np.zeros(size, dtype=np.uint8)
        gpu.copy_d2h(view, streamed, offset=17)
        np.testing.assert_array_equal(streamed, data)
        gpu.copy_h2d(data[::-1].copy(), view, offset=17)
    shared = np.zeros(size, dtype=np.uint8)
    gpu.copy_d2h(view, shared, offset=17)
    np.testing.assert_array_equal(shared, data[::-1])
    gpu.free_memory(buf)


def test_host_array_round_trip_is_zero_copy(broker: BrokerProcess) -> None:
    with connect(broker.target, token=broker.tokens["alice"]) as g:
        a = g.host_array((300, 7), np.float32)
        a[:] = np.arange(2100, dtype=np.float32).reshape(300, 7)
        buf = g.allocate_memory(a.nbytes)
        g.copy_h2d(a, buf)
        b = g.host_array((300, 7), np.float32)
        g.copy_d2h(buf, b)
        np.testing.assert_array_equal(a, b)
        g.copy_d2h(buf.at(28), b[10:20])  # a row-aligned view of the host array: still the same segment
        np.testing.assert_array_equal(b[10:20], a[1:11])
        assert g._shm is not None and g._shm._staging is None  # never bounced through the staging segment
        assert g.host_array(0).size == 0


def test_a_session_without_a_link_shares_host_memory_too(broker: BrokerProcess) -> None:
    """Segments are registered on the link socket, but CopyShared goes on whatever carries the session's commands:
    a session whose commands go by gRPC (as a client in another language's would) keeps its host arrays."""
    with connect(broker.target, token=broker.tokens["alice"], transport="grpc") as g:
        assert g.transport.kind == "grpc"
        a = g.host_array(4096, np.uint8)
        assert g._shm is not None and g._shm._arrays, "host_array fell back to plain memory"
        a[:] = _bytes(4096, 3)
        buf = g.allocate_memory(4096)
        g.copy_h2d(a, buf)
        b = g.host_array(4096, np.uint8)
        g.copy_d2h(buf, b)
        np.testing.assert_array_equal(a, b)
        big = _bytes(STAGE_MIN * 2, 4)  # plain memory, through the staging segment
        g.copy_h2d(big, g.allocate_memory(big.nbytes))
        assert g._shm._staging is not None


def test_staging_path_for_plain_arrays_larger_than_the_staging_segment(broker: BrokerProcess,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    size = STAGING_BYTES + 12345
    data = _bytes(size, 7)
    with connect(broker.target, token=broker.tokens["alice"]) as g:
        pieces: list[tuple[int, int, bool]] = []  # (slot offset, size, to_device) of each staged CopyShared
        submit = g.transport.submit

        def staged_only(command: object, *a: object, **k: object) -> int:
            assert not isinstance(command, (Write, Read)), "copied through the transport's socket"
            if isinstance(command, CopyShared):
                pieces.append((command.segment_offset, command.size, command.to_device))
            return submit(command, *a, **k)  # type: ignore[arg-type]

        monkeypatch.setattr(g.transport, "submit", staged_only)
        buf = g.allocate_memory(size)
        g.copy_h2d(data, buf)
        out = np.zeros(size, dtype=np.uint8)
        g.copy_d2h(buf, out)
        np.testing.assert_array_equal(out, data)
        slot = STAGING_BYTES // STAGING_SLOTS
        # The slots in turn, then again from the first: each piece a slot's size or less, the ramp of smaller
        # pieces at the end of a copy to the device and at the start of one to the host.
        expected = [((i % STAGING_SLOTS) * slot, n, to_device) for to_device in (True, False)
                    for i, n in enumerate(staged_pieces(size, slot, to_device))]
        assert pieces == expected
        assert [n for _, n, d in pieces if d] == [slot // 8 + 12345, slot, slot, slot, slot // 2, slot // 4, slot // 8]
        with pytest.raises(OutOfRange):  # refused before any piece moves
            g.copy_h2d(data, buf, offset=1)
        assert len(pieces) == len(expected)


def test_falls_back_to_streams_without_shared_memory(broker: BrokerProcess) -> None:
    with connect(broker.target, token=broker.tokens["alice"], shared_memory=False) as g:
        with pytest.raises(FailedPrecondition):
            g.host_array(16)
        buf = g.allocate_memory(1001)
        data = _bytes(1001, 1)
        g.copy_h2d(data, buf)
        out = np.zeros(1001, dtype=np.uint8)
        g.copy_d2h(buf, out)
        np.testing.assert_array_equal(out, data)
    tcp = RemoteGpu("127.0.0.1:1", token="gpb_x_y")  # never connects: only its shared-memory setting is looked at
    try:
        assert tcp._shm is not None and tcp._shm.path is None and tcp._shm.channel() is None
        with pytest.raises(FailedPrecondition):
            tcp.host_array(16)
    finally:
        tcp._channel.close()


def _register(broker: BrokerProcess, token: str, session: str, size: int = 4096, seal: bool = True,
              announce: int | None = None) -> str:
    channel = SegmentChannel(broker.target[len("unix:"):] + ".fast", token, session)
    fd = create_segment_fd(size) if seal else os.memfd_create("gpubroker-seg-unsealed")
    try:
        if not seal:
            os.ftruncate(fd, size)
        return channel.register(fd, size if announce is None else announce)
    finally:
        os.close(fd)
        channel.close()


def test_segment_registration_authenticates_and_isolates(broker: BrokerProcess, gpu: RemoteGpu) -> None:
    path = Path(broker.target[len("unix:"):] + ".fast")
    assert path.is_socket() and path.stat().st_mode & 0o777 == 0o660  # the main socket's mode
    assert not Path(broker.target[len("unix:"):] + ".shm").exists()  # (one socket: the link's)
    for token in ("gpb_000000000000_wrong", ""):
        with pytest.raises(Unauthenticated) as info:
            _register(broker, token, gpu.session)
        assert info.value.message == UNAUTHENTICATED_MESSAGE
    with pytest.raises(NotFound):  # another tenant's session: as if it did not exist
        _register(broker, broker.tokens["bob"], gpu.session)
    with pytest.raises(NotFound):
        _register(broker, broker.tokens["alice"], "ses_invented")
    with pytest.raises(InvalidArgument):  # could shrink under the worker's mapping
        _register(broker, broker.tokens["alice"], gpu.session, seal=False)
    with pytest.raises(InvalidArgument):  # announces more than the memfd holds
        _register(broker, broker.tokens["alice"], gpu.session, announce=8192)
    with pytest.raises(ResourceExhausted):  # past max_shared_bytes_per_session (4 GiB by default)
        _register(broker, broker.tokens["alice"], gpu.session, announce=(4 << 30) + 1)
    handle = _register(broker, broker.tokens["alice"], gpu.session)
    buf = gpu.allocate_memory(64)
    assert gpu._shm is not None
    with pytest.raises(OutOfRange):
        gpu._shm._copy_shared(handle, 4090, buf, 0, 8, True, "")
    with connect(broker.target, token=broker.tokens["alice"]) as other, pytest.raises(NotFound):
        other._shm._copy_shared(handle, 0, other.allocate_memory(8), 0, 8, True, "")  # type: ignore[union-attr]


def test_segments_are_unmapped_when_released_and_when_the_session_ends(broker: BrokerProcess) -> None:
    me = os.getpid()
    before = _segment_names(broker, "alice", me)
    with connect(broker.target, token=broker.tokens["alice"]) as g:
        a = g.host_array(1 << 20)
        first = _segment_names(broker, "alice", me) - before
        assert len(first) == 1
        del a
        gc.collect()
        b = g.host_array(1 << 20)  # a dead array's segment is released with the next registration
        second = _segment_names(broker, "alice", me) - before
        assert len(second) == 1 and second != first
        g.copy_h2d(np.ones(1 << 20, dtype=np.uint8), g.allocate_memory(1 << 20))  # and a staging segment
        assert len(_segment_names(broker, "alice", me) - before) == 2
        del b
    assert _segment_names(broker, "alice", me) - before == set()


CLIENT = textwrap.dedent("""
    import sys
    import numpy as np
    from gpubroker.client import connect
    gpu = connect(sys.argv[1], token=sys.argv[2], transport="link")  # (no ring: its shared memory is counted too)
    host = gpu.host_array(1 << 20)
    host[:] = 1
    buf = gpu.allocate_memory(4 << 20)
    gpu.copy_h2d(host, buf)
    gpu.copy_h2d(np.ones(2 << 20, dtype=np.uint8), buf)  # through the staging segment
    print("mapped", flush=True)
    sys.stdin.read()  # block until killed
""")


def test_dead_client_leaves_no_segment_behind(fresh_broker: BrokerProcess) -> None:
    with connect(fresh_broker.target, token=fresh_broker.tokens["alice"]) as observer:
        child = subprocess.Popen([sys.executable, "-c", CLIENT, fresh_broker.target, fresh_broker.tokens["alice"]],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        assert child.stdout is not None
        try:
            assert child.stdout.readline().strip() == b"mapped"
            assert len(_segment_names(fresh_broker, "alice", child.pid)) == 2
            assert observer.device_info().memory_used == 4 << 20
        finally:
            child.kill()
            child.wait()
        wait_for(lambda: not _segment_names(fresh_broker, "alice", child.pid)
                 and observer.device_info().memory_used == 0, timeout=15, what="the lease to expire")


def _rss(pid: int) -> int:
    """Resident bytes of a process (anonymous, file and shared-memory pages it has mapped in)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {pid}")


def test_a_worker_maps_a_segment_without_populating_it(broker: BrokerProcess, backend: str) -> None:
    size, slack = 256 << 20, 48 << 20
    with connect(broker.target, token=broker.tokens["alice"]) as g:
        buf = g.allocate_memory(1 << 20)
        g.synchronize()
        (worker,) = worker_pids(broker, "alice")
        before = _rss(worker)
        # A memfd nobody touched: populating it in the worker would allocate all of it (charged to the worker).
        handle = _register(broker, broker.tokens["alice"], g.session, size=size)
        assert len(_segment_names(broker, "alice", os.getpid())) >= 1
        mapped = _rss(worker)
        assert mapped - before < slack, f"the worker's RSS grew by {mapped - before} bytes mapping {size}"
        assert g._shm is not None
        g._shm._copy_shared(handle, size - (1 << 20), buf, 0, 1 << 20, True, "")  # touches its last MiB only
        copied = _rss(worker)
        if backend == "cuda":  # the first copy page-locks the whole segment (cudaHostRegister faults it all in)
            assert copied - before > size - slack, f"the worker's RSS grew by only {copied - before} bytes"
        else:
            assert copied - before < slack, f"the worker's RSS grew by {copied - before} bytes copying 1 MiB"


SHARED_LIMIT = 3 << 30


@pytest.fixture
def shared_broker(backend: str) -> Iterator[BrokerProcess]:
    # Quotas above SHARED_LIMIT: the broker-wide cap is the one in effect (a tenant's own shared_memory
    # defaults to its quota; tests/security/test_shm_and_hellos.py tests that one).
    tenants = [TenantSpec("alice", memory_quota=8 << 30), TenantSpec("bob", memory_quota=8 << 30),
               TenantSpec("ops", admin=True)]
    settings = {"max_shared_bytes_per_tenant": SHARED_LIMIT, "max_shared_bytes_per_session": 2 << 30,
                "lease_seconds": 1.0, "metrics_listen": "127.0.0.1:0"}
    with BrokerProcess(tenants, backend=backend, settings=settings) as proc:
        yield proc


def _shared_use(broker: BrokerProcess, admin: AdminClient, tenant: str) -> tuple[int, float]:
    """The tenant's shared bytes as Usage and the metrics show them."""
    rows = [r for r in admin.usage().tenants if r.tenant == tenant]
    usage = rows[0].shared_bytes if rows else 0
    assert all(r.shared_bytes == usage and r.shared_bytes_limit == SHARED_LIMIT for r in rows)
    return usage, value(scrape(broker), "gpubroker_shared_memory_bytes", tenant=tenant)


def test_a_tenants_sessions_together_cannot_map_more_than_its_limit(shared_broker: BrokerProcess) -> None:
    # Sparse memfds: gigabytes announced and mapped, none of it allocated, since no one touches the pages. (Plain
    # links: a ring is shared memory too, counted the same way, which these exact sums leave out: test_ring.py.)
    alice, bob = shared_broker.tokens["alice"], shared_broker.tokens["bob"]
    with connect(shared_broker.target, token=alice, transport="link") as a1, \
            connect(shared_broker.target, token=alice, transport="link") as a2, \
            connect(shared_broker.target, token=bob, transport="link") as b, \
            AdminClient(shared_broker.target, shared_broker.tokens["ops"]) as admin:
        first = _register(shared_broker, alice, a1.session, size=2 << 30)
        _register(shared_broker, alice, a2.session, size=1 << 30)
        assert _shared_use(shared_broker, admin, "alice") == (SHARED_LIMIT, SHARED_LIMIT)
        # Each session is within its own 2 GiB; together they are at the tenant's 3 GiB.
        with pytest.raises(ResourceExhausted) as info:
            _register(shared_broker, alice, a2.session, size=4096)
        assert (f"would map {SHARED_LIMIT + 4096} bytes of shared memory across its sessions: 4096 requested, "
                f"{SHARED_LIMIT} in use, and the limit (max_shared_bytes_per_tenant) is {SHARED_LIMIT}"
                in info.value.message)
        assert info.value.details["limit"] == SHARED_LIMIT and info.value.details["used"] == SHARED_LIMIT
        with connect(shared_broker.target, token=alice, transport="link") as a3, pytest.raises(ResourceExhausted):
            _register(shared_broker, alice, a3.session, size=4096)  # a new session is no way around it
        _register(shared_broker, bob, b.session, size=1 << 30)  # another tenant's limit is its own
        assert _shared_use(shared_broker, admin, "bob") == (1 << 30, 1 << 30)

        # Released exactly: a freed segment, an ended session, a dead client.
        channel = SegmentChannel(shared_broker.target[len("unix:"):] + ".fast", alice, a1.session)
        try:
            channel.release(first)
        finally:
            channel.close()
        assert _shared_use(shared_broker, admin, "alice") == (1 << 30, 1 << 30)
        _register(shared_broker, alice, a2.session, size=4096)
        a2.close()
        assert _shared_use(shared_broker, admin, "alice") == (0, 0)

        child = subprocess.Popen([sys.executable, "-c", CLIENT, shared_broker.target, alice],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        assert child.stdout is not None
        try:
            assert child.stdout.readline().strip() == b"mapped"
            # Its host array and its staging segment.
            assert _shared_use(shared_broker, admin, "alice")[0] == (1 << 20) + STAGING_BYTES
        finally:
            child.kill()
            child.wait()
        wait_for(lambda: _shared_use(shared_broker, admin, "alice") == (0, 0), timeout=15,
                 what="the dead client's lease to expire")
        assert _shared_use(shared_broker, admin, "bob") == (1 << 30, 1 << 30)


def test_small_plain_copies_take_one_round_trip_not_the_staging_segment(broker: BrokerProcess) -> None:
    """A 4-byte read back (a flag, a loss) is one Read on the transport: no staging segment, no pipeline."""
    with connect(broker.target, token=broker.tokens["bob"]) as g:
        buf = g.allocate_memory(STAGE_MIN)
        g.copy_h2d(np.arange(STAGE_MIN // 4 - 1, dtype=np.float32), buf)
        word = np.zeros(1, dtype=np.float32)
        g.copy_d2h(buf.at(0), word, offset=8)
        assert word[0] == 2.0
        assert g._shm is not None and g._shm._staging is None
