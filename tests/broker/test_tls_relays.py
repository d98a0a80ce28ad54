"""The front's TLS relay processes (broker/front/_tls_relays.py), driven as `_links._serve_tcp` drives them, with a
real relay process: what each link costs is given back whatever becomes of it, and a process that falls behind
costs the front nothing past a bound."""

from __future__ import annotations

import asyncio
import os
import resource
import select
import signal
import socket
import ssl
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpubroker.broker.certs import init_certs
from gpubroker.broker.front import _tcp_relay, _tls_relays
from gpubroker.broker.front._tcp_relay import HandshakeFailed, ThreadRelay
from gpubroker.broker.front._tls_relays import HelperRelay, TlsRelays
from gpubroker.wire.frames import FRAME_HEADER
from gpubroker.wire.tls_relay import Serve


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Serve]:
    ca, server = init_certs(tmp_path_factory.mktemp("ca"))
    return ca.cert, Serve(server.cert.read_bytes(), server.key.read_bytes())  # (no client certificate asked)


@pytest.fixture
def material(certs: tuple[Path, Serve]) -> Serve:
    return certs[1]


@pytest.fixture
def ca_file(certs: tuple[Path, Serve]) -> Path:
    return certs[0]


@pytest.fixture
def listener() -> Iterator[socket.socket]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(256)
    yield sock
    sock.close()


def _threads(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("Threads:")))


def _connected(listener: socket.socket) -> tuple[socket.socket, socket.socket]:
    """A client's connection and its accepted end (what the front hands a relay)."""
    client = socket.create_connection(listener.getsockname())
    return client, listener.accept()[0]


def _started(relays: TlsRelays, listener: socket.socket, timeout: float = 10.0) -> tuple[socket.socket, HelperRelay]:
    """A client's connection handed to a relay process, as _serve_tcp hands it."""
    client, conn = _connected(listener)
    link = relays.relay(conn, 65536, timeout)
    assert link is not None
    link.start()
    return client, link


async def _until(condition: object, what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(0.05)


def test_links_whose_hello_fails_are_forgotten_on_both_sides(material: Serve, listener: socket.socket) -> None:
    """Connections closed before a byte, or sending bytes that are no TLS: each hello fails, the front decides
    (nothing to relay), and the link is gone from the front's table and from the process (its thread ends)."""

    async def main() -> None:
        relays = TlsRelays(material, count=1)
        await relays.start()
        try:
            process = relays.processes[0]
            assert process.pid is not None
            for garbage in (b"", b"GET / HTTP/1.0\r\n\r\n" * 4):
                for _ in range(40):
                    client, link = _started(relays, listener, 5.0)
                    if garbage:
                        client.sendall(garbage)
                    client.close()
                    with pytest.raises((EOFError, OSError, HandshakeFailed)):
                        await link.hello
                    link.decide([], None)  # (as _serve_tcp's finally does)
            await _until(lambda: not process.links and not process.pending, "the front to forget every link")
            await _until(lambda: _threads(process.pid) == 1, "the relay process's link threads to end")
        finally:
            await relays.close()

    asyncio.run(main())


def test_an_aborted_link_is_settled_at_once_and_a_process_behind_is_given_no_more(
        material: Serve, listener: socket.socket, monkeypatch: pytest.MonkeyPatch) -> None:
    """A relay process that stops answering (stopped here; behind a flood of connections evicted as fast as
    they come, in life): each link's deadline or eviction still ends it in the front at once, and past
    MAX_PENDING links it owes, it is given no more (the front's thread relays them). Once it catches up, it is."""
    monkeypatch.setattr(_tls_relays, "MAX_PENDING", 8)

    async def main() -> None:
        relays = TlsRelays(material, count=1)
        await relays.start()
        process = relays.processes[0]
        assert process.pid is not None
        clients = []
        os.kill(process.pid, signal.SIGSTOP)
        try:
            for _ in range(8):
                client, link = _started(relays, listener, 5.0)
                clients.append(client)
                link.abort()  # (the front's deadline or an eviction)
                with pytest.raises(EOFError):
                    await asyncio.wait_for(link.hello, 5)  # (not waiting for the stopped process)
                link.decide([], None)
            client, conn = _connected(listener)
            clients.append(client)
            assert relays.relay(conn, 65536, 5.0) is None  # behind: the front relays this one itself
            conn.close()
        finally:
            os.kill(process.pid, signal.SIGCONT)
        try:
            await _until(lambda: not process.pending, "the process to catch up")
            client, conn = _connected(listener)
            clients.append(client)
            assert relays.relay(conn, 65536, 5.0) is not None
            conn.close()
        finally:
            for client in clients:
                client.close()
            await relays.close()

    asyncio.run(main())


def _tls_link(relays: TlsRelays, listener: socket.socket, ca: Path) -> tuple[ssl.SSLSocket, HelperRelay]:
    """A client's TLS connection through a relay process, its handshake done and a hello sent."""
    client, link = _started(relays, listener)
    context = ssl.create_default_context(cafile=str(ca))
    tls = context.wrap_socket(client, server_hostname="localhost")
    tls.sendall(FRAME_HEADER.pack(5) + b"hello")
    return tls, link


def _vm_size(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmSize:"))) * 1024


def test_a_link_a_relay_process_has_no_thread_for_fails_alone(material: Serve, ca_file: Path,
                                                              listener: socket.socket) -> None:
    """The relay process at its address-space limit (as at a host's or container's task limit, a thread cannot
    start): the new link fails, and the process goes on relaying the links it has."""

    async def main() -> None:
        relays = TlsRelays(material, count=1)
        await relays.start()
        process = relays.processes[0]
        assert process.pid is not None
        try:
            tls, live = await asyncio.to_thread(_tls_link, relays, listener, ca_file)
            frame, _, _ = await asyncio.wait_for(live.hello, 10)
            assert frame == FRAME_HEADER.pack(5) + b"hello"
            ours, worker = socket.socketpair()
            live.decide([], worker)
            # Room for a message (a few hundred KiB) and not for a thread's stack (glibc's default: the stack limit,
            # 32 MiB when it is unlimited).
            stack = resource.prlimit(process.pid, resource.RLIMIT_STACK)[0]
            stack = 32 << 20 if stack == resource.RLIM_INFINITY else stack
            room = max(512 << 10, min(stack, 8 << 20) // 2)
            limit = resource.prlimit(process.pid, resource.RLIMIT_AS)
            resource.prlimit(process.pid, resource.RLIMIT_AS, (_vm_size(process.pid) + room, limit[1]))
            try:
                client, link = _started(relays, listener)
                # It fails the link for want of a thread ("no thread to relay it"), or, where even the message's
                # buffer finds no room (an unlimited stack limit lays memory out otherwise), leaves it to the
                # front's deadline: either way that link alone.
                done, _ = await asyncio.wait({link.hello}, timeout=5)
                if not done:
                    link.abort()  # (the front's deadline)
                with pytest.raises((OSError, EOFError)):
                    await link.hello
                link.decide([], None)
                client.close()
            finally:
                resource.prlimit(process.pid, resource.RLIMIT_AS, limit)
            assert process.alive
            tls.sendall(b"still here")  # the live link, relayed as before
            assert await asyncio.to_thread(ours.recv, 64) == b"still here"
            ours.sendall(b"and back")
            assert await asyncio.to_thread(tls.recv, 64) == b"and back"
            tls.close()
            ours.close()
        finally:
            await relays.close()

    asyncio.run(main())


def test_a_tls_handshake_under_way_is_no_idle_connection(material: Serve, listener: socket.socket) -> None:
    """Once the handshake's first bytes came (taken by OpenSSL, so a peek at the socket sees nothing), the link
    has progressed: the gate does not evict it for a newcomer while its client is still sending."""

    async def main() -> None:
        relays = TlsRelays(material, count=1)
        await relays.start()
        try:
            client, link = _started(relays, listener)
            assert not link.started
            client.sendall(b"\x16\x03\x01")  # the first bytes of a ClientHello, the rest still to come
            await _until(lambda: link.started, "the link to have started")
            assert not link.hello.done() and not link.progressed  # (a late one is still a late handshake)
            client.close()
            with pytest.raises((EOFError, OSError, HandshakeFailed)):
                await link.hello
            link.decide([], None)
        finally:
            await relays.close()

    asyncio.run(main())


def test_a_verdict_after_the_thread_stopped_waiting_still_gives_the_place_back(
        monkeypatch: pytest.MonkeyPatch, listener: socket.socket) -> None:
    """The front's verdict came after the relay's thread stopped waiting for it (the hand-off and failure delays
    are configurable past _VERDICT_WAIT): the worker's end is closed and the link's place given back."""
    monkeypatch.setattr(_tcp_relay, "_VERDICT_WAIT", 0.2)

    async def main() -> None:
        stop_r, stop_w = os.pipe()
        client, conn = _connected(listener)
        relay = ThreadRelay(conn, None, 65536, 10.0, stop_r, asyncio.get_running_loop())
        relay.start()
        client.sendall(FRAME_HEADER.pack(5) + b"hello")
        await asyncio.wait_for(relay.hello, 10)
        assert await asyncio.to_thread(client.recv, 1) == b""  # the thread gave up and closed the connection
        ended: list[bool] = []
        relay.on_end = lambda: ended.append(True)
        ours, worker = socket.socketpair()
        relay.decide([], worker)
        assert ended == [True]
        assert ours.recv(1) == b""  # (the worker's end closed)
        for end in (ours, client):
            end.close()
        os.close(stop_r)
        os.close(stop_w)

    asyncio.run(main())


def test_a_tenants_links_poll_one_at_a_time_and_two_relays_of_a_process_at_most() -> None:
    """A relay polls a while for its link's next bytes before it blocks (where the host spins), within its
    tenant's share of the process: one of the tenant's links at a time (its many links cannot keep the relay
    process's threads, the front's CPU and its GIL, polling), beside another tenant's link; at most two relays of
    a process at once. A relay past those gives up its poll at once, and blocks."""
    a, b = socket.socketpair()
    poller = select.poll()
    poller.register(a, select.POLLIN)
    alice, bob = _tcp_relay.SpinShare(200e-6), _tcp_relay.SpinShare(200e-6)
    try:
        assert _tcp_relay._spin_poll(poller, time.perf_counter() + 0.001, alice) == {}  # (polled: nothing came)
        b.send(b"x")
        assert _tcp_relay._spin_poll(poller, time.perf_counter() + 60, alice) == {a.fileno(): select.POLLIN}
        assert _tcp_relay._spin_poll(poller, time.perf_counter() + 60, bob) == {a.fileno(): select.POLLIN}
        with alice.slot:  # another of alice's links polling: hers gives up, bob's polls
            t0 = time.perf_counter()
            assert _tcp_relay._spin_poll(poller, t0 + 60, alice) == {}
            assert time.perf_counter() - t0 < 1
            assert _tcp_relay._spin_poll(poller, time.perf_counter() + 60, bob) == {a.fileno(): select.POLLIN}
        taken = [_tcp_relay._SPINNERS.acquire(blocking=False) for _ in range(2)]  # two relays polling
        try:
            assert taken == [True, True]
            t0 = time.perf_counter()
            assert _tcp_relay._spin_poll(poller, t0 + 60, _tcp_relay.SpinShare(200e-6)) == {}
            assert time.perf_counter() - t0 < 1
        finally:
            for _ in taken:
                _tcp_relay._SPINNERS.release()
    finally:
        a.close()
        b.close()


def test_a_relay_polls_at_most_half_its_time() -> None:
    """A peer that sends a byte every 100 us (its own CPU next to nothing) would keep a relay polling for it all
    the time, the front's CPU: a tenant's links earn half the wall time for polling (a little ahead, at most
    _SPIN_BURST), and block for the rest. Over one second of such a peer, on a clock of the test's own."""
    clock = [0.0]
    budget = _tcp_relay._SpinBudget(lambda: clock[0])
    polled = 0.0
    for _ in range(10_000):
        stop = budget.until(clock[0] + 200e-6)  # (a relay wants to poll 200 us for the next byte)
        poll = min(max(0.0, stop - clock[0]), 100e-6)  # (which comes 100 us later)
        budget.spent(poll)
        polled += poll
        clock[0] += 100e-6
    assert _tcp_relay._SPIN_SHARE == 0.5
    assert 0.49 <= polled <= 0.5 + _tcp_relay._SPIN_BURST, polled
