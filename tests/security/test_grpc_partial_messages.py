"""gRPC request messages that never complete cannot make the front buffer them.

gRPC receives a call's request message only while a read of it is pending, and grants the peer the whole message
(its header announces the size) once one is. The front used to authenticate in each handler, after gRPC had read
the whole request: a peer with no token kept calls open with messages announced at just under
``max_message_bytes`` and sent one byte short, all held in the front (6 connections of one uid took it from ~70 MiB
to 1.5 GiB in a few seconds; the caps allowed 64 connections per uid x 64 calls x 4 MiB). Now every call is
authenticated before its request is read (an unauthenticated one is answered, after its peer's failure delay,
with at most its HTTP/2 stream window of 64 KiB received: no BDP probing widens it), an authenticated one counts
against its tenant's ``max_inflight_per_tenant`` from then on, until its message comes or
``request_message_timeout_seconds`` have passed (then it ends, DEADLINE_EXCEEDED, and its place is given back), and
the health service, served without a token, reads its requests only within a per-peer count.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import closing
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gpubroker.broker.launcher import BrokerProcess, TenantSpec
from gpubroker.v1 import broker_pb2 as pb
from gpubroker.v1 import broker_pb2_grpc as pb_grpc

from ..helpers import wait_for
from .test_calls_staged_before_rotation import Staged

CONNECTIONS = 6
STREAMS = 60  # calls kept open per connection (max_grpc_streams_per_connection: 64)
MESSAGE = 4 * 1024 * 1024 - 64  # announced: under max_message_bytes (4 MiB)
FLOOD_SECONDS = 5.0
TENANT_CALLS = 8  # max_inflight_per_tenant: what alice's unfinished messages may hold, 8 x 4 MiB
HEALTH_PER_PEER = 4  # max_health_streams_per_peer: health requests on their way in from one peer
REQUEST_TIMEOUT = 3.0  # request_message_timeout_seconds: how long an authenticated call's message may take
# Unfixed, each flood grew the front by 1.4-1.5 GiB; fixed, by 8-40 MiB (the calls' own state and windows, and
# alice's 8 messages).
ALLOWED_GROWTH = 128 << 20

FLOODER = r'''# A hand-written HTTP/2 client: keeps `streams` gRPC calls of `method` open on one connection,
# each sending its request message (announced at `msglen` bytes) up to one byte short of complete, as fast as the
# server's flow-control windows allow; a call the server ends is replaced by a new one. Then it holds the connection.
import select, socket, struct, sys, time

def frame(ftype, flags, sid, payload=b""):
    return struct.pack(">I", len(payload))[1:] + bytes([ftype, flags]) + struct.pack(">I", sid) + payload

def lit(name, value):  # an HPACK literal field, not indexed, no Huffman coding
    n, v = name.encode(), value.encode()
    assert len(n) < 127 and len(v) < 127
    return b"\x00" + bytes([len(n)]) + n + bytes([len(v)]) + v

def flood(path, method, token, streams, msglen, seconds, hold):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(path)
    s.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + frame(4, 0, 0))
    fields = [(":method", "POST"), (":scheme", "http"), (":path", method), (":authority", "localhost"),
              ("content-type", "application/grpc"), ("te", "trailers")]
    headers = b"".join(lit(k, v) for k, v in fields + ([("authorization", "Bearer " + token)] if token else []))
    init_win = conn_win = 65535
    sent, win = {}, {}
    counts = {"opened": 0, "ended": 0, "bytes": 0}
    next_id = [1]

    def open_call():
        sid = next_id[0]
        next_id[0] += 2
        counts["opened"] += 1
        s.sendall(frame(1, 0x4, sid, headers))
        sent[sid], win[sid] = 0, init_win

    for _ in range(streams):
        open_call()
    buf, chunk = b"", bytes(16384)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        progressed = False
        for sid in list(sent):
            n = min(msglen + 5 - 1 - sent[sid], win[sid], conn_win, 16384)  # (one byte short of the whole)
            if n <= 0 or (sent[sid] == 0 and n < 5):  # (the first frame carries the 5-byte message header)
                continue
            payload = (b"\x00" + struct.pack(">I", msglen) + chunk[:n - 5]) if sent[sid] == 0 else chunk[:n]
            s.sendall(frame(0, 0, sid, payload))
            sent[sid] += n
            win[sid] -= n
            conn_win -= n
            counts["bytes"] += n
            progressed = True
        if not select.select([s], [], [], 0 if progressed else 0.05)[0]:
            continue
        data = s.recv(1 << 20)
        if not data:
            print("closed by the server", flush=True)
            break
        buf += data
        while len(buf) >= 9 and len(buf) >= 9 + int.from_bytes(buf[:3], "big"):
            size, ftype, flags = int.from_bytes(buf[:3], "big"), buf[3], buf[4]
            sid = int.from_bytes(buf[5:9], "big") & 0x7fffffff
            payload, buf = buf[9:9 + size], buf[9 + size:]
            if ftype == 4 and not flags & 1:  # SETTINGS
                for i in range(0, len(payload), 6):
                    key, value = struct.unpack(">HI", payload[i:i + 6])
                    if key == 4:  # INITIAL_WINDOW_SIZE
                        for x in win:
                            win[x] += value - init_win
                        init_win = value
                s.sendall(frame(4, 1, 0))
            elif ftype == 8:  # WINDOW_UPDATE
                increment = struct.unpack(">I", payload)[0] & 0x7fffffff
                if sid == 0:
                    conn_win += increment
                elif sid in win:
                    win[sid] += increment
            elif ftype == 6 and not flags & 1:  # PING
                s.sendall(frame(6, 1, 0, payload))
            elif (ftype == 1 and flags & 1) or ftype == 3:  # trailers or RST_STREAM: the server ended the call
                if sid in sent:
                    del sent[sid], win[sid]
                    counts["ended"] += 1
                    open_call()
            elif ftype == 7:  # GOAWAY
                print("goaway", payload[:8].hex(), flush=True)
                end = 0
    print(f"sent {counts['bytes']} bytes; opened {counts['opened']} calls, the server ended {counts['ended']}",
          flush=True)
    time.sleep(hold)
    s.close()

flood(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), float(sys.argv[6]),
      float(sys.argv[7]))
'''


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerProcess]:
    tmp = tmp_path_factory.mktemp("h2")
    settings: dict[str, object] = {"cache_dir": str(tmp / "caches"), "max_inflight_per_tenant": TENANT_CALLS,
                                   "max_health_streams_per_peer": HEALTH_PER_PEER,
                                   "request_message_timeout_seconds": REQUEST_TIMEOUT}
    with BrokerProcess([TenantSpec("alice")], backend="opencl", settings=settings) as proc:
        yield proc


def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def flood(broker: BrokerProcess, method: str, token: str = "") -> tuple[int, list[str]]:
    """Run CONNECTIONS flooders of ``method`` for FLOOD_SECONDS; the front's growth at its peak, their last lines."""
    assert broker.process is not None
    pid = broker.process.pid
    path = broker.target.removeprefix("unix:")
    before = rss(pid)
    floods = [subprocess.Popen([sys.executable, "-c", FLOODER, path, method, token, str(STREAMS), str(MESSAGE),
                                str(FLOOD_SECONDS), "2"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
              for _ in range(CONNECTIONS)]
    peak = before
    try:
        deadline = time.monotonic() + FLOOD_SECONDS + 1.5
        while time.monotonic() < deadline:  # (sampling the front's memory, not waiting for it)
            peak = max(peak, rss(pid))
            time.sleep(0.1)
        outs = [f.communicate(timeout=30)[0].strip().splitlines()[-1:] for f in floods]
    finally:
        for f in floods:
            if f.poll() is None:
                f.kill()
                f.wait()
    lines = [line for out in outs for line in out]
    print(f"\n{method}{' (token)' if token else ''}: front RSS {before >> 20} MiB before, {peak >> 20} MiB at the "
          f"peak; flooders: {lines}")
    return peak - before, lines


def _channel(broker: BrokerProcess) -> grpc.Channel:
    return grpc.secure_channel(broker.target, grpc.local_channel_credentials(grpc.LocalConnectionType.UDS),
                               options=[("grpc.use_local_subchannel_pool", 1)])


def test_unauthenticated_calls_cannot_make_the_front_buffer_their_messages(broker: BrokerProcess) -> None:
    grown, lines = flood(broker, "/gpubroker.v1.GpuBroker/Allocate")
    assert grown <= ALLOWED_GROWTH, (
        f"{CONNECTIONS} unauthenticated connections of one uid grew the front by {grown >> 20} MiB with request "
        "messages that never complete")
    # Each was answered (UNAUTHENTICATED, after the failure delay), none left open with its message buffered.
    assert all("the server ended" in line and not line.endswith("ended 0") for line in lines), lines


def test_a_tenants_unfinished_messages_count_against_its_calls_in_flight(broker: BrokerProcess) -> None:
    token = broker.tokens["alice"]
    grown, lines = flood(broker, "/gpubroker.v1.GpuBroker/Allocate", token)
    assert grown <= ALLOWED_GROWTH, (
        f"{CONNECTIONS} connections of a tenant grew the front by {grown >> 20} MiB with request messages that never "
        f"complete (max_inflight_per_tenant = {TENANT_CALLS})")
    # Those past its 8 calls in flight were refused at once; once its connections are gone, its calls are served.
    assert all(not line.endswith("ended 0") for line in lines), lines
    with closing(_channel(broker)) as channel:
        stub = pb_grpc.GpuBrokerStub(channel)
        metadata = [("authorization", f"Bearer {token}")]

        def served() -> bool:
            try:
                stub.ListDevices(pb.ListDevicesRequest(), metadata=metadata, timeout=10)
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, exc
                assert "calls in flight" in (exc.details() or ""), exc
                return False
            return True

        wait_for(served, 30, "alice's calls held by her closed connections to be given back")


def test_a_request_message_late_past_the_deadline_ends_its_call_and_gives_its_place_back(
        broker: BrokerProcess) -> None:
    token = broker.tokens["alice"]
    path = broker.target.removeprefix("unix:")
    request = pb.ListDevicesRequest().SerializeToString()
    with closing(_channel(broker)) as channel:
        stub = pb_grpc.GpuBrokerStub(channel)
        metadata = [("authorization", f"Bearer {token}")]

        def served() -> bool:
            try:
                stub.ListDevices(pb.ListDevicesRequest(), metadata=metadata, timeout=10)
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, exc
                return False
            return True

        wait_for(served, 30, "alice's calls of the tests before to be given back")
        # Every place of alice's held by a call whose message never completes (each on a connection of its own).
        staged = [Staged(path, "/gpubroker.v1.GpuBroker/ListDevices", token, request) for _ in range(TENANT_CALLS)]
        try:
            wait_for(lambda: not served(), 20, "the staged calls to authenticate")
            held = time.monotonic()
            ended = [call.ended(REQUEST_TIMEOUT + 15) for call in staged]
            waited = time.monotonic() - held
            given_back = served()  # (their connections still open)
        finally:
            for call in staged:
                call.close()
    print(f"\n{TENANT_CALLS} calls of alice's staged one byte short: ended by the broker: {sum(ended)}, "
          f"{waited:.1f} s after they held her places (request_message_timeout_seconds = {REQUEST_TIMEOUT:g})")
    assert all(ended) and not any(call.answered for call in staged), ended
    assert waited >= REQUEST_TIMEOUT * 0.5, f"the staged calls ended after {waited:.1f} s, before the deadline"
    assert given_back, "alice's places were still held after her staged calls ended"


def test_health_requests_on_their_way_in_are_bounded(broker: BrokerProcess) -> None:
    grown, lines = flood(broker, "/grpc.health.v1.Health/Check")
    assert grown <= ALLOWED_GROWTH, (
        f"{CONNECTIONS} unauthenticated connections grew the front by {grown >> 20} MiB with health Check requests "
        "that never complete")
    assert all(not line.endswith("ended 0") for line in lines), lines  # refused past the per-peer count
    with closing(_channel(broker)) as channel:  # and once they are gone, health checks are served
        stub = health_pb2_grpc.HealthStub(channel)

        def serving() -> bool:
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, exc
                return False
            return reply.status == health_pb2.HealthCheckResponse.SERVING

        wait_for(serving, 30, "health checks to be served after the flood")
