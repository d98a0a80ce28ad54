"""The framed link over TCP (``link_listen``), through a real broker on PoCL: the front terminates TLS (mTLS as the
gRPC listener's), authenticates the hello under the pre-authentication limits, then relays the connection to
the session's worker, which answers protocol batches (src/gpubroker/wire/commands.py) on it. Raw sockets and the
protocol
module only: what a client of any language would do."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import msgpack
import numpy as np
import pytest

from gpubroker.broker.certs import CertPaths, init_certs, mint_client_cert
from gpubroker.broker.config import TlsConfig
from gpubroker.broker.launcher import BrokerProcess, TenantSpec
from gpubroker.v1 import broker_pb2 as pb
from gpubroker.v1 import broker_pb2_grpc as pb_grpc
from gpubroker.wire.commands import (
    Allocate,
    Batch,
    Free,
    Memset,
    Read,
    Synchronize,
    Write,
    decode_ack,
    encode,
    new_handle,
)
from gpubroker.wire.frames import FRAME_HEADER

from ..helpers import recv_payload, send_payload, wait_for

TENANTS = [TenantSpec("alice", memory_quota=1 << 20), TenantSpec("bob"), TenantSpec("carol")]
HELLO_TIMEOUT = 1.0


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, CertPaths]:
    d = tmp_path_factory.mktemp("ca")
    ca, server = init_certs(d)
    other = tmp_path_factory.mktemp("other-ca")
    init_certs(other)  # another CA: its certificate for "alice" is no certificate of this broker's
    return {"ca": ca, "server": server, "alice": mint_client_cert(d, "alice"),
            "stranger": mint_client_cert(d, "stranger"), "foreign": mint_client_cert(other, "alice")}


@pytest.fixture(scope="module")
def broker(backend: str, certs: dict[str, CertPaths]) -> Iterator[BrokerProcess]:
    tls = TlsConfig(cert_file=str(certs["server"].cert), key_file=str(certs["server"].key),
                    client_ca_file=str(certs["ca"].cert), require_client_cert=True)
    settings = {"tls": tls, "link_listen": "127.0.0.1:0", "hello_timeout_seconds": HELLO_TIMEOUT}
    with BrokerProcess(TENANTS, backend=backend, tcp=["127.0.0.1:0"], settings=settings) as proc:
        assert proc.link_port
        yield proc


def _tls(broker: BrokerProcess, certs: dict[str, CertPaths], who: str) -> ssl.SSLSocket:
    context = ssl.create_default_context(cafile=str(certs["ca"].cert))
    context.load_cert_chain(str(certs[who].cert), str(certs[who].key))
    raw = socket.create_connection(("127.0.0.1", broker.link_port), timeout=10)
    return context.wrap_socket(raw, server_hostname="localhost")




def _hello(sock: socket.socket, token: str, session: str) -> Any:
    send_payload(sock, msgpack.packb({"token": token, "session": session, "link": 1}))
    return msgpack.unpackb(recv_payload(sock))


def _open_session(broker: BrokerProcess, certs: dict[str, CertPaths]) -> tuple[grpc.Channel, str, int]:
    """A session of alice's over the TLS gRPC listener (her certificate names her); its id and link port."""
    credentials = grpc.ssl_channel_credentials(certs["ca"].cert.read_bytes(), certs["alice"].key.read_bytes(),
                                               certs["alice"].cert.read_bytes())
    channel = grpc.secure_channel(broker.tcp_target, credentials,
                                  options=[("grpc.ssl_target_name_override", "localhost")])
    reply = pb_grpc.GpuBrokerStub(channel).OpenSession(pb.OpenSessionRequest(device=0), timeout=60)
    return channel, reply.session, reply.link_port


def test_a_wrong_token_is_refused_as_on_grpc(broker: BrokerProcess, certs: dict[str, CertPaths]) -> None:
    # A certificate that names no tenant, so the token decides (allow_tokens defaults to true).
    with _tls(broker, certs, "stranger") as sock:
        _, status, error = _hello(sock, "gpb_bogus_token", "ses_x")
        assert status == 1 and error["code"] == "UNAUTHENTICATED"
        assert sock.recv(1) == b""
    assert "method=link/hello" in broker.log_tail(100_000)


def test_a_silent_connection_is_closed_after_the_hello_timeout(broker: BrokerProcess,
                                                               certs: dict[str, CertPaths]) -> None:
    with _tls(broker, certs, "alice") as sock:
        started = time.monotonic()
        assert sock.recv(1) == b""
        took = time.monotonic() - started
    assert HELLO_TIMEOUT * 0.9 <= took < HELLO_TIMEOUT + 2.0, took
    assert "reason=no hello within hello_timeout_seconds" in broker.log_tail(100_000)


def test_an_oversize_hello_is_refused_before_its_body_is_read(broker: BrokerProcess,
                                                              certs: dict[str, CertPaths]) -> None:
    with _tls(broker, certs, "alice") as sock:
        sock.sendall(FRAME_HEADER.pack(1 << 20))  # only the header: the answer must not wait for the body
        _, status, error = msgpack.unpackb(recv_payload(sock))
        assert status == 1 and error["code"] == "INVALID_ARGUMENT" and "at most 65536 bytes" in error["message"]
        assert sock.recv(1) == b""


def _link(broker: BrokerProcess, certs: dict[str, CertPaths], transport: str) -> socket.socket:
    """A link to the broker: the same-host ``<socket>.fast`` (handed to the worker whole) or TLS (relayed)."""
    if transport == "tls":
        return _tls(broker, certs, "alice")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.connect(broker.target.removeprefix("unix:") + ".fast")
    return sock


@pytest.mark.parametrize("transport", ["unix", "tls"])
def test_the_link_carries_batches_to_the_worker(broker: BrokerProcess, certs: dict[str, CertPaths],
                                                transport: str) -> None:
    channel, session, port = _open_session(broker, certs)
    with channel:
        assert port == broker.link_port
        with _tls(broker, certs, "stranger") as sock:  # bob's token: not bob's session
            _, status, error = _hello(sock, broker.tokens["bob"], session)
            assert status == 1 and error["code"] == "NOT_FOUND"
        with _link(broker, certs, transport) as sock:
            # Over TLS alice's certificate authenticates her (no token); on the Unix socket her token does.
            _, status, reply = _hello(sock, "" if transport == "tls" else broker.tokens["alice"], session)
            assert status == 0 and reply["link"] == 1 and reply["max_frame"] > 0
            buf = new_handle("buf")
            data = np.arange(1024, dtype=np.float32).tobytes()
            send_payload(sock, encode(Batch(1, 0, [Allocate(buf, len(data)), Write((buf, 0), 0, data),
                                            Memset((buf, 0), 0, 16, 0), Synchronize(), Read((buf, 0), 0, len(data))])))
            ack = decode_ack(recv_payload(sock))
            assert (ack.id, ack.done, ack.error) == (1, 5, None)
            assert ack.result == bytes(16) + data[16:]
            # Over the tenant's quota (1 MiB): the worker refuses, naming the command, and the link goes on.
            send_payload(sock, encode(Batch(2, 5, [Allocate(new_handle("buf"), 2 << 20), Free(buf)])))
            ack = decode_ack(recv_payload(sock))
            assert ack.done == 0 and ack.error is not None and ack.error.seq == 5
            assert ack.error.code == "RESOURCE_EXHAUSTED" and "quota" in ack.error.message
            send_payload(sock, encode(Batch(3, 7, [Free(buf)])))
            assert decode_ack(recv_payload(sock)).done == 1


def test_grpc_commands_run_encoded_batches_as_they_are(broker: BrokerProcess, certs: dict[str, CertPaths]) -> None:
    channel, session, _ = _open_session(broker, certs)
    with channel:
        buf = new_handle("buf")
        batches = [Batch(1, 0, [Allocate(buf, 64), Memset((buf, 0), 7, -1), Read((buf, 8), 0, 8)]),
                   Batch(2, 3, [Read((buf, 0), 60, 8)]),  # past the end: the worker's error, in the ack
                   Batch(3, 4, [Free(buf)])]
        requests = [pb.CommandBatch(session=session if b.id == 1 else "", batch=b.id, encoded=encode(b))
                    for b in batches]
        acks = [decode_ack(a.encoded) for a in pb_grpc.GpuBrokerStub(channel).Commands(iter(requests), timeout=30)]
        assert [(a.id, a.done) for a in acks] == [(1, 3), (2, 0), (3, 1)]
        assert acks[0].result == bytes([7] * 8) and acks[0].error is None
        assert acks[1].error is not None and acks[1].error.seq == 3 and acks[1].error.code == "OUT_OF_RANGE"
        with pytest.raises(grpc.RpcError) as info:  # bytes that are no batch: the sender's error
            list(pb_grpc.GpuBrokerStub(channel).Commands(
                iter([pb.CommandBatch(session=session, batch=1, encoded=b"\x93\x01")]), timeout=30))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_an_over_quota_allocation_through_grpc_names_the_quota(broker: BrokerProcess,
                                                               certs: dict[str, CertPaths]) -> None:
    channel, session, _ = _open_session(broker, certs)
    with channel:
        stub = pb_grpc.GpuBrokerStub(channel)
        kept = stub.Allocate(pb.AllocateRequest(session=session, size=768 << 10), timeout=30)
        with pytest.raises(grpc.RpcError) as info:
            stub.Allocate(pb.AllocateRequest(session=session, size=512 << 10), timeout=30)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "quota" in str(info.value.details()) and "device 0" in str(info.value.details())
        stub.Free(pb.FreeRequest(session=session, buffer=kept.handle), timeout=30)
        stub.Free(pb.FreeRequest(session=session, buffer=stub.Allocate(
            pb.AllocateRequest(session=session, size=1 << 20), timeout=30).handle), timeout=30)


def test_a_rotated_token_closes_its_links(broker: BrokerProcess, certs: dict[str, CertPaths]) -> None:
    token = broker.tokens["carol"]
    local = grpc.composite_channel_credentials(grpc.local_channel_credentials(grpc.LocalConnectionType.UDS),
                                               grpc.access_token_call_credentials(token))
    with grpc.secure_channel(broker.target, local) as channel:
        session = pb_grpc.GpuBrokerStub(channel).OpenSession(pb.OpenSessionRequest(device=0), timeout=60).session
        with _tls(broker, certs, "stranger") as sock:  # a certificate naming no tenant: the token decides
            _, status, _ = _hello(sock, token, session)
            assert status == 0
            send_payload(sock, encode(Batch(1, 0, [Synchronize()])))
            assert decode_ack(recv_payload(sock)).done == 1
            subprocess.run([sys.executable, "-m", "gpubroker.broker.cli", "tenant", "rotate-token", "carol",
                            "--config", str(broker.config_path)], check=True, capture_output=True)
            assert broker.process is not None
            broker.process.send_signal(signal.SIGHUP)  # the reload revokes the old token's channels
            sock.settimeout(0.1)

            def closed() -> bool:
                try:
                    return sock.recv(1) == b""
                except TimeoutError:
                    return False
                except OSError:
                    return True

            wait_for(closed, 10, "the rotated token's link to be closed")


# -- failed TLS handshakes: refused with an audit line (rate-limited) and the failure delay, never a traceback ----
# (last in the module: the flood charges this host's uid the longest failure delay, and uses up the listener's
# audit lines for 10 s)

# What a client without TLS sends: a link hello in the clear.
PLAIN_HELLO = FRAME_HEADER.pack(40) + bytes(40)
# A TLS record header announcing a ClientHello of 512 bytes, and then nothing: a handshake that never ends.
STALLED_HANDSHAKE = b"\x16\x03\x01\x02\x00"


def _audited(broker: BrokerProcess, port: int) -> list[str]:
    """The broker's audit lines about the connection from this host's ``port``."""
    return [line for line in broker.log_tail(200_000).splitlines()
            if "gpubroker.audit" in line and f"'127.0.0.1', {port})" in line]


def _bad_handshake(broker: BrokerProcess, certs: dict[str, CertPaths], how: str, wait: bool = True) -> int:
    """One connection whose TLS handshake fails as ``how`` says; its local port (how the audit names its peer).
    ``wait``: for the server's answer (its alert, or its close after the failure delay)."""
    raw = socket.create_connection(("127.0.0.1", broker.link_port), timeout=10)
    port: int = raw.getsockname()[1]
    with raw, contextlib.suppress(ssl.SSLError, OSError):
        if how in ("plain bytes", "stalled"):
            raw.sendall(PLAIN_HELLO if how == "plain bytes" else STALLED_HANDSHAKE)
            if wait:
                raw.recv(64)  # (the server's alert, or its close: at the deadline for a stalled handshake)
            return port
        context = ssl.create_default_context(cafile=str(certs["ca"].cert))
        if how == "another CA's certificate":
            context.load_cert_chain(str(certs["foreign"].cert), str(certs["foreign"].key))
        with context.wrap_socket(raw, server_side=False, server_hostname="localhost") as sock:
            if wait:  # (TLS 1.3: the client's handshake ends first; the server's refusal comes as an alert)
                sock.recv(1)
    return port


@pytest.mark.parametrize(("how", "why"), [
    ("no certificate", "reason=TLS handshake failed: PEER_DID_NOT_RETURN_A_CERTIFICATE"),
    ("another CA's certificate", "reason=TLS handshake failed: CERTIFICATE_VERIFY_FAILED"),
    ("plain bytes", "reason=TLS handshake failed: "),
    ("stalled", "reason=no TLS handshake within hello_timeout_seconds"),
])
def test_a_failed_tls_handshake_is_audited(broker: BrokerProcess, certs: dict[str, CertPaths], how: str,
                                           why: str) -> None:
    port = _bad_handshake(broker, certs, how)
    wait_for(lambda: bool(_audited(broker, port)), 10, f"an audit line for the failed handshake ({how}) of port {port}")
    lines = _audited(broker, port)
    print("\n" + "\n".join(lines))
    assert len(lines) == 1 and why in lines[0] and "uid=0" in lines[0], lines
    assert "Traceback" not in broker.log_path.read_text(errors="replace")


def test_a_hello_cut_short_is_audited_as_on_fast(broker: BrokerProcess, certs: dict[str, CertPaths]) -> None:
    sock = _tls(broker, certs, "stranger")
    port: int = sock.getsockname()[1]
    with sock:
        sock.sendall((100).to_bytes(4, "big") + b"x" * 10)  # a header announcing 100 bytes, then 10, then the end
    wait_for(lambda: bool(_audited(broker, port)), 10, f"an audit line for the hello cut short of port {port}")
    lines = _audited(broker, port)
    print("\n" + "\n".join(lines))
    assert len(lines) == 1 and "malformed hello: cut short: the peer closed 14 bytes into its hello" in lines[0], lines


FLOOD = 200
# RateLimitedLog: 20 lines per listener per 10 s, then one line saying how many were left out (evictions of
# connections sitting out their failure delay are audited on the same listener, within the same 20).
LINES_PER_WINDOW, WINDOW = 21, 10.0


def test_a_flood_of_failed_tls_handshakes_writes_a_bounded_number_of_lines(broker: BrokerProcess,
                                                                           certs: dict[str, CertPaths]) -> None:
    before = len(broker.log_path.read_text(errors="replace"))
    kinds = ["plain bytes", "no certificate", "another CA's certificate"]
    started = time.monotonic()
    for i in range(FLOOD):
        _bad_handshake(broker, certs, kinds[i % len(kinds)], wait=False)  # (as fast as a flooder would)
    took = time.monotonic() - started
    # The windows the flood touched (the first may have begun before it), and the line saying what the last left out.
    allowed = LINES_PER_WINDOW * (int(took // WINDOW) + 2)

    def new_audit_lines() -> list[str]:
        return [line for line in broker.log_path.read_text(errors="replace")[before:].splitlines()
                if "gpubroker.audit" in line]

    # The first refusals are audited (the log shows the flood); the rest are counted, not written.
    wait_for(lambda: any("TLS handshake failed" in line for line in new_audit_lines()), 10,
             "the flood's first audit lines")
    lines = new_audit_lines()
    print(f"\n{FLOOD} failed handshakes in {took:.1f} s: {len(lines)} audit lines (at most {allowed})")
    assert len(lines) <= allowed < FLOOD, lines
    log = broker.log_path.read_text(errors="replace")
    assert "Traceback" not in log and "Exception" not in log[before:]
    # The broker still serves a good handshake at once.
    with _tls(broker, certs, "stranger") as sock:
        _, status, error = _hello(sock, "gpb_bogus_token", "ses_x")
        assert status == 1 and error["code"] == "UNAUTHENTICATED"


def _tls_relay_processes(broker: BrokerProcess) -> list[int]:
    """The broker's TLS relay processes: its children running broker/front/_tls_relays.py."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):  # (gone meanwhile)
            continue
        if parent == broker.process.pid and b"gpubroker.broker.front._tls_relays" in argv:
            pids.append(int(entry.name))
    return pids


def _link_works(sock: socket.socket, session: str, batch: int) -> None:
    _, status, reply = _hello(sock, "", session)
    assert status == 0 and reply["link"] == 1, reply
    send_payload(sock, encode(Batch(batch, 0, [Synchronize()])))
    assert decode_ack(recv_payload(sock)).done == 1


def test_tls_links_are_relayed_by_processes_of_the_front_and_outlive_their_ending(
        broker: BrokerProcess, certs: dict[str, CertPaths]) -> None:
    # One process per two cores, at most 4 (a TLS record's decryption a turn on the GIL: threads of one process
    # go at its one pace, processes each at theirs).
    relays = _tls_relay_processes(broker)
    assert 1 <= len(relays) <= 4, relays
    channel, session, _ = _open_session(broker, certs)
    with channel:
        with _tls(broker, certs, "alice") as sock:
            _link_works(sock, session, 1)
            for pid in relays:
                os.kill(pid, signal.SIGKILL)
            # The link was relayed by one of them: its connection ends with it, and no other process goes on
            # relaying it (the front keeps no copy of a relayed connection).
            sock.settimeout(10)
            with contextlib.suppress(OSError):
                send_payload(sock, encode(Batch(2, 1, [Synchronize()])))
            with pytest.raises((ConnectionError, ssl.SSLError, EOFError)):
                if not sock.recv(1):
                    raise EOFError
        wait_for(lambda: "TLS relay process" in broker.log_tail(200_000), 10, "the front to see its relays end")
        # The next link works (in a thread of the front until a process is started again: one is, at once).
        with _tls(broker, certs, "alice") as sock:
            _link_works(sock, session, 3)
        wait_for(lambda: bool(set(_tls_relay_processes(broker)) - set(relays)), 15, "a TLS relay process again")
        with _tls(broker, certs, "alice") as sock:
            _link_works(sock, session, 4)


_CONNECT_AND_CLOSE = """
import socket, sys, time
end = time.monotonic() + float(sys.argv[2])
while time.monotonic() < end:
    try:
        socket.create_connection(("127.0.0.1", int(sys.argv[1]))).close()
    except OSError:
        time.sleep(0.01)
"""


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _threads(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("Threads:")))


def test_a_flood_of_connections_evicted_as_they_come_stays_within_the_caps(backend: str,
                                                                           certs: dict[str, CertPaths]) -> None:
    """Two processes connect and close on the TLS port as fast as they can (the per-peer connection rate raised,
    as many peers at the default rate would add up): each newcomer evicts an older connection of its peer. The
    front keeps nothing of an evicted connection while the relay process catches up, and a relay process behind
    is given no more: the front's descriptors stay within what the pre-authentication caps allow (256
    connections, two descriptors each), the relay's threads within its bound, and both come back after. (Before:
    20,000 descriptors, the front's limit, within 4 s, and 6,800 threads in the relay process.)"""
    tls = TlsConfig(cert_file=str(certs["server"].cert), key_file=str(certs["server"].key),
                    client_ca_file=str(certs["ca"].cert), require_client_cert=True)
    settings = {"tls": tls, "link_listen": "127.0.0.1:0", "max_connections_per_peer_per_second": 100000.0,
                "connection_burst_per_peer": 100000}
    with BrokerProcess(TENANTS, backend=backend, settings=settings) as broker:
        front = broker.process.pid
        relays = _tls_relay_processes(broker)
        assert relays
        base_fds = _fds(front)
        flooders = [subprocess.Popen([sys.executable, "-c", _CONNECT_AND_CLOSE, str(broker.link_port), "4"])
                    for _ in range(2)]
        peak_fds = peak_threads = 0
        try:
            while any(f.poll() is None for f in flooders):
                peak_fds = max(peak_fds, _fds(front))
                peak_threads = max(peak_threads, max(_threads(pid) for pid in relays))
                time.sleep(0.1)  # (sampling the flood's cost, not waiting for it)
        finally:
            for flooder in flooders:
                flooder.kill()
                flooder.wait()
        assert peak_fds < base_fds + 3 * 256, (base_fds, peak_fds)
        assert peak_threads < 600, peak_threads
        wait_for(lambda: all(_threads(pid) == 1 for pid in relays), 30, "the relay's threads to end")
        wait_for(lambda: _fds(front) <= base_fds + 8, 30, "the front's descriptors to come back")
