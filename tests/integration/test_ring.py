"""The same-host shared-memory ring: a Unix link upgraded to two byte rings in a sealed memfd with a
SOCK_SEQPACKET socketpair for doorbells. Results are the link's (tests/integration/test_fast_path.py runs its
transport test on the ring); here: what a hostile client may write into the shared memory, offer as a ring or do
to its doorbells (the worker answers an error or drops the ring, and lives on, never blocked), the client's
close, and the worker's death seen through a ring."""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from gpubroker.broker import samples
from gpubroker.broker.front._descriptors import PASSRIGHTS_SUPPORTED
from gpubroker.broker.launcher import BrokerProcess
from gpubroker.client import InvalidArgument, RemoteGpu, Unavailable, WorkerCrashed, connect
from gpubroker.client._transports import BatchingTransport, Lost, RingUpgrade, ring_transport, unix_connector
from gpubroker.wire.commands import Batch, Synchronize, decode_ack, encode
from gpubroker.wire.frames import pack_frame, recv_payload, send_frame, send_payload, unpack_frame
from gpubroker.wire.ring import (
    ACK_HEAD,
    ACK_TAIL,
    CLIENT_AWAKE,
    CMD_HEAD,
    CMD_TAIL,
    RING_DATA,
    RING_SEALS,
    SPIN_ENV,
    WAIT_SPIN_US,
    ByteRing,
    drain_bell,
    ring_bell,
    ring_caps,
    wait_spin_us,
)

from ..conftest import TENANTS, worker_pids
from ..helpers import busy_synchronizing, other_tenants_launches_take, wait_for


@pytest.fixture(scope="module")
def ring_broker(backend: str) -> Iterator[BrokerProcess]:
    """A broker of this module's own: these tests kill workers and feed them broken rings."""
    with BrokerProcess(TENANTS, backend=backend, settings={"lease_seconds": 30.0}) as proc:
        yield proc


@pytest.fixture
def gpu(ring_broker: BrokerProcess) -> Iterator[RemoteGpu]:
    with connect(ring_broker.target, token=ring_broker.tokens["alice"], transport="ring") as g:
        assert g.transport.kind == "ring"
        yield g


def _fast(broker: BrokerProcess) -> str:
    return broker.target.removeprefix("unix:") + ".fast"


def _ring(broker: BrokerProcess, session: str) -> BatchingTransport:
    return ring_transport(unix_connector(_fast(broker)), broker.tokens["alice"], session, timeout=10, fallback=False)


def _carrier(t: BatchingTransport) -> RingUpgrade:
    """The ring under a transport, to be tampered with as a hostile client would."""
    assert isinstance(t.carrier, RingUpgrade)
    return t.carrier


def _still_serves(broker: BrokerProcess, gpu: RemoteGpu, pid: int) -> None:
    """The session's own ring and a new one still work, on the same worker: nothing crashed."""
    gpu.synchronize()
    other = _ring(broker, gpu.session)
    other.call(Synchronize())
    other.close()
    assert worker_pids(broker, "alice") == [pid]


def _publish(t: BatchingTransport, head: int, record: bytes = b"") -> None:
    """Write ``record`` at the command ring's start and claim ``head`` bytes published, as a hostile client may."""
    r = _carrier(t)
    assert r._mm is not None and r._words is not None
    r._mm[RING_DATA:RING_DATA + len(record)] = record
    r._words[CMD_HEAD] = head


# What a hostile client may write into a fresh command ring: (head, record).
_BAD_COMMANDS: dict[str, tuple[int, bytes]] = {
    "head far past the ring": (1 << 60, b""),
    "head inside a length field": (3, b""),
    "length over the frame limit": (12, (0xFFFFFFF0).to_bytes(4, "little")),
    "length past what is published": (8, (100).to_bytes(4, "little")),
    "a record that is no batch": (7, (3).to_bytes(4, "little") + b"\xc1\xc1\xc1"),
}


@pytest.mark.parametrize("how", list(_BAD_COMMANDS))
def test_a_broken_command_ring_is_refused_with_id_0_and_closed(ring_broker: BrokerProcess, gpu: RemoteGpu,
                                                                how: str) -> None:
    (pid,) = worker_pids(ring_broker, "alice")
    t = _ring(ring_broker, gpu.session)
    r = _carrier(t)
    assert r._bell is not None and r.link.sock is not None
    _publish(t, *_BAD_COMMANDS[how])
    ring_bell(r._bell)
    ack = decode_ack(r.receive(10, 1))
    assert ack.id == 0 and ack.error is not None and ack.error.code == "INVALID_ARGUMENT"
    assert ("malformed batch" if "no batch" in how else "broken ring") in ack.error.message
    assert r.link.sock.recv(1) == b""  # then the link (and with it the ring) is closed
    t.close()
    _still_serves(ring_broker, gpu, pid)


def test_an_impossible_ack_index_or_a_shut_doorbell_drops_the_ring(ring_broker: BrokerProcess,
                                                                    gpu: RemoteGpu) -> None:
    """Where the worker cannot answer (the client's ack index is nonsense) or cannot ring (the client shut its
    end of the doorbell), it drops the ring: its link closes, and the client sees a lost link."""
    (pid,) = worker_pids(ring_broker, "alice")
    t = _ring(ring_broker, gpu.session)
    r = _carrier(t)
    assert r._words is not None and r.link.sock is not None
    r._words[ACK_TAIL] = 1 << 40
    with pytest.raises(Unavailable, match="lost"):
        t.call(Synchronize())
    t.close()
    t = _ring(ring_broker, gpu.session)
    r = _carrier(t)
    assert r._bell is not None and r.link.sock is not None and r._commands is not None
    r._bell.shutdown(socket.SHUT_RD)  # the worker's ring of it fails (EPIPE): no ack could wake this client
    assert r._words is not None
    r._words[CLIENT_AWAKE] = 0  # (as a client about to block says: the worker rings for its ack)
    assert r._commands.put(encode(Batch(1, 1, [Synchronize()])))
    ring_bell(r._bell)
    assert r.link.sock.recv(1) == b""  # the worker closed the link, and with it the ring
    t.close()
    _still_serves(ring_broker, gpu, pid)


def _hello(broker: BrokerProcess, session: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.connect(_fast(broker))
    send_frame(sock, {"token": broker.tokens["alice"], "session": session, "link": 1})
    _, status, _ = unpack_frame(recv_payload(sock, 1 << 16))
    assert status == 0
    return sock


def _memfd(size: int, seals: int) -> int:
    fd = os.memfd_create("test-ring", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd


def _ring_hello(broker: BrokerProcess, session: str, ring: Any,
                tenant: str = "alice") -> tuple[socket.socket, dict[str, Any], list[int]]:
    """A link whose hello asks for ``ring``: the socket, the front's first answer and the fds that came with it."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.connect(_fast(broker))
    send_frame(sock, {"token": broker.tokens[tenant], "session": session, "link": 1, "ring": ring})
    header, fds, _, _ = socket.recv_fds(sock, 4, 4)
    payload = recv_payload_after(sock, header)
    _, status, result = unpack_frame(payload)
    return sock, {"status": status, "result": result}, fds


def recv_payload_after(sock: socket.socket, header: bytes) -> bytes:
    while len(header) < 4:
        header += sock.recv(4 - len(header))
    n = int.from_bytes(header, "big")
    data = b""
    while len(data) < n:
        data += sock.recv(n - len(data))
    return data


def test_the_ring_is_the_fronts_sealed_exact_and_its_doorbells_refuse_descriptors(ring_broker: BrokerProcess,
                                                                                  gpu: RemoteGpu) -> None:
    """The front makes the ring (issue 21: a client's memfd handed to the worker was filled past every memory
    bound): a memfd sealed against growing and shrinking, exactly the two rings and the index page, and doorbells
    that refuse descriptors both ways; the worker maps it and says so."""
    sock, answer, fds = _ring_hello(ring_broker, gpu.session, {"window": 4})
    try:
        assert answer["status"] == 0 and answer["result"]["ring"] == 1 and len(fds) == 2
        memfd, bell_fd = fds
        cap = ring_caps(4, gpu.transport.max_frame)
        assert answer["result"]["commands"] == answer["result"]["acks"] == cap
        assert os.fstat(memfd).st_size == RING_DATA + 2 * cap
        assert fcntl.fcntl(memfd, fcntl.F_GET_SEALS) & RING_SEALS == RING_SEALS
        bell = socket.socket(fileno=bell_fd)
        other = _memfd(4096, 0)
        try:
            if PASSRIGHTS_SUPPORTED:
                with pytest.raises(PermissionError):
                    socket.send_fds(bell, [b"\x01"], [other])
        finally:
            os.close(other)
            bell.close()
            os.close(memfd)
        _, status, accepted = unpack_frame(recv_payload(sock, 1 << 16))
        assert status == 0 and accepted["ring"] == 1
    finally:
        sock.close()


@pytest.mark.skipif(not PASSRIGHTS_SUPPORTED, reason="SO_PASSRIGHTS needs Linux 6.16")
def test_descriptors_sent_on_a_link_are_refused_by_the_kernel_and_the_link_stays(ring_broker: BrokerProcess,
                                                                                 gpu: RemoteGpu) -> None:
    """The worker's end of a link takes no descriptor: the client's sendmsg fails (EPERM), nothing is sent, and
    the link goes on. (An older client's ring offer fails so; the SDK then falls back to a plain link.)"""
    (pid,) = worker_pids(ring_broker, "alice")
    sock = _hello(ring_broker, gpu.session)
    fd = _memfd(1 << 20, RING_SEALS)
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        with pytest.raises(PermissionError):
            socket.send_fds(sock, [pack_frame({"ring": 1, "commands": 1, "acks": 1})], [fd, theirs.fileno()])
    finally:
        os.close(fd)
        ours.close()
        theirs.close()
    send_payload(sock, encode(Batch(1, 1, [Synchronize()])))  # still a plain link, in step
    ack = decode_ack(recv_payload(sock, 1 << 16))
    assert ack.id == 1 and ack.done == 1 and ack.error is None
    sock.close()
    _still_serves(ring_broker, gpu, pid)


@pytest.mark.parametrize("ring", [{"window": 0}, {"window": 99}, {"window": 4, "spin_us": 10**6}, [4], "ring"],
                         ids=["no window", "a huge window", "a long spin", "not a map", "a string"])
def test_a_malformed_ring_request_is_refused_as_a_malformed_hello(ring_broker: BrokerProcess, gpu: RemoteGpu,
                                                                   ring: Any) -> None:
    sock, answer, fds = _ring_hello(ring_broker, gpu.session, ring)
    sock.close()
    assert not fds
    assert answer["status"] == 1 and answer["result"]["code"] == InvalidArgument.code
    assert "malformed link hello" in answer["result"]["message"]


def _cpus(monkeypatch: pytest.MonkeyPatch, n: int) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(n)))


def test_the_clients_wait_spins_long_only_where_cpus_are_spare(monkeypatch: pytest.MonkeyPatch) -> None:
    """A call's answer is polled for up to WAIT_SPIN_US by default (a wake-up costs 0.1-0.2 ms in a VM), not at all
    on a host of few CPUs, and exactly as long as SPIN_ENV says where it is set (the worker's spin too)."""
    monkeypatch.delenv(SPIN_ENV, raising=False)
    _cpus(monkeypatch, 16)
    assert wait_spin_us() == WAIT_SPIN_US > 1000
    _cpus(monkeypatch, 2)
    assert wait_spin_us() == 0
    monkeypatch.setenv(SPIN_ENV, "70")
    assert wait_spin_us() == 70
    monkeypatch.setenv(SPIN_ENV, "0")
    _cpus(monkeypatch, 16)
    assert wait_spin_us() == 0


@pytest.mark.parametrize("spin", ["0", "50", None], ids=["block", "spin", "default-wait"])
@pytest.mark.parametrize("async_commands", [False, True], ids=["sync", "async"])
def test_results_through_the_ring_spinning_or_not(ring_broker: BrokerProcess, async_commands: bool,
                                                  spin: str | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Dependent kernels and reads back, many round trips, across the ring's wrap (small records, 1 MiB reads).
    ``default-wait``: the client's long wait spin (as on a host of spare CPUs) and the worker's short one."""
    if spin is None:
        monkeypatch.delenv(SPIN_ENV, raising=False)
        _cpus(monkeypatch, 16)
    else:
        monkeypatch.setenv(SPIN_ENV, spin)
    with connect(ring_broker.target, token=ring_broker.tokens["alice"], transport="ring",
                 async_commands=async_commands, shared_memory=False) as gpu:
        kernel = gpu.compile_kernel(samples.source(gpu.device_info().backend), "scale_inplace")
        n = 256 * 1024
        x = np.arange(n, dtype=np.float32)
        buf = gpu.allocate_memory(x.nbytes)
        gpu.copy_h2d(x, buf)
        out = np.empty_like(x)
        for i in range(12):  # 12 MiB of reads back: the ack ring (4 windows of 1 MiB) wraps
            gpu.execute_kernel(kernel, n // 256, 256, [buf, np.float32(-1), np.int32(n)])
            gpu.copy_d2h(buf, out)
            np.testing.assert_array_equal(out, x if i % 2 else 1 - x)
        for _ in range(300):
            gpu.execute_kernel(kernel, 1, 1, [buf, np.float32(1), np.int32(1)])
            gpu.synchronize()
        with pytest.raises(InvalidArgument):  # an error comes back the same way, naming the command
            gpu.execute_kernel(kernel, 1, 1, [buf])
            gpu.synchronize()
        gpu.synchronize()


def _ring_mapped(pid: int) -> bool:
    return "gpubroker-ring" in Path(f"/proc/{pid}/maps").read_text()


def test_the_clients_close_ends_the_ring(ring_broker: BrokerProcess) -> None:
    with connect(ring_broker.target, token=ring_broker.tokens["alice"], transport="ring") as gpu:
        gpu.synchronize()
        (pid,) = worker_pids(ring_broker, "alice")
        try:
            assert _ring_mapped(pid)
        except PermissionError:
            pytest.skip("the worker's maps are not readable here (the sandbox)")
        gpu.transport.close()  # the session stays; its ring goes
        wait_for(lambda: not _ring_mapped(pid), 10, "the worker to unmap the closed ring")


@pytest.mark.parametrize("spin", ["0", "50"], ids=["block", "spin"])
@pytest.mark.parametrize("async_commands", [False, True], ids=["sync", "async"])
def test_the_workers_death_is_seen_through_the_ring(ring_broker: BrokerProcess, async_commands: bool, spin: str,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SPIN_ENV, spin)  # both sides: the client tells its worker how long to spin
    with connect(ring_broker.target, token=ring_broker.tokens["alice"], transport="ring",
                 async_commands=async_commands) as gpu:
        kernel = gpu.compile_kernel(samples.source(gpu.device_info().backend), "scale_inplace")
        buf = gpu.allocate_memory(4096)
        gpu.memset(buf, 0)
        gpu.synchronize()
        (pid,) = worker_pids(ring_broker, "alice")
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(WorkerCrashed, match="SIGKILL"):
            gpu.execute_kernel(kernel, 1, 256, [buf, np.float32(2), np.int32(1024)])
            gpu.synchronize()
    wait_for(lambda: not worker_pids(ring_broker, "alice"), 10, "the killed worker to be reaped")


def test_a_spinning_ring_does_not_keep_the_device_from_another_tenant(ring_broker: BrokerProcess,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A client whose next batch always arrives within its worker's spin keeps that worker busy; the worker
    still reads the front's "yield" (its ring has a time slice), so another tenant's commands get their turns
    while the first goes on."""
    monkeypatch.setenv(SPIN_ENV, "200")
    with connect(ring_broker.target, token=ring_broker.tokens["alice"], transport="ring") as alice, \
            busy_synchronizing(alice) as counts:
        with connect(ring_broker.target, token=ring_broker.tokens["bob"], transport="grpc", timeout=20) as bob:
            start = counts[0]
            took = other_tenants_launches_take(bob)
        assert counts[0] > start, "alice stopped while bob ran: this test shows nothing"
        assert took < 10, f"bob's 20 launches took {took:.1f} s beside a spinning ring"


def test_a_ring_past_the_tenants_shared_memory_leaves_auto_on_the_link_and_ring_says_why(
        ring_broker: BrokerProcess) -> None:
    """A ring is shared memory, charged to the tenant as a segment is (its whole size: the worker may fill every
    page of it). Past the tenant's shared memory (carol's: her 64 MiB quota, nearly all in a host array) the front
    declines it: "auto" goes on over a plain link, "ring" raises the reason."""
    with connect(ring_broker.target, token=ring_broker.tokens["carol"], transport="grpc") as holder:
        held = holder.host_array(60 << 20)
        with connect(ring_broker.target, token=ring_broker.tokens["carol"], shared_memory=False) as gpu:
            assert gpu.transport.kind == "unix"
            buf = gpu.allocate_memory(64)
            gpu.memset(buf, 7)
            out = np.empty(64, dtype=np.uint8)
            gpu.copy_d2h(buf, out)
            assert (out == 7).all()
        with pytest.raises(Unavailable, match=r"no ring on this link: .*shared memory"):
            connect(ring_broker.target, token=ring_broker.tokens["carol"], transport="ring", shared_memory=False)
        del held
    with connect(ring_broker.target, token=ring_broker.tokens["carol"], transport="ring") as gpu:
        assert gpu.transport.kind == "ring"  # (the array's release gave the room back)


def test_random_corruption_of_the_command_ring_is_answered_or_dropped(ring_broker: BrokerProcess,
                                                                      gpu: RemoteGpu) -> None:
    """Mutated batches, lengths and heads (seeded): each ring gets an answer or is closed, never a hang, and
    the worker serves on."""
    (pid,) = worker_pids(ring_broker, "alice")
    rng = np.random.default_rng(1313)
    base = bytearray(encode(Batch(1, 1, [Synchronize()])))
    for _ in range(40):
        t = _ring(ring_broker, gpu.session)
        r = _carrier(t)
        assert r._bell is not None
        record = bytearray(base)
        for at in rng.integers(0, len(record), int(rng.integers(1, 4))):
            record[at] = int(rng.integers(0, 256))
        length = len(record) if rng.random() < 0.7 else int(rng.integers(0, 1 << 32))
        head = 4 + len(record) + (0 if rng.random() < 0.7 else int(rng.integers(-4 - len(record) + 1, 1 << 20)))
        _publish(t, head, length.to_bytes(4, "little") + bytes(record))
        ring_bell(r._bell)
        try:
            decode_ack(r.receive(10, 1))  # an answer (a refusal, or the batch's own ack)
        except Lost:
            pass  # or the ring closed
        t.close()
    _still_serves(ring_broker, gpu, pid)


def _next_ack(acks: ByteRing, what: str) -> bytes:
    """The next ack, polled for (this client takes no wake-ups: it flooded its own doorbell)."""
    got: list[bytes] = []
    wait_for(lambda: bool(got.append(acks.get() or b"") or got[-1]), 10, what)
    return got[-1]


def test_a_client_that_blocks_and_floods_its_doorbells_cannot_stall_the_worker(ring_broker: BrokerProcess,
                                                                               gpu: RemoteGpu) -> None:
    """A hostile client (which no longer holds the worker's end of the doorbells: the front makes them) clears
    O_NONBLOCK on its own end, never drains the wake-ups the worker rings into it, and floods the worker with
    wake-ups. The worker still answers every batch in its ring (dropping the wake-ups it cannot send), and never
    holds the device turn while stuck: another tenant's launches get done within a deadline."""
    (pid,) = worker_pids(ring_broker, "alice")
    sock, answer, (fd, bell_fd) = _ring_hello(ring_broker, gpu.session, {"window": 4})
    max_frame = gpu.transport.max_frame
    cap = answer["result"]["commands"]
    size = RING_DATA + 2 * cap
    mm = mmap.mmap(fd, size)
    ours = socket.socket(fileno=bell_fd)
    os.close(fd)
    _, status, _ = unpack_frame(recv_payload(sock, 1 << 16))
    assert status == 0
    words = memoryview(mm).cast("Q")
    commands = ByteRing(mm, words, RING_DATA, cap, CMD_HEAD * 8, CMD_TAIL * 8, max_frame)
    acks = ByteRing(mm, words, RING_DATA + cap, cap, ACK_HEAD * 8, ACK_TAIL * 8, cap - 4)
    fcntl.fcntl(ours.fileno(), fcntl.F_SETFL, fcntl.fcntl(ours.fileno(), fcntl.F_GETFL) & ~os.O_NONBLOCK)
    with contextlib.suppress(BlockingIOError):  # the worker's inbox, full
        while True:
            ours.send(b"\x01", socket.MSG_DONTWAIT)
    stop, flooded = threading.Event(), [0]

    def flood() -> None:  # blocking sends: each one as soon as the worker drains room for it
        with contextlib.suppress(OSError):
            while not stop.is_set():
                ours.send(b"\x01")
                flooded[0] += 1

    thread = threading.Thread(target=flood)
    thread.start()
    try:
        for i in range(1, 11):
            assert commands.put(encode(Batch(i, i, [Synchronize()])))
            ack = decode_ack(_next_ack(acks, f"the ack of batch {i}"))
            assert ack.id == i and ack.done == 1 and ack.error is None
        assert flooded[0] > 0, "the worker never drained its flooded doorbell: this test shows nothing"
        with connect(ring_broker.target, token=ring_broker.tokens["bob"], transport="grpc", timeout=20) as bob:
            kernel = bob.compile_kernel(samples.source(bob.device_info().backend), "empty_kernel")
            t0 = time.monotonic()
            for i in range(20):
                bob.execute_kernel(kernel, 1, 1, [])
                bob.synchronize()
                assert commands.put(encode(Batch(100 + i, 100 + i, [Synchronize()])))  # alice's ring stays busy
            took = time.monotonic() - t0
        assert took < 10, f"bob's 20 launches took {took:.1f} s beside a flooded ring"
    finally:
        stop.set()
        ours.shutdown(socket.SHUT_RDWR)  # wakes the flood's blocked send
        thread.join(10)
        words.release()
        mm.close()
        ours.close()
        sock.close()
    assert not thread.is_alive()
    _still_serves(ring_broker, gpu, pid)


def test_ring_hellos_whose_clients_leave_at_once_give_their_places_and_memory_back(ring_broker: BrokerProcess,
                                                                                     gpu: RemoteGpu) -> None:
    """A client that asks for a ring and closes before the front's grant goes out: the link's place in the session's
    counts (8 links) and the ring's charge to the tenant's shared memory come back, every time."""
    for _ in range(80):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(_fast(ring_broker))
        send_frame(sock, {"token": ring_broker.tokens["alice"], "session": gpu.session, "link": 1,
                          "ring": {"window": 8}})
        sock.close()
    t = _ring(ring_broker, gpu.session)  # (the session's 8 places were each taken 10 times)
    assert _carrier(t).kind == "ring"
    t.call(Synchronize())
    t.close()


def test_queued_commands_leave_the_client_once_the_worker_ran_everything_sent(ring_broker: BrokerProcess) -> None:
    """On the ring two commands queued go at once to a worker that has answered everything sent (at a burst's
    start, and after the worker's answer came), so the worker does not idle behind a client still queueing; what
    queues while the worker works goes with them (the order and grouping: tests/client/test_transports.py)."""
    with connect(ring_broker.target, token=ring_broker.tokens["alice"], transport="ring",
                 async_commands=True, shared_memory=False) as gpu:
        kernel = gpu.compile_kernel(samples.source(gpu.device_info().backend), "scale_inplace")
        buf = gpu.allocate_memory(4)
        gpu.synchronize()
        t = gpu.transport
        assert isinstance(t, BatchingTransport)
        launch = [buf, np.float32(1), np.int32(1)]
        sent = t._next_id
        gpu.execute_kernel(kernel, 1, 1, launch)
        assert t._next_id == sent and len(t._pending) == 1  # one alone waits for a second (or a wait)
        gpu.execute_kernel(kernel, 1, 1, launch)  # nothing unacknowledged: sent at once
        assert t._next_id == sent + 1 and not t._pending
        acks = _carrier(t)._acks
        assert acks is not None
        wait_for(acks.ready, timeout=30, what="the worker's ack")  # (read by no one yet)
        gpu.execute_kernel(kernel, 1, 1, launch)
        gpu.execute_kernel(kernel, 1, 1, launch)  # looked, found the worker idle, and sent
        assert t._next_id == sent + 2 and not t._pending
        gpu.synchronize()


def test_the_worker_rings_only_a_client_that_may_block(ring_broker: BrokerProcess, gpu: RemoteGpu) -> None:
    """Issue 25's hot path: an ack for a client that said it looks at the ring before it blocks (its awake word,
    wire/ring.py) costs no doorbell; one for a client that may block rings it, as every ack did before."""
    t = _ring(ring_broker, gpu.session)
    r = _carrier(t)
    assert r._words is not None and r._bell is not None and r._commands is not None and r._acks is not None
    t.call(Synchronize())
    drain_bell(r._bell)  # (what the opening took)
    for batch, (awake, rung) in enumerate(((1, False), (0, True), (1, False)), start=100):
        r._words[CLIENT_AWAKE] = awake
        assert r._commands.put(encode(Batch(batch, 1, [Synchronize()])))
        ring_bell(r._bell)  # (the worker may be blocked: this client rings whatever the worker's word says)
        wait_for(r._acks.ready, timeout=30, what="the worker's ack")
        try:
            got = r._bell.recv(16, socket.MSG_DONTWAIT)
        except BlockingIOError:
            got = b""
        assert bool(got) is rung, (awake, got)
        assert r._acks.get() is not None
    t.close()
