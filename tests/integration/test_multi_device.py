"""Several devices in one broker: listing, placement, per-device quotas and health, and peer copies.

On OpenCL the broker gets two PoCL CPU devices (POCL_DEVICES="pthread pthread"); on CUDA (-m cuda) the host's
GPUs, and the tests skip when there are fewer than two.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gpubroker.broker.launcher import BrokerProcess, TenantSpec
from gpubroker.client import (
    AdminClient,
    Buffer,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    OutOfRange,
    RemoteGpu,
    ResourceExhausted,
    Unavailable,
    connect,
    list_devices,
)
from gpubroker.v1 import broker_pb2 as pb

from ..conftest import worker_pids
from ..helpers import wait_for

MiB = 1 << 20
TENANTS = [TenantSpec("ops", admin=True), TenantSpec("alice", memory_quota=1 << 40),
           TenantSpec("bob", memory_quota=4 * MiB, device_memory={1: 8 * MiB}), TenantSpec("carol"),
           TenantSpec("dave"), TenantSpec("erin", shared_memory=16 << 10), TenantSpec("frank", shared_memory=4 * MiB)]


WORKER_IDLE = 5.0  # (a test waits for idle workers to exit)


def _env(backend: str) -> dict[str, str]:
    return {"POCL_DEVICES": "pthread pthread"} if backend == "opencl" else {}


def _start(backend: str, **settings: object) -> BrokerProcess:
    proc = BrokerProcess(TENANTS, backend=backend, env=_env(backend), settings=dict(settings)).start()
    count = len(list_devices(proc.target, proc.tokens["alice"]))
    if count < 2:
        proc.stop()
        pytest.skip(f"needs two devices; the {backend} backend here has {count}")
    return proc


@pytest.fixture(scope="module")
def two(backend: str) -> Iterator[BrokerProcess]:
    """A broker on two devices shared by the tests that leave it as they found it."""
    proc = _start(backend, lease_seconds=30.0, worker_idle_seconds=WORKER_IDLE)
    try:
        yield proc
    finally:
        proc.stop()


def _health(target: str, service: str) -> str:
    with grpc.secure_channel(target, grpc.local_channel_credentials(grpc.LocalConnectionType.UDS)) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def _worker_pid(broker: BrokerProcess, tenant: str, device: int) -> int:
    """The live worker of (tenant, device) under ``broker``, found through /proc."""
    found = []
    for pid in worker_pids(broker, tenant):
        try:
            args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if args[args.index(b"--device") + 1] == str(device).encode():
            found.append(pid)
    assert len(found) == 1, found
    return found[0]


def _filled(gpu: RemoteGpu, data: np.ndarray, extra: int = 0) -> Buffer:
    buf = gpu.allocate_memory(data.nbytes + extra)
    gpu.copy_h2d(data, buf)
    return buf


def _read(gpu: RemoteGpu, buf: Buffer, size: int, offset: int = 0) -> np.ndarray:
    out = np.empty(size, dtype=np.uint8)
    gpu.copy_d2h(buf, out, offset)
    return out


# -- listing, placement, quotas ----------------------------------------------------------------------------------
def test_devices_are_listed_with_health_and_the_tenants_quota_on_each(two: BrokerProcess) -> None:
    devices = list_devices(two.target, two.tokens["bob"])
    assert [d.id for d in devices] == [0, 1]
    assert [d.health for d in devices] == ["SERVING", "SERVING"]
    assert [d.memory_quota for d in devices] == [4 * MiB, 8 * MiB]  # bob's own quota on device 1
    assert all(d.memory_used == 0 and d.memory_available is None for d in devices)
    env = {**os.environ, "GPUBROKER_TOKEN": two.tokens["bob"]}
    listed = subprocess.run([sys.executable, "-m", "gpubroker.broker.cli", "devices", "--target", two.target],
                            env=env, capture_output=True, text=True, check=True, timeout=60).stdout
    rows = [line for line in listed.splitlines() if line.startswith("  ")]
    assert [row.split(":")[0].strip() for row in rows] == ["0", "1"]
    assert all("SERVING" in row for row in rows) and "quota 8MiB" in rows[1]
    # The sandbox comes with the tenant's own devices (as the admins' Status says it): no admin call, so no
    # refused call audited for a tenant that only asked what it may use.
    with AdminClient(two.target, two.tokens["ops"]) as admin:
        sandbox = admin.status().sandbox
    assert sandbox and f"sandbox: {sandbox}" in listed.splitlines()[0]
    assert {d.sandbox for d in devices} == {sandbox}
    assert "(not an admin)" not in two.log_path.read_text()
    as_json = subprocess.run([sys.executable, "-m", "gpubroker.broker.cli", "devices", "--target", two.target,
                              "--json"], env=env, capture_output=True, text=True, check=True, timeout=60).stdout
    assert [d["memory_quota"] for d in json.loads(as_json)["devices"]] == [4 * MiB, 8 * MiB]


def test_gpubroker_devices_probes_every_device_here(backend: str, two: BrokerProcess) -> None:
    env = {**os.environ, **_env(backend)}
    listed = subprocess.run([sys.executable, "-m", "gpubroker.broker.cli", "devices", "--backend", backend],
                            env=env, capture_output=True, text=True, check=True, timeout=120).stdout
    assert len([line for line in listed.splitlines() if line.startswith("  ")]) >= 2


def test_placement_takes_the_least_loaded_device(two: BrokerProcess) -> None:
    with connect(two.target, two.tokens["carol"], device=0) as c0, \
            connect(two.target, two.tokens["carol"], device=0) as c1:
        assert (c0.device, c1.device) == (0, 0)
        with connect(two.target, two.tokens["alice"]) as a0:
            assert a0.device == 1 and a0.device_info().id == 1  # 2 sessions on device 0, none on 1
            with connect(two.target, two.tokens["alice"]) as a1:
                assert a1.device == 1  # still 2 against 1
                with connect(two.target, two.tokens["alice"]) as a2:
                    # 2 sessions each: alice's own decide, and she has none on device 0.
                    assert a2.device == 0
                    with AdminClient(two.target, two.tokens["ops"]) as admin:
                        assert [d.sessions for d in admin.status().devices] == [3, 2]


def test_concurrent_placements_spread_evenly(two: BrokerProcess) -> None:
    gpus: list[RemoteGpu] = []
    errors: list[BaseException] = []
    start = threading.Barrier(4)

    def open_one() -> None:
        start.wait()
        try:
            gpus.append(connect(two.target, two.tokens["dave"]))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=open_one) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    try:
        assert not errors
        assert sorted(g.device for g in gpus) == [0, 0, 1, 1]  # sessions still opening count as load
    finally:
        for gpu in gpus:
            gpu.close()


def test_quota_applies_per_device_and_placement_skips_a_full_one(two: BrokerProcess) -> None:
    bob = two.tokens["bob"]
    with connect(two.target, bob, device=0) as b0, connect(two.target, two.tokens["carol"], device=1), \
            connect(two.target, two.tokens["carol"], device=1):
        b0.allocate_memory(4 * MiB)  # the whole of bob's quota on device 0
        with pytest.raises(ResourceExhausted, match="on device 0"):
            b0.allocate_memory(1)
        with connect(two.target, bob) as b1:  # device 1 has more sessions, but device 0 has no room for bob
            assert b1.device == 1
            info = b1.device_info()
            assert (info.memory_quota, info.memory_used, info.memory_available) == (8 * MiB, 0, 8 * MiB)
            b1.allocate_memory(8 * MiB)
            with pytest.raises(ResourceExhausted) as full:
                b1.allocate_memory(1)
            assert full.value.details["quota"] == 8 * MiB and full.value.details["device"] == 1
            with pytest.raises(ResourceExhausted, match="every serving device"):
                connect(two.target, bob)
            with connect(two.target, bob, device=0) as named:  # a named device opens; only memory is full
                assert named.device_info().memory_available == 0
            with AdminClient(two.target, two.tokens["ops"]) as admin:
                rows = {u.device: u for u in admin.usage().tenants if u.tenant == "bob"}
                assert (rows[0].memory_quota, rows[0].memory_used) == (4 * MiB, 4 * MiB)
                assert (rows[1].memory_quota, rows[1].memory_used) == (8 * MiB, 8 * MiB)
                assert [d.memory_used >= q for d, q in zip(admin.status().devices, (4 * MiB, 8 * MiB),
                                                            strict=True)] == [True, True]


# -- health ------------------------------------------------------------------------------------------------------
def _crash_workers(broker: BrokerProcess, admin: AdminClient, device: int, times: int) -> None:
    for crash in range(1, times + 1):
        # No link, which would let tenant code run unseen: a death then would be alice's, not the device's.
        with connect(broker.target, broker.tokens["alice"], device=device, transport="grpc"):
            os.kill(_worker_pid(broker, "alice", device), signal.SIGKILL)
            wait_for(lambda n=crash: admin.status().devices[device].recent_worker_failures == n, 30,
                     f"worker failure {crash} on device {device} to be counted")


def test_a_failing_device_gets_no_new_sessions_while_the_other_serves(backend: str) -> None:
    proc = _start(backend, device_failure_threshold=2, device_failure_window_seconds=600.0)
    try:
        with AdminClient(proc.target, proc.tokens["ops"]) as admin, \
                connect(proc.target, proc.tokens["carol"], device=1) as busy:
            _crash_workers(proc, admin, 0, 2)
            wait_for(lambda: _health(proc.target, "gpubroker.v1.GpuBroker/device/0") == "NOT_SERVING", 30,
                     "device 0 to go NOT_SERVING")
            assert _health(proc.target, "gpubroker.v1.GpuBroker/device/1") == "SERVING"
            assert _health(proc.target, "") == "SERVING"  # the broker serves while one device does
            listed = list_devices(proc.target, proc.tokens["bob"])
            assert listed[0].health == "NOT_SERVING" and "worker failures" in listed[0].health_reason
            assert listed[1].health == "SERVING"
            with connect(proc.target, proc.tokens["bob"]) as placed, connect(proc.target, proc.tokens["bob"]) as more:
                assert (placed.device, more.device) == (1, 1)  # though device 0 has no sessions at all
                assert placed.device_info().health == "SERVING"
            with pytest.raises(Unavailable, match="device 0 is not serving"):
                connect(proc.target, proc.tokens["bob"], device=0)
            buf = busy.allocate_memory(64)  # the other device's session works on
            busy.memset(buf, 7)
            assert (_read(busy, buf, 64) == 7).all()

            _crash_workers(proc, admin, 1, 2)
            wait_for(lambda: _health(proc.target, "") == "NOT_SERVING", 30, "the broker to go NOT_SERVING")
            with pytest.raises(Unavailable, match="not serving") as none:
                connect(proc.target, proc.tokens["bob"])
            assert none.value.details["retry_after_seconds"] > 0
    finally:
        proc.stop()


# -- peer copies -------------------------------------------------------------------------------------------------
@pytest.fixture
def pair(two: BrokerProcess) -> Iterator[tuple[RemoteGpu, RemoteGpu, RemoteGpu]]:
    """alice's sessions: two on device 0, one on device 1."""
    token = two.tokens["alice"]
    with connect(two.target, token, device=0) as a, connect(two.target, token, device=1) as b, \
            connect(two.target, token, device=0) as c:
        yield a, b, c


def _cross_path(backend: str) -> set[str]:
    return {"host"} if backend == "opencl" else {"peer", "host"}  # CUDA: "peer" where the GPUs can reach each other


@pytest.mark.parametrize(("size", "src_offset", "dst_offset", "view"), [
    (1, 0, 0, 0), (4097, 3, 11, 0), (1_000_003, 129, 1, 256), (70 * MiB + 5, 7, 3, 128)])
def test_peer_copy_is_byte_identical(backend: str, pair: tuple[RemoteGpu, RemoteGpu, RemoteGpu], size: int,
                                     src_offset: int, dst_offset: int, view: int) -> None:
    a, b, c = pair
    data = np.random.default_rng(size).integers(0, 256, size + src_offset + view, dtype=np.uint8)
    src = _filled(a, data)
    try:
        for dst_gpu, paths in ((b, _cross_path(backend)), (c, {"device"}), (a, {"device"})):
            dst = dst_gpu.allocate_memory(size + dst_offset + view + 64)
            try:
                dst_gpu.memset(dst, 0xEE)
                assert a.copy_peer(src.at(view), dst_gpu, dst.at(view), size, src_offset, dst_offset) in paths
                out = _read(dst_gpu, dst, size + dst_offset + view + 64)
                start = view + dst_offset
                assert np.array_equal(out[start:start + size], data[view + src_offset:view + src_offset + size])
                assert (out[:start] == 0xEE).all() and (out[start + size:] == 0xEE).all()  # nothing else written
            finally:
                dst_gpu.free_memory(dst)
        # And back the other way, into the source buffer's first bytes.
        back = _filled(b, data[:size])
        try:
            assert b.copy_peer(back, a, src, size) in _cross_path(backend)
            assert np.array_equal(_read(a, src, size), data[:size])
        finally:
            b.free_memory(back)
    finally:
        a.free_memory(src)


def test_peer_copies_follow_a_freed_and_replaced_source(backend: str,
                                                       pair: tuple[RemoteGpu, RemoteGpu, RemoteGpu]) -> None:
    a, b, _ = pair
    size = 12 * MiB + 1  # past the host path's small copies: through the tenant's kept staging
    rng = np.random.default_rng(7)
    dst = b.allocate_memory(size)
    try:
        for _ in range(2):  # a fresh source each time, perhaps at the address of the one just freed
            data = rng.integers(0, 256, size, dtype=np.uint8)
            src = _filled(a, data)
            for _ in range(2):  # the second copy reuses what the first set up
                assert a.copy_peer(src, b, dst, size) in _cross_path(backend)
                assert np.array_equal(_read(b, dst, size), data)
            a.free_memory(src)
    finally:
        b.free_memory(dst)


def _peer_staging_held(broker: BrokerProcess, tenant: str) -> list[int]:
    """Processes of ``broker`` (the front, the tenant's workers) that map or hold the tenant's staging memfd."""
    assert broker.process is not None
    name = f"gpubroker-peer-{tenant}"
    held = []
    for pid in [broker.process.pid, *worker_pids(broker, tenant)]:
        try:
            if (name in Path(f"/proc/{pid}/maps").read_text()
                    or any(name in os.readlink(fd) for fd in Path(f"/proc/{pid}/fd").iterdir())):
                held.append(pid)
        except OSError:  # (a worker that exited meanwhile)
            continue
    return held


def _shared_bytes(broker: BrokerProcess, tenant: str) -> int:
    with AdminClient(broker.target, broker.tokens["ops"]) as admin:
        return sum(u.shared_bytes for u in admin.usage().tenants if u.tenant == tenant and u.device == 0)


def test_the_kept_staging_goes_when_the_workers_end(backend: str, two: BrokerProcess) -> None:
    if backend != "opencl":
        pytest.skip("only the host path keeps a staging memfd")
    token = two.tokens["carol"]
    with connect(two.target, token, device=0) as a, connect(two.target, token, device=1) as b:
        data = np.random.default_rng(3).integers(0, 256, 9 * MiB, dtype=np.uint8)
        src, dst = _filled(a, data), _filled(b, np.zeros_like(data))
        before = _shared_bytes(two, "carol")  # (the sessions' rings and the SDK's staging segments)
        assert a.copy_peer(src, b, dst, data.nbytes) == "host"
        front, *workers = _peer_staging_held(two, "carol")
        assert front == two.process.pid and len(workers) == 2  # the front's memfd, mapped by both workers
        # Counted in carol's shared memory (a quarter of it, 128 MiB at most): its workers may keep it.
        assert _shared_bytes(two, "carol") - before == 128 * MiB
        assert np.array_equal(_read(b, dst, data.nbytes), data)
    # The sessions ended: the workers unmapped it; the front keeps it, counted, until they exit (idle).
    wait_for(lambda: not _peer_staging_held(two, "carol") and _shared_bytes(two, "carol") == 0, 60,
             "the workers to exit and the staging to be closed and uncounted")


def test_a_copy_through_the_host_needs_room_in_the_tenants_shared_memory(backend: str, two: BrokerProcess) -> None:
    if backend != "opencl":
        pytest.skip("only the host path stages (CUDA takes the peer path where it can)")
    with connect(two.target, two.tokens["erin"], device=0) as a, connect(two.target, two.tokens["erin"], device=1) as b:
        src, dst = a.allocate_memory(4096), b.allocate_memory(4096)
        with pytest.raises(ResourceExhausted, match="too little to stage through"):
            a.copy_peer(src, b, dst, 4096)  # a quarter of 16 KiB is less than two pages
    token = two.tokens["frank"]
    with connect(two.target, token, device=0) as a, connect(two.target, token, device=1) as b:
        src, dst = a.allocate_memory(4096), b.allocate_memory(4096)
        with connect(two.target, token, device=0) as c:
            held = c.host_array(3 * MiB + 512 * 1024)
            with pytest.raises(ResourceExhausted, match="1048576 bytes of host shared memory") as full:
                a.copy_peer(src, b, dst, 4096)
            assert full.value.details["limit"] == 4 * MiB
            del held
        before = _shared_bytes(two, "frank")  # (its segment went with its session)
        assert a.copy_peer(src, b, dst, 4096) == "host"
        assert _shared_bytes(two, "frank") - before == MiB  # a quarter of its shared memory


def test_peer_copy_runs_after_queued_kernels(two: BrokerProcess) -> None:
    token = two.tokens["alice"]
    with connect(two.target, token, device=0, async_commands=True) as a, connect(two.target, token, device=1) as b:
        src, dst = a.allocate_memory(4096), b.allocate_memory(4096)
        a.memset(src, 1)
        a.memset(src, 9, 100, 50)  # queued, not yet sent: the copy must see both
        a.copy_peer(src, b, dst, 4096)
        out = _read(b, dst, 4096)
        assert (out[50:150] == 9).all() and (out[:50] == 1).all() and (out[150:] == 1).all()
        assert a.copy_peer(src, b, dst, 0) == "none"


def test_peer_copy_refusals(two: BrokerProcess, pair: tuple[RemoteGpu, RemoteGpu, RemoteGpu]) -> None:
    a, b, _ = pair
    src, dst = a.allocate_memory(1000), b.allocate_memory(500)
    try:
        with connect(two.target, two.tokens["carol"], device=1) as foreign:
            theirs = foreign.allocate_memory(1000)
            with pytest.raises(NotFound, match="no session"):
                a.copy_peer(src, foreign, theirs, 10)  # another tenant's session is as good as none
            with pytest.raises(NotFound):
                foreign.copy_peer(theirs, b, dst, 10)
        with pytest.raises(NotFound, match="no buf"):
            a.copy_peer(dst, b, dst, 10)  # b's buffer named in a's session
        with pytest.raises(OutOfRange, match="destination"):
            a.copy_peer(src, b, dst, 501)
        with pytest.raises(OutOfRange, match="source"):
            a.copy_peer(src, b, dst, 10, src_offset=995)
        with pytest.raises(InvalidArgument):
            a.copy_peer(src, b, dst, -1)
        with pytest.raises(InvalidArgument):
            a.copy_peer(src, b, dst, 10, dst_offset=-2)
        with pytest.raises(InvalidArgument, match="overlap"):
            a.copy_peer(src, a, src, 100, 0, 50)
        with pytest.raises(InvalidArgument, match="one broker"):
            a.copy_peer(src, RemoteGpu("unix:/nonexistent.sock"), dst, 10)
        assert a.copy_peer(src, b, dst, 500) in {"host", "peer"}  # both still usable after the refusals
    finally:
        a.free_memory(src)
        b.free_memory(dst)


def test_a_closed_session_cannot_take_part_in_a_peer_copy(two: BrokerProcess) -> None:
    token = two.tokens["alice"]
    with connect(two.target, token, device=1) as b:
        a = connect(two.target, token, device=0)
        src, dst = a.allocate_memory(128), b.allocate_memory(128)
        closed = a.session
        a.close()
        with pytest.raises(FailedPrecondition, match="closed"):
            a.copy_peer(src, b, dst, 128)  # refused by the client
        request = pb.CopyPeerRequest(src_session=closed, src=pb.BufferRef(handle=src.handle), dst_session=b.session,
                                     dst=pb.BufferRef(handle=dst.handle), size=128)
        with pytest.raises(NotFound, match="has ended: closed"):
            b._call("CopyPeer", request)  # and by the broker (which remembers why it ended)


@pytest.mark.cuda
def test_cuda_host_path_when_asked(backend: str) -> None:
    if backend != "cuda":
        pytest.skip("the peer path is CUDA's")
    proc = _start(backend, peer_copies="host")
    try:
        token = proc.tokens["alice"]
        with connect(proc.target, token, device=0) as a, connect(proc.target, token, device=1) as b:
            data = np.random.default_rng(5).integers(0, 256, 200 * MiB + 3, dtype=np.uint8)
            src, dst = _filled(a, data), b.allocate_memory(data.nbytes)
            assert a.copy_peer(src, b, dst, data.nbytes) == "host"
            assert np.array_equal(_read(b, dst, data.nbytes), data)
    finally:
        proc.stop()
