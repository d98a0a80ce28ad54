"""Limits before authentication on the raw listeners: a flood of idle and oversize connections is refused and
audited, the front's memory and descriptors stay bounded, tenants are served, and silence is timed out."""

from __future__ import annotations

import contextlib
import os
import resource
import socket
import struct
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from gpubroker.broker import samples
from gpubroker.broker.config import BrokerConfig
from gpubroker.broker.front._preauth import PreAuthGate
from gpubroker.broker.front.listeners import MAX_RATED_PEERS, Peer, PeerRate, peer_of
from gpubroker.broker.launcher import BrokerProcess, TenantSpec
from gpubroker.client import connect
from gpubroker.client._transports import peer_hung_up
from gpubroker.wire.addresses import TcpAddress
from gpubroker.wire.frames import pack_frame, recv_frame

from ..helpers import wait_for

HELLO_TIMEOUT = 1.0
IDLE = 3.0  # connection_idle_seconds
FLOOD = 10000  # on .fast


@pytest.fixture(scope="module")
def guarded(backend: str) -> Iterator[BrokerProcess]:
    # (the flood below comes from this process's uid, its tenants' too: the caps are tested here, not how fast a
    # peer may connect, which would refuse the tenants' connections after it: test_connection_churn_latency.py)
    settings = {"hello_timeout_seconds": HELLO_TIMEOUT, "connection_idle_seconds": IDLE, "lease_seconds": 30.0,
                "connection_burst_per_peer": 4 * FLOOD}
    with BrokerProcess([TenantSpec("alice"), TenantSpec("bob")], backend=backend, settings=settings) as proc:
        yield proc


def _fast(broker: BrokerProcess) -> str:
    """The link socket (links and segment connections)."""
    return broker.target.removeprefix("unix:") + ".fast"


def _front_usage(broker: BrokerProcess) -> tuple[int, int]:
    """The front's resident memory (bytes) and open descriptors, from /proc."""
    assert broker.process is not None
    pid = broker.process.pid
    status = Path(f"/proc/{pid}/status").read_text()
    rss = next(int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("VmRSS:"))
    return rss, len(os.listdir(f"/proc/{pid}/fd"))


def _launch_and_sync(broker: BrokerProcess, tenant: str) -> None:
    with connect(broker.target, token=broker.tokens[tenant]) as gpu:
        kernel = gpu.compile_kernel(samples.source(gpu.device_info().backend), "saxpy")
        n = 256
        x = np.arange(n, dtype=np.float32)
        dx, dy = gpu.allocate_memory(x.nbytes), gpu.allocate_memory(x.nbytes)
        gpu.copy_h2d(x, dx)
        gpu.memset(dy, 0)
        gpu.execute_kernel(kernel, 2, 128, [np.float32(2), dx, dy, np.int32(n)])
        gpu.synchronize()
        out = np.empty_like(x)
        gpu.copy_d2h(dy, out)
        np.testing.assert_array_equal(out, 2 * x)


def _connect(sock: socket.socket, path: str) -> None:
    """Connect, retrying while the listen backlog is full (a Unix socket answers EAGAIN rather than waiting)."""
    sock.setblocking(False)
    deadline = time.monotonic() + 10
    while True:
        try:
            sock.connect(path)
            return
        except BlockingIOError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.001)  # backpressure from the broker's accept loop, not synchronisation


def _audit_lines(broker: BrokerProcess, what: str) -> list[str]:
    return [line for line in broker.log_path.read_text(errors="replace").splitlines() if what in line]


def test_an_oversize_hello_is_refused_before_its_body_is_read(guarded: BrokerProcess) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(5)
        sock.connect(_fast(guarded))
        sock.sendall(struct.pack("!I", 1 << 20))  # only the header: the answer must not wait for the body
        _, status, error = recv_frame(sock)
        assert status == 1 and error["code"] == "INVALID_ARGUMENT" and "at most 65536 bytes" in error["message"]
        assert sock.recv(1) == b""


@pytest.mark.parametrize("which", [0, 1], ids=["fast", "grpc"])
def test_a_silent_connection_is_closed_after_the_hello_timeout(guarded: BrokerProcess, which: int) -> None:
    # (gRPC's own socket: its handshake timeout is set from hello_timeout_seconds too)
    path = [_fast(guarded), guarded.target.removeprefix("unix:")][which]
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(10)
        sock.connect(path)
        started = time.monotonic()
        while sock.recv(4096):  # closed by the broker (gRPC's server preface may come first, nothing else)
            pass
        took = time.monotonic() - started
    assert HELLO_TIMEOUT * 0.9 <= took < HELLO_TIMEOUT + 2.0, took
    if which == 0:
        assert any(path in line for line in _audit_lines(guarded, "reason=no hello within hello_timeout_seconds"))


def test_idle_authenticated_segment_connections_are_closed(guarded: BrokerProcess) -> None:
    # (A link is the worker's once its hello is accepted: the front's idle sweep is the segment connections'.)
    with connect(guarded.target, token=guarded.tokens["alice"]) as gpu, \
            socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(5)
        sock.connect(_fast(guarded))
        sock.sendall(pack_frame({"token": guarded.tokens["alice"], "session": gpu.session, "segments": 1}))
        assert recv_frame(sock) == [0, 0, {"segments": 1}]  # authenticated: past the hello's limits, now idle
        started = time.monotonic()
        wait_for(lambda: peer_hung_up(sock), IDLE + 3, "the idle segment connection to be closed")
        # Open well past the hello timeout (that bounds only the hello), closed once idle for IDLE seconds.
        assert time.monotonic() - started >= IDLE - 0.5 > HELLO_TIMEOUT


def tcp_peer(host: str) -> Peer:
    return Peer(-1, -1, TcpAddress(host, 40000), (host, 40000))


def test_a_peer_rate_is_a_token_bucket_per_peer_in_a_bounded_table() -> None:
    """How fast a peer may connect or start calls (listeners.PeerRate): ``burst`` at once, then ``rate`` a
    second; each peer its own; an idle peer forgotten, the table bounded whoever floods it."""
    rate = PeerRate(10.0, 3)
    assert [rate.take("uid 1", 100.0) for _ in range(4)] == [True, True, True, False]
    assert rate.take("uid 2", 100.0)  # another peer starts with a full bucket
    assert not rate.take("uid 1", 100.05) and rate.take("uid 1", 100.1)  # one token back each 0.1 s
    assert [rate.take("uid 1", 101.0) for _ in range(4)] == [True, True, True, False]  # full again after a second
    for i in range(3 * MAX_RATED_PEERS):  # a flood of peers, each taking once: the table stays bounded
        rate.take(f"10.{i // 256}.{i % 256}.0/24", 300.0)
        assert rate.peers <= MAX_RATED_PEERS + 1
    assert rate.take("uid 1", 300.0)


def test_caps_count_unauthenticated_connections_in_all_and_per_uid() -> None:
    gate = PreAuthGate(BrokerConfig(max_unauthenticated_connections=3, max_unauthenticated_per_uid=2))
    pairs = [socket.socketpair() for _ in range(4)]
    try:
        first, second = gate.admit(peer_of(pairs[0][0], ""), "x"), gate.admit(peer_of(pairs[1][0], ""), "x")
        assert first is not None and second is not None and first.uid == os.getuid() and first.pid == os.getpid()
        assert gate.admit(peer_of(pairs[2][0], ""), "x") is None  # this uid's two places are taken
        assert gate.refusals == 1
        first.done()
        first.done()  # once only
        assert gate.total == 1 and gate.per_uid == {f"uid {os.getuid()}": 1}
        third = gate.admit(peer_of(pairs[2][0], ""), "x")
        assert third is not None
        third.done()
        second.done()
        assert gate.total == 0 and gate.per_uid == {}
        gate = PreAuthGate(BrokerConfig(max_unauthenticated_connections=2, max_unauthenticated_per_uid=10))
        held = [gate.admit(peer_of(pairs[i][0], ""), "x") for i in range(2)]
        assert None not in held and gate.admit(peer_of(pairs[2][0], ""), "x") is None  # the total is reached first here
        # Remote TCP peers (the link's listener) have no uid: each network (a /24, a /64) is counted as a uid is,
        # since one host commonly holds a network's worth of addresses.
        gate = PreAuthGate(BrokerConfig(max_unauthenticated_connections=10, max_unauthenticated_per_uid=2))
        remote = [gate.admit(tcp_peer(host), "tls:x") for host in ("10.0.0.1", "10.0.0.2")]
        assert None not in remote and gate.admit(tcp_peer("10.0.0.3"), "tls:x") is None
        assert gate.admit(tcp_peer("10.0.1.1"), "tls:x") is not None
        assert gate.admit(tcp_peer("2001:db8::1"), "tls:x") is not None
        assert gate.admit(tcp_peer("2001:db8::ffff:1"), "tls:x") is not None
        assert gate.admit(tcp_peer("2001:db8:0:0:1::1"), "tls:x") is None
        assert gate.per_uid == {"10.0.0.0/24": 2, "10.0.1.0/24": 1, "2001:db8::/64": 2}
        # Each kind of listener has a total of its own: TCP peers holding theirs leave the Unix sockets' places.
        gate = PreAuthGate(BrokerConfig(max_unauthenticated_connections=2, max_unauthenticated_per_uid=10))
        remote = [gate.admit(tcp_peer(f"10.0.{i}.1"), "tls:x") for i in range(2)]
        assert None not in remote and gate.admit(tcp_peer("10.0.9.1"), "tls:x") is None
        assert gate.admit(peer_of(pairs[0][0], ""), "x") is not None
    finally:
        for a, b in pairs:
            a.close()
            b.close()


# Last: its refusals use up the audit log's burst for a while (rate-limited per listener).
def test_a_flood_of_idle_and_oversize_connections_is_bounded_refused_and_audited(guarded: BrokerProcess) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    if hard < FLOOD + 256:
        pytest.skip(f"needs {FLOOD + 256} descriptors, the hard limit is {hard}")
    _launch_and_sync(guarded, "alice")  # warm: the worker, the compile cache, the front's own buffers
    rss_before, fds_before = _front_usage(guarded)
    socks: list[socket.socket] = []
    oversize = struct.pack("!I", 200 << 20) + b"x" * 4096  # announces a 200 MiB hello
    try:
        for i in range(FLOOD):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            socks.append(sock)
            _connect(sock, _fast(guarded))
            if i % 2:
                with contextlib.suppress(OSError):  # refused at once: the broker may have closed it already
                    sock.send(oversize)
        rss_during, fds_during = _front_usage(guarded)
        # The raw listener keeps at most max_unauthenticated_connections (256) of them, all the rest are closed
        # at once: descriptors and memory grow by that much, not by 10,000 connections' worth.
        assert fds_during - fds_before <= 256 + 32, (fds_before, fds_during)
        assert rss_during - rss_before < 64 << 20, (rss_before, rss_during)
        _launch_and_sync(guarded, "bob")  # every tenant is served meanwhile
        _launch_and_sync(guarded, "alice")
        # The admitted ones are closed at the hello timeout: every flood connection ends, nothing lingers.
        wait_for(lambda: all(peer_hung_up(s) for s in socks), 10 + HELLO_TIMEOUT, "the flood's connections to end")
        wait_for(lambda: _front_usage(guarded)[1] <= fds_before + 8, 10, "the front's descriptors to go back")
    finally:
        for sock in socks:
            sock.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    refused = _audit_lines(guarded, "refused: peer=unix:")
    me = f"pid={os.getpid()} uid={os.getuid()}"
    assert any(me in line and ".fast" in line for line in refused), refused[-5:]
    assert any("hello of 209715200 bytes exceeds hello_max_bytes" in line for line in refused)
    # Rate-limited: 20,000 refusals are a few dozen lines plus counts of the rest, not 20,000 lines.
    assert len(refused) < 200, len(refused)
