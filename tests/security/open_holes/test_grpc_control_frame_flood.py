"""An unauthenticated local user floods HTTP/2 control frames on the gRPC socket: the front burns CPU, others wait.

The hole: the gRPC gate bounds what a peer may *open* (connections, their rate, calls and their rate, streams per
connection: rapid reset costs a reconnect) and closes a connection with no call after ``grpc_idle_seconds``, but
not what a connection may *send* outside calls. HTTP/2 control frames need no stream and no token: every SETTINGS
frame must be parsed and acknowledged, every WINDOW_UPDATE parsed (one for a stream that never existed is ignored,
not an error). Each byte is relayed by the front's gate into gRPC's private socket and parsed by gRPC in the front
process, charged to nobody. (PING floods are cut by gRPC's ping strikes; these are not.)

Measured (PoCL broker, 2 shared cores; uid 65533, 4 connections each sending the preface and then 36 KiB writes of
empty SETTINGS frames, or of WINDOW_UPDATE frames for stream 1, as fast as the socket takes them, reading and
discarding what comes back): alice's unary ListDevices p50 0.85 -> 22.9 ms (SETTINGS, 373 MB in 6 s) and 0.92 ->
12.4 ms (WINDOW_UPDATE, 2.9 GB in 6 s); the front's process used 137-144 % of a CPU meanwhile. Each such
connection may stay for ``grpc_idle_seconds`` (30 s), then reconnect. A re-run: 0.91 -> 11.3 ms (SETTINGS, 227 MiB),
0.79 -> 21.4 ms (WINDOW_UPDATE, 2.2 GiB). Control: the same flood against a sink process of its own (34 GB in 6 s)
left alice's p50 at 0.82 -> 1.31 ms: the cost is the front's. PRIORITY frames for an idle stream: 0.86 -> 16.7 ms
(2.4 GiB); CONTINUATION frames after an unfinished HEADERS kept the front at 121-190 % of a CPU (260 MB taken,
its memory flat).

Suggested fix: count a connection's bytes and frames outside calls (control frames, frames for closed or idle
streams) against a per-peer budget in the gate, which already parses the preface, and cut the connection past it
(GOAWAY ENHANCE_YOUR_CALM), as gRPC does for pings; or bound each peer's relayed bytes per second before a call has
authenticated (no tenant needs megabytes of control frames a second).
"""

from __future__ import annotations

import os
import subprocess
import textwrap
import time

import grpc
import pytest

from gpubroker.broker.launcher import BrokerProcess, TenantSpec
from gpubroker.v1 import broker_pb2_grpc as pb_grpc

from .._probes import p50_ms

ATTACKER_UID = 65533
SECONDS = 6.0
CONNECTIONS = 4
CALLS = 40
P50_FACTOR, P50_SLACK_MS = 3.0, 3.0  # (as test_connection_churn_latency's)

FLOOD = textwrap.dedent(r"""
    import socket, struct, sys, threading, time
    path, seconds, kind, conns = sys.argv[1], float(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    def frame(t, flags, sid, payload=b""):
        return struct.pack(">I", len(payload))[1:] + bytes([t, flags]) + struct.pack(">I", sid) + payload
    unit = {"settings": frame(4, 0, 0), "window_update": frame(8, 0, 1, struct.pack(">I", 1)),
            "priority": frame(2, 0, 3, struct.pack(">I", 1) + b"\x10")}[kind]
    blob, sent = unit * 4096, [0]
    def one():
        s = socket.socket(socket.AF_UNIX)
        s.connect(path)
        s.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + frame(4, 0, 0))
        def drain():
            try:
                while s.recv(1 << 20):
                    pass
            except OSError:
                pass
        threading.Thread(target=drain, daemon=True).start()
        end = time.monotonic() + seconds
        try:
            while time.monotonic() < end:
                s.sendall(blob)
                sent[0] += len(blob)
        except OSError:
            pass
    print("flooding", flush=True)
    threads = [threading.Thread(target=one) for _ in range(conns)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print(f"bytes {sent[0]}", flush=True)
""")


@pytest.mark.parametrize("kind", ["settings", "window_update", "priority"])
def test_control_frames_of_an_unauthenticated_peer_do_not_slow_other_tenants(kind: str) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to run the flood as another uid")
    with BrokerProcess([TenantSpec("alice")], backend="opencl", settings={"socket_mode": 0o666}) as broker:
        os.chmod(os.path.dirname(broker.target.removeprefix("unix:")), 0o755)  # (a local user in socket_group)
        credentials = grpc.composite_channel_credentials(
            grpc.local_channel_credentials(grpc.LocalConnectionType.UDS),
            grpc.access_token_call_credentials(broker.tokens["alice"]))
        with grpc.secure_channel(broker.target, credentials) as channel:
            stub = pb_grpc.GpuBrokerStub(channel)
            p50_ms(stub, CALLS)  # (warm)
            before = p50_ms(stub, CALLS)
            flood = subprocess.Popen(["/usr/bin/python3", "-I", "-c", FLOOD, broker.target.removeprefix("unix:"),
                                      str(SECONDS), kind, str(CONNECTIONS)], stdout=subprocess.PIPE, text=True,
                                     user=ATTACKER_UID, group=ATTACKER_UID, extra_groups=[])
            try:
                assert flood.stdout is not None and flood.stdout.readline().strip() == "flooding"
                time.sleep(1.0)
                during = p50_ms(stub, CALLS)
                out, _ = flood.communicate(timeout=SECONDS + 30)
            finally:
                if flood.poll() is None:
                    flood.kill()
                    flood.wait()
        sent = int(out.split()[-1])
        print(f"\n{kind}: {sent / 2**20:,.0f} MiB of control frames in {SECONDS:g} s; alice's p50 {before:.2f} -> "
              f"{during:.2f} ms")
        assert during <= P50_FACTOR * before + P50_SLACK_MS, (
            f"alice's ListDevices p50 went from {before:.2f} ms to {during:.2f} ms while uid {ATTACKER_UID} sent "
            f"{sent / 2**20:,.0f} MiB of HTTP/2 {kind} frames on {CONNECTIONS} unauthenticated connections")
