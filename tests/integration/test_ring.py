"""The same-host shared-memory ring: a Unix link upgraded to two byte rings in a sealed memfd with eventfd
doorbells. Results are the link's (tests/integration/test_fast_path.py runs its transport test on the ring); here:
what a hostile client may write into the shared memory or offer as a ring (the worker answers an error or drops
the ring, and lives on), the client's close, and the worker's death seen through a ring."""

from __future__ import annotations

import fcntl
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from gpubroker.broker import samples
from gpubroker.broker.launcher import BrokerProcess
from gpubroker.client import InvalidArgument, RemoteGpu, Unavailable, WorkerCrashed, connect
from gpubroker.client._frames import pack_frame, recv_payload, send_frame, send_payload, unpack_frame
from gpubroker.client._protocol import Batch, Synchronize, decode_ack, encode
from gpubroker.client._transports import Lost, RingTransport, unix_connector
from gpubroker.client._transports._ring import ACK_TAIL, CMD_HEAD, RING_DATA, RING_SEALS, SPIN_ENV, ring_caps

from ..conftest import TENANTS, worker_pids
from ..helpers import wait_for


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


def _ring(broker: BrokerProcess, session: str) -> RingTransport:
    return RingTransport(unix_connector(_fast(broker)), broker.tokens["alice"], session, timeout=10, fallback=False)


def _still_serves(broker: BrokerProcess, gpu: RemoteGpu, pid: int) -> None:
    """The session's own ring and a new one still work, on the same worker: nothing crashed."""
    gpu.synchronize()
    other = _ring(broker, gpu.session)
    other.call(Synchronize())
    other.close()
    assert worker_pids(broker, "alice") == [pid]


def _publish(t: RingTransport, head: int, record: bytes = b"") -> None:
    """Write ``record`` at the command ring's start and claim ``head`` bytes published, as a hostile client may."""
    assert t._mm is not None and t._words is not None
    t._mm[RING_DATA:RING_DATA + len(record)] = record
    t._words[CMD_HEAD] = head


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
    assert t._bells is not None and t._sock is not None
    _publish(t, *_BAD_COMMANDS[how])
    os.eventfd_write(t._bells[0], 1)
    ack = decode_ack(t._receive(10))
    assert ack.id == 0 and ack.error is not None and ack.error.code == "INVALID_ARGUMENT"
    assert ("malformed batch" if "no batch" in how else "broken ring") in ack.error.message
    assert t._sock.recv(1) == b""  # then the link (and with it the ring) is closed
    t.close()
    _still_serves(ring_broker, gpu, pid)


def test_an_impossible_ack_index_or_a_blocking_doorbell_drops_the_ring(ring_broker: BrokerProcess,
                                                                       gpu: RemoteGpu) -> None:
    """Where the worker cannot even answer (the client's ack index is nonsense, or it made the worker's doorbell
    blocking so a write could hang it), it drops the ring, and the client sees a lost link."""
    (pid,) = worker_pids(ring_broker, "alice")
    for spoil in ("index", "doorbell"):
        t = _ring(ring_broker, gpu.session)
        assert t._words is not None and t._bells is not None
        if spoil == "index":
            t._words[ACK_TAIL] = 1 << 40
        else:
            fcntl.fcntl(t._bells[1], fcntl.F_SETFL, fcntl.fcntl(t._bells[1], fcntl.F_GETFL) & ~os.O_NONBLOCK)
        with pytest.raises(Unavailable, match="lost"):
            t.call(Synchronize())
        t.close()
    _still_serves(ring_broker, gpu, pid)


def _hello(broker: BrokerProcess, session: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.connect(_fast(broker))
    send_frame(sock, {"token": broker.tokens["alice"], "session": session, "link": 1})
    recv_payload(sock, 1 << 16)
    return sock


def _memfd(size: int, seals: int) -> int:
    fd = os.memfd_create("test-ring", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd


def _offers(max_frame: int) -> dict[str, tuple[Any, Callable[[], list[int]], str]]:
    cap = ring_caps(4, max_frame)
    good = {"ring": 1, "commands": cap, "acks": cap}
    size = RING_DATA + 2 * cap

    def bells() -> list[int]:
        return [os.eventfd(0, os.EFD_NONBLOCK), os.eventfd(0, os.EFD_NONBLOCK)]

    def pipe() -> list[int]:
        r, w = os.pipe()
        return [_memfd(size, RING_SEALS), r, w]

    return {
        "unsealed": (good, lambda: [_memfd(size, 0), *bells()], "not sealed"),
        "too small": (good, lambda: [_memfd(size - 4096, RING_SEALS), *bells()], "holds"),
        "huge rings": ({**good, "acks": 1 << 40}, lambda: [_memfd(size, RING_SEALS), *bells()], "size"),
        "tiny rings": ({**good, "commands": 16}, lambda: [_memfd(size, RING_SEALS), *bells()], "size"),
        "a long spin": ({**good, "spin_us": 10**6}, lambda: [_memfd(size, RING_SEALS), *bells()], "spin"),
        "a pipe for doorbells": (good, pipe, "eventfds"),
        "two fds": (good, lambda: [_memfd(size, RING_SEALS), bells()[0]], "3 fds"),
        "not a map": ([1, 2, 3], lambda: [_memfd(size, RING_SEALS), *bells()], "ring upgrade"),
    }


@pytest.mark.parametrize("how", list(_offers(1 << 20)))
def test_a_bad_ring_offer_is_refused_and_the_link_stays(ring_broker: BrokerProcess, gpu: RemoteGpu,
                                                        how: str) -> None:
    (pid,) = worker_pids(ring_broker, "alice")
    max_frame = gpu.transport.max_frame
    request, make_fds, message = _offers(max_frame)[how]
    sock = _hello(ring_broker, gpu.session)
    fds = make_fds()
    try:
        frame = pack_frame(request)
        sent = socket.send_fds(sock, [frame], fds)
        sock.sendall(frame[sent:])
    finally:
        for fd in fds:
            os.close(fd)
    _, status, error = unpack_frame(recv_payload(sock, 1 << 16))
    assert status == 1 and error["code"] == InvalidArgument.code and message in error["message"]
    send_payload(sock, encode(Batch(1, 1, [Synchronize()])))  # still a plain link
    ack = decode_ack(recv_payload(sock, 1 << 16))
    assert ack.id == 1 and ack.done == 1 and ack.error is None
    sock.close()
    _still_serves(ring_broker, gpu, pid)


@pytest.mark.parametrize("spin", ["0", "50"], ids=["block", "spin"])
@pytest.mark.parametrize("async_commands", [False, True], ids=["sync", "async"])
def test_results_through_the_ring_spinning_or_not(ring_broker: BrokerProcess, async_commands: bool, spin: str,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Dependent kernels and reads back, many round trips, across the ring's wrap (small records, 1 MiB reads)."""
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
    stop, counts, errors = threading.Event(), [0], list[BaseException]()

    def hammer() -> None:
        try:
            with connect(ring_broker.target, token=ring_broker.tokens["alice"], transport="ring") as alice:
                while not stop.is_set():
                    alice.synchronize()
                    counts[0] += 1
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=hammer)
    thread.start()
    try:
        wait_for(lambda: counts[0] > 100 or bool(errors), 30, "alice's ring to be busy")
        with connect(ring_broker.target, token=ring_broker.tokens["bob"], transport="grpc", timeout=20) as bob:
            kernel = bob.compile_kernel(samples.source(bob.device_info().backend), "empty_kernel")
            start = counts[0]
            t0 = time.monotonic()
            for _ in range(20):
                bob.execute_kernel(kernel, 1, 1, [])
                bob.synchronize()
            took = time.monotonic() - t0
        assert counts[0] > start, "alice stopped while bob ran: this test shows nothing"
        assert took < 10, f"bob's 20 launches took {took:.1f} s beside a spinning ring"
    finally:
        stop.set()
        thread.join(30)
    assert not errors


def test_a_refused_upgrade_leaves_auto_on_the_link_and_ring_says_why(ring_broker: BrokerProcess,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A client offering rings smaller than a frame (as an older or broken one might) is refused by the worker:
    "auto" goes on over the plain link it upgraded, "ring" raises the worker's reason."""
    import gpubroker.client._transports._ring as ring_module

    monkeypatch.setattr(ring_module, "ring_caps", lambda window, max_frame: 4096)
    with connect(ring_broker.target, token=ring_broker.tokens["alice"]) as gpu:
        assert gpu.transport.kind == "unix"
        buf = gpu.allocate_memory(64)
        gpu.memset(buf, 7)
        out = np.empty(64, dtype=np.uint8)
        gpu.copy_d2h(buf, out)
        assert (out == 7).all()
    with pytest.raises(Unavailable, match=r"no link .*unix: a ring's size must be"):
        connect(ring_broker.target, token=ring_broker.tokens["alice"], transport="ring")


def test_random_corruption_of_the_command_ring_is_answered_or_dropped(ring_broker: BrokerProcess,
                                                                      gpu: RemoteGpu) -> None:
    """Mutated batches, lengths and heads (seeded): each ring gets an answer or is closed, never a hang, and
    the worker serves on."""
    (pid,) = worker_pids(ring_broker, "alice")
    rng = np.random.default_rng(1313)
    base = bytearray(encode(Batch(1, 1, [Synchronize()])))
    for _ in range(40):
        t = _ring(ring_broker, gpu.session)
        assert t._bells is not None
        record = bytearray(base)
        for at in rng.integers(0, len(record), int(rng.integers(1, 4))):
            record[at] = int(rng.integers(0, 256))
        length = len(record) if rng.random() < 0.7 else int(rng.integers(0, 1 << 32))
        head = 4 + len(record) + (0 if rng.random() < 0.7 else int(rng.integers(-4 - len(record) + 1, 1 << 20)))
        _publish(t, head, length.to_bytes(4, "little") + bytes(record))
        os.eventfd_write(t._bells[0], 1)
        try:
            decode_ack(t._receive(10))  # an answer (a refusal, or the batch's own ack)
        except Lost:
            pass  # or the ring closed
        t.close()
    _still_serves(ring_broker, gpu, pid)
