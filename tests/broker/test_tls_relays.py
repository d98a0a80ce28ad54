"""The front's TLS relay processes (broker/front/_tls_relays.py), driven as `_links._serve_tcp` drives them, with a
real relay process: what each link costs is given back whatever becomes of it, and a process that falls behind
costs the front nothing past a bound."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpubroker.broker.certs import init_certs
from gpubroker.broker.front import _tls_relays
from gpubroker.broker.front._tcp_relay import HandshakeFailed
from gpubroker.broker.front._tls_relays import TlsRelays
from gpubroker.wire.tls_relay import Serve


@pytest.fixture(scope="module")
def material(tmp_path_factory: pytest.TempPathFactory) -> Serve:
    ca, server = init_certs(tmp_path_factory.mktemp("ca"))
    return Serve(server.cert.read_bytes(), server.key.read_bytes(), ca.cert.read_bytes())


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
                    client = socket.create_connection(listener.getsockname())
                    conn, _ = listener.accept()
                    link = relays.relay(conn, 65536, 5.0)
                    assert link is not None
                    link.start()
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
                clients.append(socket.create_connection(listener.getsockname()))
                conn, _ = listener.accept()
                link = relays.relay(conn, 65536, 5.0)
                assert link is not None
                link.start()
                link.abort()  # (the front's deadline or an eviction)
                with pytest.raises(EOFError):
                    await asyncio.wait_for(link.hello, 5)  # (not waiting for the stopped process)
                link.decide([], None)
            clients.append(socket.create_connection(listener.getsockname()))
            conn, _ = listener.accept()
            assert relays.relay(conn, 65536, 5.0) is None  # behind: the front relays this one itself
            conn.close()
        finally:
            os.kill(process.pid, signal.SIGCONT)
        try:
            await _until(lambda: not process.pending, "the process to catch up")
            clients.append(socket.create_connection(listener.getsockname()))
            conn, _ = listener.accept()
            assert relays.relay(conn, 65536, 5.0) is not None
            conn.close()
        finally:
            for client in clients:
                client.close()
            await relays.close()

    asyncio.run(main())
