"""gRPC from VM guests (``vsock_port``) is held to the gRPC gate's per-peer caps and call rate, each guest by its CID.

The hole (issue 21, round 5, a known gap): the broker relayed ``vsock_port`` byte for byte to gRPC's private socket
(``broker/relay.py``), past the gate. A guest's calls were not held to ``max_grpc_calls_per_peer_per_second`` (HTTP/2
rapid reset from a VM went on unbounded, its connection never cut), and its connections were capped only by the
relay's own count (``max_unauthenticated_per_uid``, 64), not ``max_grpc_connections_per_peer``.

The fix: the gate accepts on the vsock port itself, names each guest by its CID (which the host's kernel sets), and
holds it to every per-peer cap and rate like any other peer.

This host has no vsock loopback (nothing here can connect to its own vsock port), so the broker's vsock listener is
a Unix socket standing in for it (``vsock_standin/sitecustomize.py``): a peer of it is named as the guest whose CID
the abstract address it bound says, as the kernel names a real guest. Everything else is real: the broker, its gate,
gRPC, PoCL; the guests speak HTTP/2 themselves, or a real client through a guest's relay.
"""

from __future__ import annotations

import itertools
import os
import socket
import socketserver
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpubroker.broker.launcher import BrokerProcess, TenantSpec
from gpubroker.client import connect

from ..helpers import wait_for

TIMEOUT = 10.0
CALL_BURST = 30  # grpc_call_burst_per_peer: a guest's client session needs well under this many calls
PER_GUEST = 3  # max_grpc_connections_per_peer
STANDIN = Path(__file__).with_name("vsock_standin")
_names = itertools.count()


def _frame(ftype: int, flags: int, sid: int, payload: bytes = b"") -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes([ftype, flags]) + struct.pack(">I", sid) + payload


def _literal(name: str, value: str) -> bytes:  # an HPACK literal field, not indexed, no Huffman coding
    return b"\x00" + bytes([len(name)]) + name.encode() + bytes([len(value)]) + value.encode()


PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + _frame(4, 0, 0) + _frame(4, 1, 0)
HEADERS = b"".join(_literal(k, v) for k, v in [
    (":method", "POST"), (":scheme", "http"), (":path", "/gpubroker.v1.GpuBroker/ListDevices"),
    (":authority", "localhost"), ("content-type", "application/grpc"), ("te", "trailers")])


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerProcess]:
    tmp = tmp_path_factory.mktemp("vsockgate")
    standin = f"/tmp/gpb-vsock-{os.getpid()}.sock"  # (short: Unix socket paths are ~107 bytes)
    settings = {"cache_dir": str(tmp / "caches"), "vsock_port": 7070, "max_grpc_connections_per_peer": PER_GUEST,
                "max_grpc_calls_per_peer_per_second": 1.0, "grpc_call_burst_per_peer": CALL_BURST,
                "grpc_idle_seconds": 300.0}  # (no idle close within the test: a cut is the gate's)
    env = {"PYTHONPATH": str(STANDIN), "GPB_TEST_VSOCK_STANDIN": standin}
    try:
        with BrokerProcess([TenantSpec("alice")], backend="opencl", settings=settings, env=env) as proc:
            proc.standin = standin  # type: ignore[attr-defined]
            yield proc
    finally:
        Path(standin).unlink(missing_ok=True)


def guest_socket(broker: BrokerProcess, cid: int) -> socket.socket:
    """A connection to the broker's vsock port from the guest ``cid``."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(TIMEOUT)
    sock.bind(f"\0gpb-guest-{cid}-{os.getpid()}{next(_names):04d}")
    sock.connect(broker.standin)  # type: ignore[attr-defined]
    return sock


def closed_by_broker(sock: socket.socket) -> bool:
    """Read until the broker closes ``sock`` (True), or it stays open for TIMEOUT (False)."""
    try:
        while sock.recv(1 << 16):
            pass
    except ConnectionResetError:
        pass
    except TimeoutError:
        return False
    return True


def admitted(sock: socket.socket) -> bool:
    """Send the HTTP/2 preface: gRPC's SETTINGS come back through the gate if it admitted ``sock``; a refused one is
    closed unread."""
    try:
        sock.sendall(PREFACE)
        return bool(sock.recv(1 << 16))
    except (ConnectionResetError, BrokenPipeError):
        return False


class _Pipe(socketserver.BaseRequestHandler):
    """A guest's ``gpubroker relay``: each local connection goes to the broker's vsock port as the guest's."""

    def handle(self) -> None:
        server: _GuestRelay = self.server  # type: ignore[assignment]
        with guest_socket(server.broker, server.cid) as up:
            up.settimeout(None)
            back = threading.Thread(target=_copy, args=(up, self.request), daemon=True)
            back.start()
            _copy(self.request, up)
            back.join(TIMEOUT)


def _copy(src: socket.socket, dst: socket.socket) -> None:
    try:
        while data := src.recv(1 << 16):
            dst.sendall(data)
        dst.shutdown(socket.SHUT_WR)
    except OSError:
        pass


class _GuestRelay(socketserver.ThreadingUnixStreamServer):
    daemon_threads = True

    def __init__(self, path: str, broker: BrokerProcess, cid: int) -> None:
        self.broker, self.cid = broker, cid
        super().__init__(path, _Pipe)


def test_guest_over_its_call_rate_is_cut_and_other_guests_are_not(broker: BrokerProcess, tmp_path: Path) -> None:
    with guest_socket(broker, 3) as flooder:
        # HTTP/2 rapid reset from guest 3: 100 calls opened and cancelled at once, more than its bucket holds.
        flooder.sendall(PREFACE + b"".join(_frame(1, 0x4, sid, HEADERS) + _frame(3, 0, sid, struct.pack(">I", 8))
                                           for sid in range(1, 201, 2)))
        assert closed_by_broker(flooder), "guest 3's connection stayed open past its call rate"
    wait_for(lambda: "action=close-connection peer=vsock:3:" in broker.log_tail(200_000), TIMEOUT,
             "the audit line of guest 3's cut")
    # Guest 4 is a peer of its own: its bucket is full, its client's session is served.
    path = f"/tmp/gpb-guest4-{os.getpid()}.sock"
    relay = _GuestRelay(path, broker, 4)
    threading.Thread(target=relay.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    try:
        with connect(f"unix:{path}", token=broker.tokens["alice"]) as gpu:
            assert gpu.device_info().name
    finally:
        relay.shutdown()
        relay.server_close()
        Path(path).unlink(missing_ok=True)
    assert "peer=vsock:4:" not in broker.log_tail(200_000)


def test_each_guest_holds_at_most_its_connections(broker: BrokerProcess) -> None:
    held = [guest_socket(broker, 5) for _ in range(PER_GUEST)]
    held += [guest_socket(broker, 6) for _ in range(PER_GUEST)]
    try:
        assert all(admitted(sock) for sock in held)  # each guest's first PER_GUEST: counted apart
        with guest_socket(broker, 5) as extra:  # guest 5's next: refused as the gate accepts it
            assert not admitted(extra) and closed_by_broker(extra)
        # (the refusal's audit line is written just after the close)
        wait_for(lambda: "action=refuse-connection listener=vsock:7070 peer=vsock:5:" in broker.log_tail(200_000),
                 TIMEOUT, "the audit line of guest 5's refusal")
    finally:
        for sock in held:
            sock.close()


def test_a_guests_control_frame_flood_is_cut(broker: BrokerProcess) -> None:
    """HTTP/2 frames that start no call (empty SETTINGS here) past the guest's
    max_grpc_control_frames_per_peer_per_second: the gate stops relaying them and closes the connection."""
    with guest_socket(broker, 7) as flooder:
        ended = threading.Event()
        closed: list[bool] = []

        def drain() -> None:  # (gRPC acknowledges each SETTINGS: a flooder that does not read is held back)
            closed.append(closed_by_broker(flooder))
            ended.set()

        threading.Thread(target=drain, daemon=True).start()
        flood = _frame(4, 0, 0, b"") * 4096
        # (well before grpc_unauthenticated_seconds, 10 s, which closes a connection that never authenticates)
        deadline = time.monotonic() + 5.0
        try:
            flooder.sendall(PREFACE)
            while not ended.is_set() and time.monotonic() < deadline:
                flooder.sendall(flood)
        except OSError:
            pass
        assert ended.wait(max(0.0, deadline - time.monotonic())) and closed == [True], (
            "guest 7's connection stayed open through 5 s of its control-frame flood")
    wait_for(lambda: "peer=vsock:7:" in broker.log_tail(200_000) and "max_grpc_control_frames_per_peer_per_second"
             in broker.log_tail(200_000), TIMEOUT, "the audit line of guest 7's cut")
