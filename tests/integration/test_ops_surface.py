"""The operator's surface of a real broker (issue 24, items 6 and 7): HTTP probes on the metrics listener, the
metric families operators alert on, and a stderr that is JSON from its first line to its last."""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from gpubroker.broker import samples
from gpubroker.broker.launcher import BrokerProcess, TenantSpec
from gpubroker.client import AdminClient, Unauthenticated, connect
from tests.helpers import wait_for

TENANTS = [TenantSpec("ops", admin=True), TenantSpec("alice")]


@pytest.fixture(scope="module")
def broker(backend: str) -> Iterator[BrokerProcess]:
    settings = {"metrics_listen": "127.0.0.1:0", "log_format": "json", "drain_grace_seconds": 300.0,
                "metrics_refresh_seconds": 0.05}
    with BrokerProcess(TENANTS, backend=backend, settings=settings) as proc:
        yield proc


def request(broker: BrokerProcess, method: str, path: str) -> tuple[int, bytes]:
    """One request to the metrics listener: the status and the body as sent (HEAD: none)."""
    host, port = broker.metrics.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.request(method, path)
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def scrape(broker: BrokerProcess) -> list[Sample]:
    status, body = request(broker, "GET", "/metrics")
    assert status == 200
    return [s for family in text_string_to_metric_families(body.decode()) for s in family.samples]


def value(found: list[Sample], name: str, **labels: str) -> float:
    matches = [s.value for s in found if s.name == name and labels.items() <= s.labels.items()]
    assert len(matches) == 1, f"{len(matches)} samples of {name} with {labels}"
    return matches[0]


def test_probes_answer_on_the_metrics_listener_and_readyz_follows_drain_and_undrain(broker: BrokerProcess) -> None:
    assert request(broker, "GET", "/livez") == (200, b"ok\n")
    assert request(broker, "GET", "/readyz") == (200, b"ready\n")
    assert request(broker, "HEAD", "/readyz") == (200, b"")
    assert request(broker, "HEAD", "/livez") == (200, b"")
    status, body = request(broker, "GET", "/")
    assert status == 404 and b"/metrics" in body  # (no page of metrics at any path but /metrics)
    assert request(broker, "HEAD", "/nothing") == (404, b"")
    assert request(broker, "POST", "/readyz")[0] == 405
    status, body = request(broker, "HEAD", "/metrics")
    assert (status, body) == (200, b"")

    with AdminClient(broker.target, broker.tokens["ops"]) as admin:
        admin.drain(300)
        try:
            status, body = request(broker, "GET", "/readyz")
            assert status == 503 and body.startswith(b"not ready: draining")
            assert request(broker, "HEAD", "/readyz") == (503, b"")
            assert request(broker, "GET", "/livez")[0] == 200  # draining is not dead
            assert value(scrape(broker), "gpubroker_draining") == 1
        finally:
            admin.undrain()
    assert request(broker, "GET", "/readyz") == (200, b"ready\n")
