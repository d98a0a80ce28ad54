"""The operator's surface of a real broker (issue 24, items 6 and 7): HTTP probes on the metrics listener, the
metric families operators alert on, and a stderr that is JSON from its first line to its last."""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import struct
from collections.abc import Iterator
from typing import Any

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


def test_build_info_device_figures_and_the_counters_of_a_session(broker: BrokerProcess) -> None:
    before = scrape(broker)
    (info,) = [s for s in before if s.name == "gpubroker_build_info"]
    assert info.value == 1 and info.labels["version"] and info.labels["python"].count(".") == 2
    assert info.labels["backend"] in ("opencl", "cuda")
    assert value(before, "gpubroker_device_healthy", device="0") == 1
    assert value(before, "gpubroker_device_memory_total_bytes", device="0") > 0
    assert value(before, "gpubroker_device_memory_used_bytes", device="0") == 0
    failed = value(before, "gpubroker_auth_failures_total", credential="token")

    with pytest.raises(Unauthenticated):
        connect(broker.target, token="gpb_nobody_0123456789abcdef").device_info()
    n = 1 << 16
    with connect(broker.target, token=broker.tokens["alice"]) as gpu:
        buf = gpu.allocate_memory(n * 4)
        gpu.copy_h2d(np.ones(n, np.float32), buf)
        kernel = gpu.compile_kernel(samples.source(gpu.device_info().backend), "scale_inplace")
        for _ in range(3):
            gpu.execute_kernel(kernel, grid=n, block=256, args=[buf, np.float32(2.0), np.int32(n)])
        out = np.empty(n, np.float32)
        gpu.copy_d2h(buf, out)
        assert out[0] == 15.0  # (x = 2x + 1, three times)
        during = scrape(broker)
        assert value(during, "gpubroker_device_memory_used_bytes", device="0") == n * 4

    def counted() -> bool:
        found = scrape(broker)
        return value(found, "gpubroker_sessions_ended_total", tenant="alice", device="0", how="closed") == 1
    wait_for(counted, 30, "alice's session's close to be counted")
    after = scrape(broker)
    alice = {"tenant": "alice", "device": "0"}
    assert value(after, "gpubroker_auth_failures_total", credential="token") == failed + 1
    assert value(after, "gpubroker_sessions_opened_total", **alice) == 1
    assert value(after, "gpubroker_sessions_ended_total", how="expired", **alice) == 0
    assert value(after, "gpubroker_kernel_launches_total", **alice) == 3
    assert value(after, "gpubroker_copied_bytes_total", direction="h2d", **alice) == n * 4
    assert value(after, "gpubroker_copied_bytes_total", direction="d2h", **alice) == n * 4
    assert value(after, "gpubroker_copied_bytes_total", direction="d2d", **alice) == 0
    # The scheduler's waits: a histogram (cumulative buckets, +Inf = count), which rate() and sum() can add up.
    buckets = sorted((float(s.labels["le"]), s.value) for s in after
                      if s.name == "gpubroker_scheduler_wait_seconds_bucket" and alice.items() <= s.labels.items())
    assert [c for _, c in buckets] == sorted(c for _, c in buckets)
    assert buckets[-1] == (float("inf"), value(after, "gpubroker_scheduler_wait_seconds_count", **alice)) and \
        buckets[-1][1] > 0
    assert not [s for s in after if "quantile" in s.labels]


def _bogus_encoding_call(broker: BrokerProcess) -> None:
    """A health Check as raw HTTP/2 whose ``grpc-encoding`` gRPC core does not know: core writes an error line of
    its own to the front's descriptor 2 (what front/_native_log.py reads)."""
    def frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
        return struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + struct.pack(">I", stream) + payload

    def header(name: bytes, value: bytes) -> bytes:  # (HPACK: a literal without indexing, a new name)
        return b"\0" + bytes([len(name)]) + name + bytes([len(value)]) + value

    block = b"".join(header(n, v) for n, v in [
        (b":method", b"POST"), (b":scheme", b"http"), (b":path", b"/grpc.health.v1.Health/Check"),
        (b":authority", b"x"), (b"content-type", b"application/grpc"), (b"te", b"trailers"),
        (b"grpc-encoding", b"bogus")])
    with socket.socket(socket.AF_UNIX) as sock:
        sock.settimeout(10)
        sock.connect(broker.target.removeprefix("unix:"))
        sock.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + frame(4, 0, 0) + frame(1, 4, 1, block)
                     + frame(0, 1, 1, b"\0\0\0\0\0"))
        with contextlib.suppress(OSError):
            sock.recv(1 << 16)  # (its answer, or the close)


def test_every_line_of_stderr_is_json_with_audit_fields_and_named_sessions(broker: BrokerProcess) -> None:
    """(Last in the module: it reads what the tests above made the broker log.)"""
    with connect(broker.target, token=broker.tokens["alice"]) as gpu:
        session = gpu.session
    _bogus_encoding_call(broker)

    def records() -> list[dict[str, Any]]:
        text = broker.log_path.read_text(errors="replace")
        return [json.loads(line) for line in text.splitlines() if line.strip()]  # (each line JSON, or it raises)

    wait_for(lambda: any(r["logger"] == "gpubroker.native" for r in records())
             and any(r.get("session") == session and "closed" in r["message"] for r in records()), 30,
             "gRPC core's line and the session's close in the log")
    found = records()
    assert all({"time", "level", "logger", "message"} <= r.keys() for r in found)
    assert any(r["logger"] == "gpubroker.server" and r["message"].startswith("serving on") for r in found)
    assert not any("gpubroker: serving on" in r["message"] for r in found)
    # "session opened" names its session as a field (no call had bound it yet), with its tenant and device.
    opened = next(r for r in found if r["message"].startswith(f"session {session} opened"))
    assert (opened["session"], opened["tenant"], opened["device"]) == (session, "alice", 0)
    # Audit events: their key=value data as fields, the message free of them.
    audit = [r for r in found if r["logger"] == "gpubroker.audit"]
    drain = next(r for r in audit if r.get("action") == "drain")
    assert (drain["admin"], drain["grace"], drain["message"]) == ("ops", "300", "drain")
    assert drain["peer"].startswith("unix:")
    failure = next(r for r in audit if r["message"] == "auth failure")
    assert failure["token_id"] == "unknown" and failure["method"] and failure["peer"]
    assert all("=" not in r["message"] for r in audit), [r["message"] for r in audit if "=" in r["message"]]
    native = next(r for r in found if r["logger"] == "gpubroker.native")
    assert native["level"] in ("ERROR", "WARNING", "INFO")
