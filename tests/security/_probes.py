"""What several security tests read from a running broker: a tenant's unary latency, the metrics endpoint, where a
worker's threads wait, and whether its shared memory still works."""

from __future__ import annotations

import http.client
import os
import statistics
import time
from pathlib import Path

import grpc
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from gpubroker.broker.launcher import BrokerProcess
from gpubroker.client import RemoteGpu, connect
from gpubroker.v1 import broker_pb2 as pb
from gpubroker.v1 import broker_pb2_grpc as pb_grpc

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def tenant_credentials(broker: BrokerProcess, tenant: str) -> grpc.ChannelCredentials:
    """A local client's credentials on the broker's Unix socket, with ``tenant``'s token."""
    return grpc.composite_channel_credentials(grpc.local_channel_credentials(grpc.LocalConnectionType.UDS),
                                              grpc.access_token_call_credentials(broker.tokens[tenant]))


def p50_ms(stub: pb_grpc.GpuBrokerStub, calls: int = 30) -> float:
    """The median of ``calls`` unary ListDevices round trips, in ms."""
    times = []
    for _ in range(calls):
        start = time.monotonic()
        stub.ListDevices(pb.ListDevicesRequest(), timeout=30)
        times.append(time.monotonic() - start)
    return statistics.median(times) * 1000


def scrape(broker: BrokerProcess) -> Samples:
    """Every sample of the broker's metrics endpoint, by (name, sorted labels)."""
    host, port = broker.metrics.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.request("GET", "/metrics")
        response = conn.getresponse()
        assert response.status == 200
        text = response.read().decode()
    finally:
        conn.close()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def metric(broker: BrokerProcess, name: str, **labels: str) -> float:
    """The one sample of ``name`` whose labels include ``labels``."""
    found = [value for (sample, sample_labels), value in scrape(broker).items()
             if sample == name and labels.items() <= dict(sample_labels).items()]
    assert len(found) == 1, f"{len(found)} samples of {name} with {labels}"
    return found[0]


def wchans(pid: int) -> dict[int, str]:
    """Where each thread of ``pid`` waits in the kernel (its wchan), by thread id; {} once it is gone."""
    found = {}
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            found[int(tid)] = Path(f"/proc/{pid}/task/{tid}/wchan").read_text()
    except OSError:
        pass
    return found


def kernel_sleeps(pid: int) -> bool:
    """Some thread of the worker ``pid`` sleeps in its kernel's nanosleep."""
    return "nanosleep" in "".join(wchans(pid).values())


def waits_on_its_kernel(pid: int) -> bool:
    """The worker's main thread waits in the device's finish while its kernel's thread sleeps."""
    waits = wchans(pid)
    return "futex" in waits.get(pid, "") and "nanosleep" in "".join(waits.values())


# A peer holding gRPC connections, run as ``python -c CONNECTION_HOLDER TARGET COUNT UID TOKEN`` (as root: it takes
# UID once its modules are loaded, as the interpreter's files may be root's only): COUNT connections, each a channel
# of its own, each making a call with TOKEN every half second (a channel whose connection was closed reconnects at
# its next call). The first round's status codes go to stdout: one per connection the gate admitted.
CONNECTION_HOLDER = r"""
import os, sys, time
import grpc
from gpubroker.v1 import broker_pb2 as pb, broker_pb2_grpc as pbg
target, count, uid, token = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
os.setgroups([])
os.setgid(uid)
os.setuid(uid)
stubs = [pbg.GpuBrokerStub(grpc.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)]))
         for _ in range(count)]
first = True
while True:
    calls = [s.ListDevices.future(pb.ListDevicesRequest(), metadata=[("authorization", "Bearer " + token)], timeout=10)
             for s in stubs]
    codes = []
    for call in calls:
        try:
            call.result()
            codes.append("OK")
        except grpc.RpcError as exc:
            codes.append(exc.code().name)
    if first:
        print(" ".join(codes), flush=True)
        first = False
    time.sleep(0.5)
"""


def assert_shared_memory_works(gpu: RemoteGpu, nbytes: int) -> None:
    """A buffer of ``nbytes`` and a host array of 16 MiB: the array's bytes go to the buffer and come back through the
    front's shared-memory segments."""
    buf = gpu.allocate_memory(nbytes)
    host = gpu.host_array((16 << 20) // 4, np.float32)
    host[:] = 3.0
    gpu.copy_h2d(host, buf)
    back = np.zeros_like(host)
    gpu.copy_d2h(buf, back)
    np.testing.assert_array_equal(back, host)


def failed_connects(broker: BrokerProcess, tenant: str, count: int) -> list[str]:
    """Connect ``count`` times as ``tenant`` (a session and a call each): why each that failed did."""
    failures = []
    for _ in range(count):
        try:
            with connect(broker.target, token=broker.tokens[tenant], timeout=10) as gpu:
                gpu.device_info()
        except Exception as exc:
            failures.append(f"{type(exc).__name__}: {exc}")
    return failures


def open_to_other_users(broker: BrokerProcess) -> None:
    """Let other local users reach the broker's sockets, as `socket_mode` / `socket_group` allow an operator to: its
    working directory searchable (the broker started with ``socket_mode = 0o666``)."""
    assert broker.workdir is not None
    os.chmod(broker.workdir, 0o755)
