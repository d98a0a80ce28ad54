"""What several security tests read from a running broker: a tenant's unary latency and the metrics endpoint."""

from __future__ import annotations

import http.client
import statistics
import time

from prometheus_client.parser import text_string_to_metric_families

from gpubroker.broker.launcher import BrokerProcess
from gpubroker.v1 import broker_pb2 as pb
from gpubroker.v1 import broker_pb2_grpc as pb_grpc

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


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
