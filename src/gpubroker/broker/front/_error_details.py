"""A refused call's error in gRPC's standard rich form, for clients that are not ours (grpcurl, other languages).

Beside the Python client's own trailer (``gpubroker-error-bin``, a WireError), the front sends the same error as a
``google.rpc.Status`` in ``grpc-status-details-bin``, as ``grpcio-status`` (``rpc_status.from_call``) and every
gRPC library's rich-error helpers read it:

- ``ErrorInfo``: ``reason`` the error's class in UPPER_SNAKE_CASE (``COMPILE_ERROR``, ``RESOURCE_EXHAUSTED``),
  ``domain`` ``gpubroker``, and the error's details as strings in ``metadata`` (a quota's numbers, a device);
- ``RetryInfo`` where waiting helps (the error's ``retry_after_seconds``: a draining broker, a full pool);
- ``QuotaFailure`` on a refusal over a tenant's memory quota (the error's ``quota``, ``used`` and ``requested``).

gRPC caps a response's metadata (8 KiB by default in most clients) and the status repeats the message, so an error
whose rich form would not fit comfortably is sent without it: such a client still gets the code and the message.
"""

from __future__ import annotations

import re
from typing import Final

import grpc
from google.protobuf import duration_pb2
from google.rpc import error_details_pb2, status_pb2

from gpubroker.wire.errors import GpuBrokerError, WireError

__all__ = ["DETAILS_TRAILER", "ERROR_DOMAIN", "rich_status"]

DETAILS_TRAILER: Final = "grpc-status-details-bin"  # the key gRPC's libraries read a google.rpc.Status from
ERROR_DOMAIN: Final = "gpubroker"
# The most a Status may take (before base64, which the trailer adds: 4/3): it and the status message (which it
# repeats) stay well within the 8 KiB of metadata most gRPC clients accept.
MAX_STATUS_BYTES: Final = 3 * 1024
MAX_METADATA_VALUE: Final = 256  # a detail longer than this (a compile log) stays in the message and our trailer


def _reason(wire: WireError) -> str:
    """``CompileError`` -> ``COMPILE_ERROR``; a code's own class (or none) -> the code."""
    if not wire.type or wire.type == "GpuBrokerError":
        return wire.code
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", wire.type).upper()


def _metadata(wire: WireError) -> dict[str, str]:
    metadata = {}
    for key, value in wire.details.items():
        text = str(value).lower() if isinstance(value, bool) else str(value)
        if len(text) <= MAX_METADATA_VALUE:
            metadata[key] = text
    return metadata


def rich_status(exc: GpuBrokerError) -> bytes | None:
    """``exc`` as a serialized ``google.rpc.Status`` for ``grpc-status-details-bin``, or None when it would not
    fit (the message alone is too long)."""
    wire = exc.as_wire()
    status = status_pb2.Status(code=grpc.StatusCode[exc.code].value[0], message=exc.message)
    status.details.add().Pack(error_details_pb2.ErrorInfo(reason=_reason(wire), domain=ERROR_DOMAIN,
                                                         metadata=_metadata(wire)))
    retry = wire.details.get("retry_after_seconds")
    if isinstance(retry, (int, float)) and not isinstance(retry, bool) and 0 <= retry < 1e9:
        delay = duration_pb2.Duration()
        delay.FromNanoseconds(int(retry * 1e9))
        status.details.add().Pack(error_details_pb2.RetryInfo(retry_delay=delay))
    if exc.code == "RESOURCE_EXHAUSTED" and "quota" in wire.details:
        device = wire.details.get("device")
        subject = "device memory" + (f" on device {device}" if device is not None else "")
        status.details.add().Pack(error_details_pb2.QuotaFailure(violations=[
            error_details_pb2.QuotaFailure.Violation(subject=subject, description=exc.message)]))
    data = status.SerializeToString()
    return data if len(data) <= MAX_STATUS_BYTES else None
