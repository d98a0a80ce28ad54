"""What several security tests read from a running broker: a tenant's unary latency, the metrics endpoint, and
where a worker's threads wait."""

from __future__ import annotations

import http.client
import os
import statistics
import time
from pathlib import Path

import grpc
from prometheus_client.parser import text_string_to_metric_families

from gpubroker.broker.launcher import BrokerProcess
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
