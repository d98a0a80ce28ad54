"""A reflection stream's requests are calls: an unauthenticated peer cannot stream them past its call rate.

The hole (issue 21, a fresh attack on the gRPC endpoints): the server reflection service (what grpcurl asks) is
served without a token, on one bidirectional stream per client; every request on it is answered by the front's
event loop (a list of the services, or a whole file descriptor serialised again), yet only the stream's start met
``max_grpc_calls_per_peer_per_second``: its requests, however many, met nothing but the HTTP/2 frame rate. Two
local uids, each two streams of ``file_containing_symbol`` requests as fast as Python's gRPC sends them, for 5 s:
37,800 answers, the front at 100 % of a CPU, alice's ListDevices p50 0.88 -> 7.8 ms (``list_services``: 63,700
answers, 0.88 -> 2.8 ms); a client that is not Python's would send more.

Now each request on a reflection stream takes one of its peer's call-rate tokens, as a call does; past them the
stream is refused (RESOURCE_EXHAUSTED) and its connection cut, as for any call. Here (a call rate of 200 a second,
a bucket of 400): 36,224 answers before, 1,400-1,700 after. What the flood still costs the front (about 0.6 CPU)
is its reconnects, 3,700 new connections in 5 s, each a gRPC handshake and a refused stream: the connection rate's
(``max_connections_per_peer_per_second``), as for every listener.
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

PEERS = 2
FIRST_UID = 20301
SECONDS = 5.0
RATE, BURST = 200.0, 400  # max_grpc_calls_per_peer_per_second, grpc_call_burst_per_peer

# One peer (a uid of its own, taken once grpc is loaded): two threads, each a channel streaming reflection requests
# as fast as it can for SECONDS, reconnecting when its stream ends. Prints the answers and the streams' end codes.
FLOOD = textwrap.dedent(r"""
    import os, sys, threading, time
    import grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
    target, seconds, uid = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
    request = reflection_pb2.ServerReflectionRequest(file_containing_symbol="gpubroker.v1.GpuBroker")
    answers, codes = [0], []
    def one(end):
        while time.monotonic() < end:
            channel = grpc.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)])
            def requests():
                while time.monotonic() < end:
                    yield request
            try:
                for _ in reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(requests(),
                                                                                           timeout=seconds + 10):
                    answers[0] += 1
            except grpc.RpcError as exc:
                codes.append(exc.code().name)
            channel.close()
    print("flooding", flush=True)
    end = time.monotonic() + seconds
    threads = [threading.Thread(target=one, args=(end,)) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print(answers[0], ",".join(sorted(set(codes))) or "-", flush=True)
""")


@pytest.fixture(scope="module")
def broker() -> Iterator[BrokerProcess]:
    settings = {"socket_mode": 0o666, "max_grpc_calls_per_peer_per_second": RATE, "grpc_call_burst_per_peer": BURST}
    with BrokerProcess([TenantSpec("alice")], backend="opencl", settings=settings) as proc:
        open_to_other_users(proc)
        yield proc


def test_reflection_requests_are_held_to_the_call_rate(broker: BrokerProcess) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to attack as other uids")
    assert broker.process is not None
    with grpc.secure_channel(broker.target, tenant_credentials(broker, "alice")) as channel:
        stub = pb_grpc.GpuBrokerStub(channel)
        p50_ms(stub)  # (warm)
        before = p50_ms(stub)
        floods = [subprocess.Popen([sys.executable, "-c", FLOOD, broker.target, str(SECONDS), str(FIRST_UID + n)],
                                   stdout=subprocess.PIPE, text=True) for n in range(PEERS)]
        try:
            for flood in floods:
                assert flood.stdout is not None and flood.stdout.readline().strip() == "flooding"
            cpu, started = _cpu_seconds(broker.process.pid), time.monotonic()
            during = p50_ms(stub, 60)
            outs = [flood.communicate(timeout=SECONDS + 30)[0].split() for flood in floods]
            cpu, elapsed = _cpu_seconds(broker.process.pid) - cpu, time.monotonic() - started
        finally:
            for flood in floods:
                if flood.poll() is None:
                    flood.kill()
                    flood.wait()
    answers = sum(int(out[0]) for out in outs)
    codes = {code for out in outs for code in out[1].split(",")}
    most = PEERS * (BURST + RATE * (SECONDS + 1))  # what the call rate lets the peers have, with a second's slack
    print(f"\n{answers} reflection answers to {PEERS} unauthenticated peers in {SECONDS:g} s (streams ended: "
          f"{codes}); alice's p50 {before:.2f} -> {during:.2f} ms; the front used {cpu:.2f} CPU-s in {elapsed:.1f} s")
    assert answers <= most, (f"{PEERS} unauthenticated peers got {answers} reflection answers in {SECONDS:g} s, "
                             f"more than their call rate allows ({most:g}): the requests of a stream met no rate")
    assert "RESOURCE_EXHAUSTED" in codes, codes
