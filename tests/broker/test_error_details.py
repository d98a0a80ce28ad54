"""The standard rich form of a refused call's error (front/_error_details.py), as other gRPC clients read it."""

from __future__ import annotations

import grpc
from google.rpc import error_details_pb2, status_pb2

from gpubroker.broker.front._error_details import MAX_STATUS_BYTES, rich_status
from gpubroker.wire.errors import CompileError, ResourceExhausted, Unavailable


def _details(data: bytes | None) -> tuple[status_pb2.Status, dict[str, object]]:
    assert data is not None
    status = status_pb2.Status.FromString(data)
    out: dict[str, object] = {}
    for any_detail in status.details:
        for kind in (error_details_pb2.ErrorInfo, error_details_pb2.RetryInfo, error_details_pb2.QuotaFailure):
            message = kind()
            if any_detail.Unpack(message):
                out[kind.DESCRIPTOR.name] = message
    return status, out


def test_a_retry_hint_becomes_retry_info_and_the_class_the_reason() -> None:
    status, details = _details(rich_status(Unavailable("the broker is draining; retry", retry_after_seconds=2.5)))
    assert status.code == grpc.StatusCode.UNAVAILABLE.value[0] and status.message == "the broker is draining; retry"
    retry = details["RetryInfo"]
    assert isinstance(retry, error_details_pb2.RetryInfo) and retry.retry_delay.ToNanoseconds() == 2_500_000_000
    info = details["ErrorInfo"]
    assert isinstance(info, error_details_pb2.ErrorInfo)
    assert info.reason == "UNAVAILABLE" and info.metadata["retry_after_seconds"] == "2.5"
    assert "QuotaFailure" not in details


def test_a_named_class_is_the_reason_and_a_long_detail_stays_out() -> None:
    _, details = _details(rich_status(CompileError("build failed", log="x" * 10_000, line=3)))
    info = details["ErrorInfo"]
    assert isinstance(info, error_details_pb2.ErrorInfo)
    assert info.reason == "COMPILE_ERROR" and dict(info.metadata) == {"line": "3"}


def test_a_quota_refusal_names_the_quota() -> None:
    _, details = _details(rich_status(ResourceExhausted("over the quota", quota=64, used=60, requested=8, device=1)))
    quota = details["QuotaFailure"]
    assert isinstance(quota, error_details_pb2.QuotaFailure)
    assert quota.violations[0].subject == "device memory on device 1"
    assert quota.violations[0].description == "over the quota"


def test_an_error_too_long_for_the_trailers_goes_without_its_rich_form() -> None:
    assert rich_status(Unavailable("m" * (MAX_STATUS_BYTES + 1))) is None
