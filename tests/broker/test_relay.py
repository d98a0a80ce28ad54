"""The vsock relay, with Unix sockets standing in for vsock, on uvloop and plain asyncio; and the real listener."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import socket
import socketserver
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path

import numpy as np
import pytest
import uvloop

from gpubroker.broker import relay as relay_module
from gpubroker.broker.front.listen import listen_vsock
from gpubroker.broker.launcher import BrokerProcess, TenantSpec
from gpubroker.broker.relay import (
    VMADDR_CID_ANY,
    VMADDR_PORT_ANY,
    RelayServer,
    run_relay_command,
    serve_relay,
)
from gpubroker.client import FailedPrecondition, InvalidArgument, Unavailable, connect

TIMEOUT = 10.0
LOOPS = [pytest.param(asyncio.new_event_loop, id="asyncio"), pytest.param(uvloop.new_event_loop, id="uvloop")]


@contextlib.contextmanager
def running_relay(listen: socket.socket, target: str, loop_factory, max_connections: int = 256,
                  **limits: float) -> Iterator[RelayServer]:
    """The relay on an event loop of its own in a thread, as the broker's would run beside a blocking test."""
    started: Future[RelayServer] = Future()
    stop: Future[None] = Future()

    async def main() -> None:
        relay = await serve_relay(listen, target, max_connections, **limits)  # type: ignore[arg-type]
        stopping = asyncio.wrap_future(stop)
        started.set_result(relay)
        await stopping
        relay.close()
        await relay.wait_closed()

    def run() -> None:
        try:
            with asyncio.Runner(loop_factory=loop_factory) as runner:
                runner.run(main())
        except BaseException as exc:
            if not started.done():
                started.set_exception(exc)
            raise

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield started.result(TIMEOUT)
    finally:
        stop.set_result(None)
        thread.join(TIMEOUT)
        assert not thread.is_alive(), "the relay did not stop"


@pytest.fixture
def workdir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="gpb-relay-", dir="/tmp"))  # short: Unix socket paths are ~107 bytes
    yield path
    shutil.rmtree(path, ignore_errors=True)


def unix_listen(path: Path) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(path))
    sock.listen()
    return sock


def unix_connect(path: Path) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(TIMEOUT)
    sock.connect(str(path))
    return sock


class _Echo(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        while data := self.request.recv(65536):
            self.request.sendall(data)


class _ReadOneAndClose(socketserver.BaseRequestHandler):
    """Reads one byte, then closes: a backend that goes away under a live client."""

    def handle(self) -> None:
        self.request.recv(1)


@contextlib.contextmanager
def backend(path: Path, handler: type[socketserver.BaseRequestHandler]) -> Iterator[None]:
    server = socketserver.ThreadingUnixStreamServer(str(path), handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
    thread.start()
    try:
        yield
    finally:
        server.shutdown()
        server.server_close()


def echo(sock: socket.socket, payload: bytes) -> bytes:
    sock.sendall(payload)
    got = b""
    while len(got) < len(payload):
        chunk = sock.recv(65536)
        assert chunk, "the relay closed a connection it should keep"
        got += chunk
    return got


def assert_closed(sock: socket.socket) -> None:
    """The peer closed: EOF (or a reset), promptly; a hang fails on the socket timeout."""
    try:
        assert sock.recv(1) == b""
    except ConnectionResetError:
        pass


@pytest.mark.parametrize("loop_factory", LOOPS)
def test_grpc_session_through_the_relay(broker: BrokerProcess, workdir: Path, loop_factory) -> None:
    relay_path = workdir / "relay.sock"
    with running_relay(unix_listen(relay_path), broker.target[len("unix:"):], loop_factory), \
            connect(f"unix:{relay_path}", token=broker.tokens["alice"]) as gpu:
        assert gpu.device_info().name
        data = np.random.default_rng(1).integers(0, 255, 3 << 20, dtype=np.uint8)  # several 1 MiB chunks
        buf = gpu.allocate_memory(data.nbytes)
        gpu.copy_h2d(data, buf)
        out = np.empty_like(data)
        gpu.copy_d2h(buf, out)
        np.testing.assert_array_equal(out, data)
        gpu.free_memory(buf)


@pytest.mark.parametrize("loop_factory", LOOPS)
def test_connections_over_the_cap_are_closed_at_once(workdir: Path, loop_factory,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="gpubroker.relay")
    with backend(workdir / "echo.sock", _Echo), \
            running_relay(unix_listen(workdir / "relay.sock"), str(workdir / "echo.sock"), loop_factory,
                          max_connections=1):
        with unix_connect(workdir / "relay.sock") as first:
            assert echo(first, b"one") == b"one"  # relayed end to end: the one slot is taken
            with unix_connect(workdir / "relay.sock") as second:
                assert_closed(second)
            assert echo(first, b"still here" * 10000) == b"still here" * 10000
        # The slot frees when the first closes; the relay notices asynchronously, so retry to a deadline.
        deadline = time.monotonic() + TIMEOUT
        while True:
            with unix_connect(workdir / "relay.sock") as third:
                try:
                    assert echo(third, b"three") == b"three"
                    break
                except (AssertionError, ConnectionResetError, BrokenPipeError):
                    if time.monotonic() > deadline:
                        raise
    messages = [r.getMessage() for r in caplog.records]
    assert sum("relay: accepted AF_UNIX" in m for m in messages) >= 2
    assert any("relay: refused AF_UNIX, 1 connections already open" in m for m in messages)


@pytest.mark.parametrize("loop_factory", LOOPS)
def test_one_peer_is_capped_and_idle_connections_are_closed(workdir: Path, loop_factory,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    with backend(workdir / "echo.sock", _Echo), \
            running_relay(unix_listen(workdir / "relay.sock"), str(workdir / "echo.sock"), loop_factory,
                          max_per_peer=2, idle_seconds=0.5), \
            unix_connect(workdir / "relay.sock") as first, unix_connect(workdir / "relay.sock") as second:
        assert echo(first, b"1") == b"1" and echo(second, b"2") == b"2"
        with unix_connect(workdir / "relay.sock") as third:  # this uid's third: refused at once
            assert_closed(third)
        started = time.monotonic()
        assert_closed(first)  # then both go quiet and are closed as idle
        assert_closed(second)
        assert 0.3 < time.monotonic() - started < 0.5 + TIMEOUT / 2
    assert any("which already has 2 connections open, the limit per peer" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("loop_factory", LOOPS)
def test_backend_close_reaches_the_client(workdir: Path, loop_factory) -> None:
    with backend(workdir / "closer.sock", _ReadOneAndClose), \
            running_relay(unix_listen(workdir / "relay.sock"), str(workdir / "closer.sock"), loop_factory), \
            unix_connect(workdir / "relay.sock") as client:
        client.sendall(b"x")
        assert_closed(client)
    # A backend that is not there at all: the client is closed too, not left hanging.
    with running_relay(unix_listen(workdir / "relay2.sock"), str(workdir / "missing.sock"), loop_factory), \
            unix_connect(workdir / "relay2.sock") as client:
        assert_closed(client)


def _host_has_vsock() -> bool:
    try:
        with socket.socket(socket.AF_VSOCK, socket.SOCK_STREAM) as probe:
            probe.bind((VMADDR_CID_ANY, VMADDR_PORT_ANY))
        return True
    except (AttributeError, OSError):
        return False


def test_vsock_listener_listens_or_says_why_not(workdir: Path) -> None:
    if not _host_has_vsock():
        with pytest.raises(FailedPrecondition, match="vsock"):
            listen_vsock(VMADDR_PORT_ANY)
        return
    listener = listen_vsock(VMADDR_PORT_ANY)  # an ephemeral port: never collides with a running broker
    try:
        assert listener.family == socket.AF_VSOCK and listener.type == socket.SOCK_STREAM
        assert listener.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN) == 1
        cid, port = listener.getsockname()
        assert cid == VMADDR_CID_ANY and port != VMADDR_PORT_ANY
        with pytest.raises(FailedPrecondition, match="in use"):
            listen_vsock(port)
        if Path("/sys/module/vsock_loopback").exists():  # CID 1 reaches this host itself: relay for real
            with backend(workdir / "echo.sock", _Echo), \
                    running_relay(listener, str(workdir / "echo.sock"), uvloop.new_event_loop), \
                    socket.socket(socket.AF_VSOCK, socket.SOCK_STREAM) as client:
                client.settimeout(TIMEOUT)
                client.connect((1, port))
                assert echo(client, b"over vsock") == b"over vsock"
    finally:
        listener.close()


def test_vsock_listener_without_af_vsock(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(socket, "AF_VSOCK", raising=False)
    with pytest.raises(FailedPrecondition, match="no AF_VSOCK"):
        listen_vsock(7070)


def test_broker_relays_its_vsock_port_or_refuses_to_start() -> None:
    if not _host_has_vsock():
        with pytest.raises(Unavailable, match="vsock"):
            BrokerProcess([TenantSpec("alice")], backend="opencl", settings={"vsock_port": 7070}).start()
        return
    with socket.socket(socket.AF_VSOCK, socket.SOCK_STREAM) as probe:  # a free port, handed to the broker
        probe.bind((VMADDR_CID_ANY, VMADDR_PORT_ANY))
        port = probe.getsockname()[1]
    with BrokerProcess([TenantSpec("alice")], backend="opencl", settings={"vsock_port": port}) as proc:
        assert f"relaying vsock port {port} to unix:" in proc.log_tail()
        # The port is the broker's now: a second listener on it is refused.
        with pytest.raises(FailedPrecondition, match="in use"):
            listen_vsock(port)


@pytest.mark.parametrize(("listen", "vsock_connect", "match"), [
    ("/run/x.sock", "2:7070", "unix:PATH"), ("unix:", "2:7070", "unix:PATH"),
    ("unix:/tmp/x.sock", "7070", "CID:PORT"), ("unix:/tmp/x.sock", "host:7070", "CID:PORT")])
def test_relay_command_rejects_bad_addresses(listen: str, vsock_connect: str, match: str) -> None:
    with pytest.raises(InvalidArgument, match=match):
        run_relay_command(listen, vsock_connect)


def test_guest_relay_command_serves_a_local_socket(broker: BrokerProcess, workdir: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """`gpubroker relay`'s path, with the vsock hop to the host swapped for the broker's Unix socket."""
    monkeypatch.setattr(relay_module, "vsock_connector",
                        lambda cid, port: relay_module.unix_connector(broker.target[len("unix:"):]))
    guest = workdir / "guest.sock"
    unix_listen(guest).close()  # a stale socket from an earlier run: replaced, not an error

    def client() -> None:
        deadline = time.monotonic() + TIMEOUT
        while True:  # refused until the relay has replaced the stale socket
            try:
                unix_connect(guest).close()
                break
            except ConnectionRefusedError:
                if time.monotonic() > deadline:
                    raise
        assert guest.stat().st_mode & 0o777 == 0o600
        with connect(f"unix:{guest}", token=broker.tokens["alice"]) as gpu:
            buf = gpu.allocate_memory(1 << 20)
            gpu.copy_h2d(b"\x07" * (1 << 20), buf)
            out = bytearray(1 << 20)
            gpu.copy_d2h(buf, out)
            assert out == b"\x07" * (1 << 20)

    async def main() -> None:
        relay = asyncio.ensure_future(relay_module.run_guest_relay(str(guest), 2, 7070, mode=0o600))
        try:
            await asyncio.wait_for(asyncio.to_thread(client), TIMEOUT * 3)
        finally:
            relay.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await relay
        assert not guest.exists()  # removed on the way out

    asyncio.run(main())
