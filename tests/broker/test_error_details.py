"""The standard rich form of a refused call's error (front/_error_details.py), as other gRPC clients read it."""

from __future__ import annotations

import base64

import grpc
from google.rpc import error_details_pb2, status_pb2

from gpubroker.broker.front._error_details import (
    DEFAULT_BUDGET,
    DETAILS_TRAILER,
    MAX_BUDGET,
    MAX_STATUS_BYTES,
    budget,
    error_trailers,
    rich_status,
)
from gpubroker.wire.errors import (
    ERROR_BUDGET_HEADER,
    ERROR_TRAILER,
    CompileError,
    ResourceExhausted,
    Unavailable,
    decode_wire_error,
)


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


def test_the_trailers_fit_a_client_that_says_nothing_and_carry_everything_to_ours() -> None:
    log = "".join(f"line {i}: warning: {'w' * 150}\n" for i in range(400)) + "error: the real one\n"
    exc = CompileError("OpenCL build failed:\n" + "x" * 20_000, log=log, line=3)
    message, trailers = error_trailers(exc, budget(None))
    size = sum(len(key) + len(base64.b64encode(value)) for key, value in trailers) + len(message.encode())
    assert size <= DEFAULT_BUDGET and DEFAULT_BUDGET < 8 * 1024  # gRPC's default limit on a response's metadata
    assert message.startswith("OpenCL build failed:") and "characters cut" in message
    ours = decode_wire_error(dict(trailers)[ERROR_TRAILER])
    assert ours.type == "CompileError" and ours.details["line"] == 3
    cut = ours.details["log"]
    assert isinstance(cut, str) and cut.startswith("line 0:") and cut.endswith("error: the real one\n")
    assert "characters cut" in cut
    status = status_pb2.Status.FromString(dict(trailers)[DETAILS_TRAILER])
    assert status.message == message  # (grpcio-status checks it against the call's)

    whole = decode_wire_error(dict(error_trailers(exc, budget([(ERROR_BUDGET_HEADER, str(512 * 1024))]))[1])[
        ERROR_TRAILER])
    assert whole.details["log"] == log  # our client raised its limit: the log whole


def test_a_budget_is_what_the_client_asked_within_bounds() -> None:
    assert budget(None) == budget([("other", "1")]) == DEFAULT_BUDGET
    assert budget([(ERROR_BUDGET_HEADER, "1")]) == DEFAULT_BUDGET
    assert budget([(ERROR_BUDGET_HEADER, "999999999")]) == MAX_BUDGET
    assert budget([(ERROR_BUDGET_HEADER, "nope")]) == DEFAULT_BUDGET


def test_many_long_texts_from_a_worker_are_cut_each_to_its_share() -> None:
    """A worker's error may hold 32 texts of 256 KiB (what the front decodes from it): each keeps its share of the
    room, cut in the middle, in one pass."""
    exc = CompileError("failed", **{f"t{i}": f"{i}" * (256 * 1024) for i in range(32)})
    for room in (DEFAULT_BUDGET, MAX_BUDGET):
        _, trailers = error_trailers(exc, room)
        ours = decode_wire_error(dict(trailers)[ERROR_TRAILER])
        assert sum(len(key) + len(base64.b64encode(value)) for key, value in trailers) <= room
        assert len(ours.details) == 32 and all("characters" in str(v) for v in ours.details.values())
        if room == MAX_BUDGET:
            assert all("characters cut" in str(v) and len(str(v)) > 1000 for v in ours.details.values())


def test_a_header_only_unicode_calls_a_digit_is_no_budget() -> None:
    assert budget([(ERROR_BUDGET_HEADER, "\u00b2")]) == budget([(ERROR_BUDGET_HEADER, "\u0663")]) == DEFAULT_BUDGET
