"""The gRPC gate in-process (``src/gpubroker/broker/front/_grpc_peers.py``): who owns a local TCP connection, the
caps at accept, the relay both ways and the peer gRPC's handlers are told. A real broker behind it: the tests in
tests/security."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path

import pytest
import uvloop

from gpubroker.broker.front import _grpc_peers as gate_module
from gpubroker.broker.front import _owners as owners_module
from gpubroker.broker.front._grpc_peers import H2_PREFACE, ControlFrames, GrpcGate
from gpubroker.broker.front._owners import socket_owner
from gpubroker.broker.front.listeners import PeerRate, peer_of

OTHER_UID = 65533
TIMEOUT = 10.0


@pytest.fixture(params=[False, True], ids=["front-loop", "own-thread"])
def own_thread(request: pytest.FixtureRequest) -> bool:
    """Where the gate relays: on the loop that runs it (the broker's), or on a thread and uvloop of its own."""
    return bool(request.param)


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
        assert owners_module._proc_owner(family, peer, local) == expected
    # A connection whose client end is gone has no owner.
    assert owners_module._SockDiag().owner(socket.AF_INET, ("127.0.0.1", 1), ("127.0.0.1", 2)) is None
    assert owners_module._proc_owner(socket.AF_INET, ("127.0.0.1", 1), ("127.0.0.1", 2)) is None


async def _echo_server(path: str) -> asyncio.Server:
    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
        writer.close()

    return await asyncio.start_unix_server(echo, path)


@asynccontextmanager
async def running_gate(max_connections: int, max_per_peer: int, own_thread: bool,
                       unauthenticated_seconds: float | None = None, control_rate: PeerRate | None = None,
                       max_per_tenant: int | None = None) -> AsyncIterator[tuple[GrpcGate, str, str]]:
    """A gate on a Unix socket and loopback TCP, relaying to an echo server: (the gate, its unix path, HOST:PORT)."""
    gate = GrpcGate(max_connections, max_per_peer, own_thread=own_thread,
                    unauthenticated_seconds=unauthenticated_seconds, control_rate=control_rate,
                    max_per_tenant=max_per_tenant)
    try:
        public = Path(gate.private_dir) / "public.sock"
        unix = gate.listen_unix(public, 0o600)
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
def test_connections_past_a_peers_cap_or_the_total_are_refused_as_they_are_accepted(listener: str,
                                                                                     own_thread: bool) -> None:
    async def main() -> None:
        async with running_gate(max_connections=5, max_per_peer=3, own_thread=own_thread) as (gate, unix, tcp):
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

    uvloop.run(main())


def _sockets_as(uid: int, count: int) -> list[socket.socket]:
    """TCP sockets created as ``uid`` (the gate's peer ``uid N`` once connected), all before any is connected: the
    effective uid is the whole process's, the gate's thread included, whose relaying it must not meet."""
    os.seteuid(uid)
    try:
        return [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(count)]
    finally:
        os.seteuid(0)


async def _open_from(sock: socket.socket, tcp: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A connection to ``tcp`` (HOST:PORT on loopback) from ``sock``."""
    host, port = tcp.rsplit(":", 1)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, (host, int(port)))
    return await asyncio.open_connection(sock=sock)


def _authenticate(gate: GrpcGate, writer: asyncio.StreamWriter, tenant: str = "alice") -> str | None:
    """What a call that authenticated as ``tenant`` on this connection tells the gate (``_status._admit``), and the
    gate's answer (why the call is refused, or None). On TCP, the relay is the one of the client's port; on a Unix
    socket (which names no client), any that has not authenticated."""
    local = writer.get_extra_info("sockname")
    name = next(name for name, relay in gate_module._relayed.items()
                if relay.gate is gate and not relay.authenticated
                and (f":{local[1]} " in relay.peer.name if isinstance(local, tuple) else
                     relay.peer.name.startswith("unix:")))
    return gate_module.grpc_authenticated(_Context(name), tenant)


async def _settled(condition: Callable[[], bool]) -> None:
    for _ in range(int(TIMEOUT / 0.01)):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the gate did not get there")


def test_the_total_cap_holds_over_every_listener_and_peer(own_thread: bool) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root for a second local uid")

    async def main() -> None:
        async with running_gate(max_connections=4, max_per_peer=3, own_thread=own_thread) as (gate, unix, tcp):
            others = _sockets_as(OTHER_UID, 2)
            mine = [await _open(unix) for _ in range(3)]
            assert all([await _kept(*c) for c in mine])
            for _reader, writer in mine:  # (a connection that authenticated is never evicted)
                _authenticate(gate, writer)
            await _settled(lambda: not gate.unauthenticated)
            # Another uid (its socket created as that uid) gets the one place left, on the other listener.
            theirs = [await _open_from(sock, tcp) for sock in others]
            assert [await _kept(*c) for c in theirs] == [True, False]
            assert gate.per_peer == {f"uid {os.geteuid()}": 3, f"uid {OTHER_UID}": 1}
            await _settled(lambda: gate.refusals[("grpc", "connections")] == 1)
            for _reader, writer in [*mine, *theirs]:
                writer.close()

    uvloop.run(main())


def test_at_the_cap_a_newcomer_evicts_the_oldest_unauthenticated_connection_of_the_peer_holding_most(
        own_thread: bool) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root for a second local uid")

    async def main() -> None:
        async with running_gate(max_connections=4, max_per_peer=4, own_thread=own_thread) as (gate, unix, tcp):
            others = _sockets_as(OTHER_UID, 3)
            # One peer holds the whole pool, never authenticating (a wrong token's calls would keep it from idling).
            mine = [await _open(unix) for _ in range(4)]
            assert all([await _kept(*c) for c in mine])
            # Another peer's newcomer takes the place of the oldest of them; so does its second (3 > 1 held).
            theirs = [await _open_from(others[0], tcp)]
            assert await _kept(*theirs[0])
            assert not await _kept(*mine[0]), "the oldest unauthenticated connection was not the one evicted"
            theirs.append(await _open_from(others[1], tcp))
            assert await _kept(*theirs[1])
            assert not await _kept(*mine[1])
            assert [await _kept(*c) for c in mine[2:]] == [True, True]
            # Now each holds 2: a third of theirs would only take one of mine to make it 3 against 1, so it is
            # refused, and so is one of mine (its peer holding as many as the other).
            assert not await _kept(*await _open_from(others[2], tcp))
            assert not await _kept(*await _open(unix))
            assert gate.refusals[("grpc", "evicted unauthenticated")] == 2
            # (a refusal is counted just after its close, on the gate's thread with own_thread)
            await _settled(lambda: gate.refusals[("grpc", "connections")] == 2)
            # Authenticated, theirs are not evictable: my newcomer evicts nothing of theirs, and is refused.
            for _reader, writer in theirs:
                _authenticate(gate, writer)
            await _settled(lambda: f"uid {OTHER_UID}" not in gate.unauthenticated)
            assert gate.open == 4 and gate.per_peer == {f"uid {os.geteuid()}": 2, f"uid {OTHER_UID}": 2}
            assert not await _kept(*await _open(unix))
            assert [await _kept(*c) for c in theirs] == [True, True]
            for _reader, writer in [*mine, *theirs]:
                writer.close()

    uvloop.run(main())


def test_a_tenant_authenticates_at_most_its_share_of_connections_and_the_rest_stay_evictable(
        own_thread: bool) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root for a second local uid")

    async def main() -> None:
        async with running_gate(max_connections=4, max_per_peer=4, own_thread=own_thread,
                                max_per_tenant=2) as (gate, _unix, tcp):
            others = _sockets_as(OTHER_UID, 1)
            mine = [await _open(tcp) for _ in range(4)]  # (on TCP, _authenticate finds each one's relay)
            assert all([await _kept(*c) for c in mine])
            # alice's calls authenticate two of them; the third's call is refused and its connection stays
            # unauthenticated; bob's call on the fourth counts against bob.
            assert _authenticate(gate, mine[0][1]) is None and _authenticate(gate, mine[1][1]) is None
            refusal = _authenticate(gate, mine[2][1])
            assert refusal is not None and "max_grpc_connections_per_tenant" in refusal
            assert _authenticate(gate, mine[3][1], "bob") is None
            assert gate.per_tenant == {"alice": 2, "bob": 1} and gate.refusals[("grpc", "tenant connections")] == 1
            await _settled(lambda: len(gate.unauthenticated.get(f"uid {os.geteuid()}", ())) == 1)
            # At the cap, another peer's newcomer evicts the one alice could not authenticate.
            theirs = await _open_from(others[0], tcp)
            assert await _kept(*theirs)
            assert not await _kept(*mine[2]), "the connection refused for its tenant's share was not the one evicted"
            # One of alice's closes: its place in her share goes back.
            mine[0][1].close()
            await _settled(lambda: gate.per_tenant.get("alice") == 1)
            for _reader, writer in [*mine[1:], theirs]:
                writer.close()
            await _settled(lambda: not gate.per_tenant)

    uvloop.run(main())


def test_a_connection_that_does_not_authenticate_in_time_is_closed(own_thread: bool) -> None:
    grace = 0.5

    async def main() -> None:
        async with running_gate(max_connections=4, max_per_peer=4, own_thread=own_thread,
                                unauthenticated_seconds=grace) as (gate, _unix, tcp):
            began = time.monotonic()
            kept, dropped = await _open(tcp), await _open(tcp)
            assert await _kept(*kept) and await _kept(*dropped)
            _authenticate(gate, kept[1])
            # Traffic (a call that fails to authenticate, say) does not keep it: the deadline runs from its accept.
            for _ in range(int(TIMEOUT / 0.05)):
                if not await _kept(*dropped):
                    break
                await asyncio.sleep(0.05)
            closed_after = time.monotonic() - began
            assert grace <= closed_after < TIMEOUT, f"closed after {closed_after:.2f} s"
            assert gate.refusals[("grpc", "unauthenticated timeout")] == 1
            await _settled(lambda: gate.open == 1)
            await asyncio.sleep(grace)
            assert await _kept(*kept), "an authenticated connection was closed"
            kept[1].close()

    uvloop.run(main())


class _Context:
    """What grpc_peer asks of a gRPC servicer context."""

    def __init__(self, peer: str) -> None:
        self._peer = peer

    def peer(self) -> str:
        return self._peer


def test_grpc_is_told_the_peer_the_gate_accepted(own_thread: bool) -> None:
    async def main() -> None:
        async with running_gate(max_connections=4, max_per_peer=4, own_thread=own_thread) as (_gate, unix, tcp):
            for where, expected in ((unix, f"unix:{unix} uid={os.geteuid()}"), (tcp, None)):
                reader, writer = await _open(where)
                assert await _kept(reader, writer)
                # What gRPC sees: the gate's end, an abstract Unix address, which grpc_peer maps back.
                seen = next(name for name in gate_module._relayed if gate_module._relayed[name].peer.name.startswith(
                    "unix:" if expected else "ipv4:"))
                assert seen.startswith("unix-abstract:")

                local = writer.get_extra_info("sockname")
                assert gate_module.grpc_peer(_Context(seen)) == (
                    expected or f"ipv4:127.0.0.1:{local[1]} uid={os.geteuid()}")
                writer.close()
                await writer.wait_closed()

    uvloop.run(main())


def test_a_non_loopback_peer_is_refused_on_a_listener_with_local_credentials() -> None:
    gate = GrpcGate(4, 4)
    try:
        listener = gate_module._Listener("127.0.0.1:1", "/nonexistent", loopback_only=True)
        with tcp_pair() as (accepted, _client):
            assert isinstance(gate._identify(listener, accepted, peer_of(accepted, ("10.1.2.3", 5000))), str)
            assert gate._identify(listener, accepted, peer_of(accepted, accepted.getpeername())) == gate_module._Peer(
                f"uid {os.geteuid()}", f"ipv4:127.0.0.1:{accepted.getpeername()[1]} uid={os.geteuid()}")
    finally:
        asyncio.run(gate.stop())


# A gate in a process of its own, allowed few descriptors (its backend in another, as gRPC would be in the broker
# but with descriptors of its own here): connections past what the gate can accept wait in the backlog while it
# backs off (it does not spin), and are relayed once descriptors are free again.
ECHO = """
import socket, sys, threading
server = socket.socket(socket.AF_UNIX)
server.bind(sys.argv[1])
server.listen(1024)
print("up", flush=True)
def echo(conn):
    with conn:
        while data := conn.recv(65536):
            conn.sendall(data)
while True:
    threading.Thread(target=echo, args=(server.accept()[0],), daemon=True).start()
"""
OUT_OF_DESCRIPTORS = """
import asyncio, resource, subprocess, sys
from pathlib import Path
from gpubroker.broker.front._grpc_peers import GrpcGate

async def main():
    gate = GrpcGate(1000, 1000)
    public = Path(gate.private_dir) / "public.sock"
    gate.listen_unix(public, 0o600)
    echo = subprocess.Popen([sys.executable, "-c", sys.argv[1], gate.private_address(f"unix:{public}")[5:]],
                            stdout=subprocess.PIPE, text=True)
    echo.stdout.readline()
    gate.start()
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (48, hard))
    print(public, flush=True)
    while await asyncio.to_thread(sys.stdin.readline):
        print(gate.accept_failures, flush=True)
    echo.kill()
    await gate.stop()

asyncio.run(main())
"""


def test_out_of_descriptors_the_gate_backs_off_and_accepts_again_later() -> None:
    child = subprocess.Popen([sys.executable, "-c", OUT_OF_DESCRIPTORS, ECHO], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    stdin, stdout = child.stdin, child.stdout
    assert stdin is not None and stdout is not None

    def accept_failures() -> int:
        stdin.write("\n")
        stdin.flush()
        return int(stdout.readline())

    def echoed(sock: socket.socket) -> bool:
        sock.settimeout(TIMEOUT)
        try:
            sock.sendall(b"ping")
            return sock.recv(4) == b"ping"
        except OSError:
            return False

    conns: list[socket.socket] = []
    try:
        path = stdout.readline().strip()
        # Each relayed connection takes two of the gate's 48 descriptors: about 15 fit; the rest wait in the
        # listener's backlog while accept fails with EMFILE.
        for _ in range(40):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect(path)
            conns.append(sock)
        assert echoed(conns[0]), "the first connection was not relayed"
        waiting = conns[-1]
        waiting.sendall(b"ping")
        waiting.setblocking(False)
        before, started = accept_failures(), time.monotonic()
        time.sleep(1.0)  # (a window to count the gate's tries in, while it cannot accept)
        tries, elapsed = accept_failures() - before, time.monotonic() - started
        # Backing off, it tries again after 0.05 s, 0.1 s, ... 1 s; spinning, it would try thousands of times.
        assert tries <= 10, f"the gate tried to accept {tries} times in {elapsed:.1f} s while out of descriptors"
        with pytest.raises(BlockingIOError):
            waiting.recv(4)  # (not relayed yet)
        # Descriptors free again: the waiting connection is accepted and relayed.
        for sock in conns[:-1]:
            sock.close()
        waiting.settimeout(TIMEOUT)
        assert waiting.recv(4) == b"ping", "the waiting connection was never relayed"
    finally:
        for sock in conns:
            sock.close()
        stdin.close()
        child.wait(timeout=TIMEOUT)


def _frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    """An HTTP/2 frame (RFC 9113 4.1)."""
    return len(payload).to_bytes(3, "big") + bytes([kind, flags]) + stream.to_bytes(4, "big") + payload


SETTINGS, WINDOW_UPDATE, HEADERS, DATA, CONTINUATION, RST_STREAM = 4, 8, 1, 0, 9, 3


def test_control_frames_are_counted_from_frame_headers_split_anyhow_across_reads() -> None:
    # 3 control frames (one of them 1 KiB: 1 + 4 tokens), an empty DATA frame that does not end its stream (1), a
    # HEADERS (1: a call, whose frames gRPC parses whether or not it reaches a handler) and two DATA frames under
    # SMALL_DATA_BYTES, ending their stream or not (1 each: 1-byte DATA frames were a flood nothing counted); a DATA
    # frame of 1 KiB or more and an empty DATA that ends its stream cost nothing.
    stream = H2_PREFACE + (_frame(SETTINGS, 0, 0) + _frame(HEADERS, 4, 1, b"\x82" * 30)
                           + _frame(DATA, 0, 1, b"x" * 20000) + _frame(WINDOW_UPDATE, 0, 1, b"\0\0\0\1")
                           + _frame(DATA, 0, 1, b"x" * 1024) + _frame(DATA, 0, 1, b"x" * 1023)
                           + _frame(DATA, 1, 3, b"x")
                           + _frame(CONTINUATION, 0, 1, b"y" * 1024) + _frame(DATA, 0, 1) + _frame(DATA, 1, 1)) * 3
    for size in (1, 2, 7, 9, 10, 100, 4096, len(stream)):
        frames = ControlFrames()
        cost = sum(frames.feed(stream[at:at + size], 1e9) for at in range(0, len(stream), size))
        assert cost == 3 * (1 + 1 + 1 + 1 + 1 + 5 + 1), f"reads of {size} bytes"
    # A HEADERS frame's header block costs as a CONTINUATION's does: one more per 256 bytes (16 KiB: 1 + 64).
    assert ControlFrames().feed(H2_PREFACE + _frame(HEADERS, 5, 1, b"a" * 16384), 1e9) == 65
    # An RST_STREAM cancelling a call it opened is part of that call (its HEADERS' token); one more is not.
    cancels = ControlFrames()
    assert cancels.feed(H2_PREFACE + (_frame(HEADERS, 4, 1, b"\x82") + _frame(RST_STREAM, 0, 1, b"\0\0\0\x08")) * 50
                        + _frame(RST_STREAM, 0, 1, b"\0\0\0\x08") * 5, 1e9) == 50 + 5
    # A flood is read no further than the budget it goes over.
    assert ControlFrames().feed(H2_PREFACE + _frame(SETTINGS, 0, 0) * 1000, 10) == 11
    # TLS (a ClientHello), or anything but the cleartext preface, is passed through unread.
    tls = ControlFrames()
    assert tls.feed(b"\x16\x03\x01\x02\x00", 1e9) == 0 and tls.reading is False
    assert tls.feed(H2_PREFACE + _frame(SETTINGS, 0, 0) * 100, 1e9) == 0


def test_a_peer_past_its_control_frame_rate_has_its_connection_cut_while_calls_data_pass(own_thread: bool) -> None:
    async def echoes(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, data: bytes) -> bool:
        writer.write(data)
        try:
            return await asyncio.wait_for(reader.readexactly(len(data)), TIMEOUT) == data
        except (asyncio.IncompleteReadError, ConnectionError):
            return False

    async def main() -> None:
        # A bucket of 100 frames, refilled at one a second: a call's 60 pass, a flood's 200 do not.
        async with running_gate(max_connections=4, max_per_peer=4, own_thread=own_thread,
                                control_rate=PeerRate(1.0, 100)) as (gate, unix, _tcp):
            call = await _open(unix)
            megabyte = b"".join(_frame(DATA, 0, 1, b"x" * 16384) for _ in range(64))
            assert await echoes(*call, H2_PREFACE + _frame(SETTINGS, 0, 0) + _frame(HEADERS, 4, 1, b"\x82")
                                + megabyte + _frame(WINDOW_UPDATE, 0, 0, b"\0\0\1\0") * 59)
            flood = await _open(unix)
            assert not await echoes(*flood, H2_PREFACE + _frame(SETTINGS, 0, 0) * 200), "a flood was relayed"
            assert gate.refusals[("grpc", "control frames")] == 1
            # The peer's other connection, its frames within the bucket, is relayed as before.
            assert await echoes(*call, megabyte)
            call[1].close()
            flood[1].close()

    uvloop.run(main())
