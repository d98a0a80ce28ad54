"""The gRPC gate in-process (``broker/server/_grpc_peers.py``): who owns a local TCP connection, the caps at accept,
the relay both ways and the peer gRPC's handlers are told. A real broker behind it: the tests in tests/security."""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path

import pytest

from gpubroker.broker.server import _grpc_peers as gate_module
from gpubroker.broker.server._grpc_peers import GrpcGate, socket_owner

OTHER_UID = 65533
TIMEOUT = 10.0


@contextmanager
def tcp_pair(host: str = "127.0.0.1", as_uid: int | None = None) -> Iterator[tuple[socket.socket, socket.socket]]:
    """(the accepted end, the client's end) of a TCP connection on ``host``; the client's socket created by
    ``as_uid`` (root only)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as listener:
        listener.bind((host, 0))
        listener.listen()
        if as_uid is not None:
            os.seteuid(as_uid)
        try:
            client = socket.socket(family, socket.SOCK_STREAM)
        finally:
            if as_uid is not None:
                os.seteuid(0)
        with client:
            client.connect(listener.getsockname())
            accepted, _ = listener.accept()
            with accepted:
                yield accepted, client


def _has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as sock:
            sock.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.parametrize("host", ["127.0.0.1", "::1"])
def test_the_owner_of_a_local_tcp_connection_is_its_client_sockets_uid(host: str) -> None:
    if host == "::1" and not _has_ipv6_loopback():
        pytest.skip("no IPv6 loopback here")
    uid = OTHER_UID if os.geteuid() == 0 else None
    with tcp_pair(host, as_uid=uid) as (accepted, _client):
        expected = uid if uid is not None else os.geteuid()
        assert socket_owner(accepted) == expected
        # The fallback where sock_diag is missing: /proc/net/tcp{,6} says the same.
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        peer, local = accepted.getpeername()[:2], accepted.getsockname()[:2]
        assert gate_module._proc_owner(family, peer, local) == expected
    # A connection whose client end is gone has no owner.
    assert gate_module._SockDiag().owner(socket.AF_INET, ("127.0.0.1", 1), ("127.0.0.1", 2)) is None
    assert gate_module._proc_owner(socket.AF_INET, ("127.0.0.1", 1), ("127.0.0.1", 2)) is None


async def _echo_server(path: str) -> asyncio.Server:
    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
        writer.close()

    return await asyncio.start_unix_server(echo, path)


@asynccontextmanager
async def running_gate(max_connections: int, max_per_peer: int) -> AsyncIterator[tuple[GrpcGate, str, str]]:
    """A gate on a Unix socket and loopback TCP, relaying to an echo server: (the gate, its unix path, HOST:PORT)."""
    gate = GrpcGate(max_connections, max_per_peer)
    try:
        public = Path(gate.private_dir) / "public.sock"
        unix = gate.listen_unix(public, lambda _path: None)
        tcp = gate.listen_tcp("127.0.0.1:0", loopback_only=True)
        servers = [await _echo_server(gate.private_address(a)[len("unix:"):]) for a in (unix, tcp)]
        gate.start()
        yield gate, str(public), tcp
    finally:
        await gate.stop()
        for server in servers:
            server.close()


async def _open(where: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    if where.startswith("/"):
        return await asyncio.open_unix_connection(where)
    host, port = where.rsplit(":", 1)
    return await asyncio.open_connection(host, int(port))


async def _kept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
    """Whether the gate relays this connection (an echo comes back) rather than closing it."""
    writer.write(b"ping")
    try:
        return await asyncio.wait_for(reader.readexactly(4), TIMEOUT) == b"ping"
    except (asyncio.IncompleteReadError, ConnectionError):
        return False


@pytest.mark.parametrize("listener", ["unix", "tcp"])
def test_connections_past_a_peers_cap_or_the_total_are_refused_as_they_are_accepted(listener: str) -> None:
    async def main() -> None:
        async with running_gate(max_connections=5, max_per_peer=3) as (gate, unix, tcp):
            where = unix if listener == "unix" else tcp
            conns = [await _open(where) for _ in range(4)]
            kept = [await _kept(*c) for c in conns]
            assert kept == [True, True, True, False], "the fourth connection of one peer passed its cap of 3"
            assert gate.per_peer == {f"uid {os.geteuid()}": 3} and gate.open == 3
            assert gate.refusals[("grpc", "peer connections")] == 1
            # One closed gives its place back at once.
            conns[0][1].close()
            await conns[0][1].wait_closed()
            for _ in range(int(TIMEOUT / 0.01)):
                if gate.open == 2:
                    break
                await asyncio.sleep(0.01)
            again = await _open(where)
            assert await _kept(*again)
            for _reader, writer in [*conns[1:], again]:
                writer.close()

    asyncio.run(main())


def test_the_total_cap_holds_over_every_listener_and_peer() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root for a second local uid")

    async def main() -> None:
        async with running_gate(max_connections=4, max_per_peer=3) as (gate, unix, tcp):
            mine = [await _open(unix) for _ in range(3)]
            assert all([await _kept(*c) for c in mine])
            # Another uid (its socket created as that uid) gets the one place left, on the other listener.
            host, port = tcp.rsplit(":", 1)
            os.seteuid(OTHER_UID)
            try:
                others = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(2)]
            finally:
                os.seteuid(0)
            for sock in others:
                sock.setblocking(False)
                await asyncio.get_running_loop().sock_connect(sock, (host, int(port)))
            theirs = [await asyncio.open_connection(sock=sock) for sock in others]
            assert [await _kept(*c) for c in theirs] == [True, False]
            assert gate.per_peer == {f"uid {os.geteuid()}": 3, f"uid {OTHER_UID}": 1}
            assert gate.refusals[("grpc", "connections")] == 1
            for _reader, writer in [*mine, *theirs]:
                writer.close()

    asyncio.run(main())


def test_grpc_is_told_the_peer_the_gate_accepted() -> None:
    async def main() -> None:
        async with running_gate(max_connections=4, max_per_peer=4) as (_gate, unix, tcp):
            for where, expected in ((unix, f"unix:{unix} uid={os.geteuid()}"), (tcp, None)):
                reader, writer = await _open(where)
                assert await _kept(reader, writer)
                # What gRPC sees: the gate's end, an abstract Unix address, which grpc_peer maps back.
                seen = next(name for name in gate_module._relayed if gate_module._relayed[name].startswith(
                    "unix:" if expected else "ipv4:"))
                assert seen.startswith("unix-abstract:")

                class Context:
                    def peer(self) -> str:
                        return seen

                local = writer.get_extra_info("sockname")
                assert gate_module.grpc_peer(Context()) == (
                    expected or f"ipv4:127.0.0.1:{local[1]} uid={os.geteuid()}")
                writer.close()
                await writer.wait_closed()

    asyncio.run(main())


def test_a_non_loopback_peer_is_refused_on_a_listener_with_local_credentials() -> None:
    gate = GrpcGate(4, 4)
    try:
        listener = gate_module._Listener(socket.socket(), "127.0.0.1:1", "/nonexistent", loopback_only=True)
        with tcp_pair() as (accepted, _client):
            assert isinstance(gate._identify(listener, accepted, ("10.1.2.3", 5000)), str)
            assert gate._identify(listener, accepted, accepted.getpeername()) == gate_module._Peer(
                f"uid {os.geteuid()}", f"ipv4:127.0.0.1:{accepted.getpeername()[1]} uid={os.geteuid()}")
        listener.sock.close()
    finally:
        asyncio.run(gate.stop())
