"""What a gRPC request says about its own encoding (``grpc-encoding``) must cost the front neither CPU nor log.

Two holes of one header (issue 21, a fresh attack on the gRPC listeners), each from unauthenticated local uids
sending health checks (no token needed) as raw HTTP/2, under the call rate:

- **Compressed requests.** gRPC inflates a request in the front before any handler sees it, and
  ``max_message_bytes`` bounds what it inflates to, not what came in: 4 KiB of gzip became a 4 MiB request. Two
  uids, 333 such checks a second each for 3 s: the front used 3.1-3.3 CPU-s (0.3 with the same checks
  uncompressed) and alice's ListDevices p50 went 0.9 -> 15-29 ms. Now the server takes no compression (the SDK
  compresses nothing): a compressed request is refused unread.
- **Log lines.** gRPC core writes its own errors straight to the broker's stderr, one per call: an unknown
  ``grpc-encoding`` ("Error parsing 'grpc-encoding' metadata"), a disabled one, and others. One uid sending calls
  with ``grpc-encoding: bogus`` on connections of 64 calls each put 50,159 lines, 5.3 MB, into the broker's log in
  3 s. Now the front's stderr, as gRPC core and any other native code write it, is read by the front and logged
  rate-limited (``gpubroker.native``), each line escaped on a line of its own.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator

import grpc
import pytest

from gpubroker.broker.launcher import BrokerProcess, TenantSpec
from gpubroker.v1 import broker_pb2_grpc as pb_grpc

from ._probes import open_to_other_users, p50_ms, tenant_credentials
from .test_grpc_control_frame_flood import _cpu_seconds

FIRST_UID = 20401
SECONDS = 3.0

# One peer (a uid of its own): health Check calls as raw HTTP/2, each a HEADERS frame (with ``grpc-encoding``) and a
# DATA frame ending the call, RATE a second on one connection, a new connection every PER_CONNECTION calls.
# Its request: a HealthCheckRequest whose service name is SIZE bytes, gzip-compressed (or, with "bogus", as is).
FLOOD = textwrap.dedent(r"""
    import gzip, os, socket, struct, sys, threading, time
    path, seconds, uid, encoding, size, rate, per_connection = (
        sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), sys.argv[4].encode(), int(sys.argv[5]), float(sys.argv[6]),
        int(sys.argv[7]))
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
    def frame(kind, flags, stream, payload=b""):
        return struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + struct.pack(">I", stream) + payload
    def length(n):
        out = []
        while n >= 128:
            out.append((n & 127) | 128)
            n >>= 7
        return bytes(out + [n])
    def header(name, value):  # (HPACK: a literal without indexing, a new name; both shorter than 127 bytes)
        return b"\0" + bytes([len(name)]) + name + bytes([len(value)]) + value
    body = b"\x0a" + length(size) + b"a" * size
    message = gzip.compress(body, 9) if encoding == b"gzip" else body
    data = bytes([encoding == b"gzip"]) + struct.pack(">I", len(message)) + message
    block = b"".join(header(n, v) for n, v in [(b":method", b"POST"), (b":scheme", b"http"),
                                               (b":path", b"/grpc.health.v1.Health/Check"), (b":authority", b"x"),
                                               (b"content-type", b"application/grpc"), (b"te", b"trailers"),
                                               (b"grpc-encoding", encoding)])
    print("flooding", flush=True)
    sent = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        s = socket.socket(socket.AF_UNIX)
        try:
            s.connect(path)
            s.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + frame(4, 0, 0))
            threading.Thread(target=lambda: [None for _ in iter(lambda: s.recv(1 << 20), b"")], daemon=True).start()
            for n in range(per_connection):
                if time.monotonic() >= end:
                    break
                s.sendall(frame(1, 4, 2 * n + 1, block) + frame(0, 1, 2 * n + 1, data))
                sent += 1
                time.sleep(1 / rate)
        except OSError:
            pass
        finally:
            s.close()
    print(sent, flush=True)
""")


@pytest.fixture(scope="module")
def broker() -> Iterator[BrokerProcess]:
    with BrokerProcess([TenantSpec("alice")], backend="opencl", settings={"socket_mode": 0o666}) as proc:
        open_to_other_users(proc)
        yield proc


def _flood(broker: BrokerProcess, peers: int, encoding: str, size: int, rate: float, per_connection: int
           ) -> list[subprocess.Popen[str]]:
    floods = [subprocess.Popen([sys.executable, "-c", FLOOD, broker.target.removeprefix("unix:"), str(SECONDS),
                                str(FIRST_UID + n), encoding, str(size), str(rate), str(per_connection)],
                               stdout=subprocess.PIPE, text=True) for n in range(peers)]
    for flood in floods:
        assert flood.stdout is not None and flood.stdout.readline().strip() == "flooding"
    return floods


def _sent(floods: list[subprocess.Popen[str]]) -> int:
    try:
        return sum(int(flood.communicate(timeout=SECONDS + 30)[0].split()[0]) for flood in floods)
    finally:
        for flood in floods:
            if flood.poll() is None:
                flood.kill()
                flood.wait()


def test_compressed_requests_cost_the_front_nothing_to_inflate(broker: BrokerProcess) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to attack as other uids")
    assert broker.process is not None
    with grpc.secure_channel(broker.target, tenant_credentials(broker, "alice")) as channel:
        stub = pb_grpc.GpuBrokerStub(channel)
        p50_ms(stub)  # (warm)
        before = p50_ms(stub)
        floods = _flood(broker, 2, "gzip", (4 << 20) - 64, 333.0, 100_000)
        cpu, started = _cpu_seconds(broker.process.pid), time.monotonic()
        during = p50_ms(stub, 60)
        sent = _sent(floods)
        cpu, elapsed = _cpu_seconds(broker.process.pid) - cpu, time.monotonic() - started
    print(f"\n{sent} health checks of 4 KiB of gzip (4 MiB inflated) from 2 uids: alice's p50 {before:.2f} -> "
          f"{during:.2f} ms; the front used {cpu:.2f} CPU-s in {elapsed:.1f} s")
    # Before: 3.1-3.3 CPU-s in 3 s (the same checks uncompressed: 0.3), alice's p50 15-29 ms.
    assert cpu <= 0.4 * elapsed, f"the front used {cpu:.2f} CPU-s in {elapsed:.1f} s inflating {sent} requests"
    assert during <= max(4 * before, before + 10.0), f"alice's p50 went from {before:.2f} to {during:.2f} ms"


def test_grpc_cores_own_errors_reach_the_log_rate_limited(broker: BrokerProcess) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to attack as another uid")
    size = broker.log_path.stat().st_size
    sent = _sent(_flood(broker, 1, "bogus", 16, 1e6, 64))
    time.sleep(0.5)  # (what gRPC wrote last reaches the log through the front's reader)
    logged = broker.log_path.stat().st_size - size
    print(f"\n{sent} calls with grpc-encoding: bogus from one uid: {logged:,} bytes of log")
    # Before: 50,159 lines, 5.3 MB in 3 s. A rate-limited kind writes ~20 lines per 10 s, and a line saying how many
    # it left out.
    assert sent >= 1000, f"the flood sent only {sent} calls"
    assert logged <= 64 * 1024, f"{sent} calls with a bogus grpc-encoding wrote {logged:,} bytes to the log"
