"""A refused call's error as gRPC trailers: ours, whole for our client, and gRPC's standard rich form for clients
that are not ours (grpcurl, other languages), all within what a client accepts.

Beside the Python client's own trailer (``gpubroker-error-bin``, a WireError), the front sends the same error as a
``google.rpc.Status`` in ``grpc-status-details-bin``, as ``grpcio-status`` (``rpc_status.from_call``) and every
gRPC library's rich-error helpers read it:

- ``ErrorInfo``: ``reason`` the error's class in UPPER_SNAKE_CASE (``COMPILE_ERROR``, ``RESOURCE_EXHAUSTED``),
  ``domain`` ``gpubroker``, and the error's details as strings in ``metadata`` (a quota's numbers, a device);
- ``RetryInfo`` where waiting helps (the error's ``retry_after_seconds``: a draining broker, a full pool);
- ``QuotaFailure`` on a refusal over a tenant's memory quota (the error's ``quota``, ``used`` and ``requested``).

gRPC caps a response's metadata (8 KiB by default in most clients; past it the client refuses the whole response,
RESOURCE_EXHAUSTED, whatever the error was), so the message and both trailers are bounded together
(``error_trailers``): the message to about 2 KiB, the rich status to what is left of half the budget (else it is
left out: such a client still gets the code and the message), and our trailer to the rest, its longest texts (a
compile log) cut in the middle where they do not fit. Our client raises its own limit and says so in a call's
metadata (``ERROR_BUDGET_HEADER``): its errors come with their details whole, a compile log of up to 256 KiB.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Final

import grpc
import msgspec
from google.protobuf import duration_pb2
from google.rpc import error_details_pb2, status_pb2

from gpubroker.wire.encoding import encode
from gpubroker.wire.errors import ERROR_BUDGET_HEADER, ERROR_TRAILER, GpuBrokerError, WireError

__all__ = ["DETAILS_TRAILER", "ERROR_DOMAIN", "error_trailers", "rich_status"]

DETAILS_TRAILER: Final = "grpc-status-details-bin"  # the key gRPC's libraries read a google.rpc.Status from
ERROR_DOMAIN: Final = "gpubroker"
# The most a Status may take (before base64, which the trailer adds: 4/3): it and the status message (which it
# repeats) stay well within the 8 KiB of metadata most gRPC clients accept.
MAX_STATUS_BYTES: Final = 3 * 1024
MAX_METADATA_VALUE: Final = 256  # a detail longer than this (a compile log) stays in the message and our trailer
# What a response's trailers may take for a client that says nothing (gRPC's default soft limit is 8 KiB, headers'
# names and grpc-status included), and the most a client may ask for (ERROR_BUDGET_HEADER).
DEFAULT_BUDGET: Final = 6 * 1024
MAX_BUDGET: Final = 512 * 1024
MAX_MESSAGE_BYTES: Final = 2 * 1024  # the status message, as gRPC sends it (percent-encoded)


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


def rich_status(exc: GpuBrokerError, message: str | None = None, wire: WireError | None = None) -> bytes | None:
    """``exc`` as a serialized ``google.rpc.Status`` for ``grpc-status-details-bin`` (with ``message`` as the
    status's, if the call's is cut; ``wire``: ``exc.as_wire()`` if made already), or None when it would not fit
    (the message alone is too long)."""
    wire = exc.as_wire() if wire is None else wire
    message = exc.message if message is None else message
    status = status_pb2.Status(code=grpc.StatusCode[exc.code].value[0], message=message)
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
            error_details_pb2.QuotaFailure.Violation(subject=subject, description=message)]))
    data = status.SerializeToString()
    return data if len(data) <= MAX_STATUS_BYTES else None


def budget(metadata: Iterable[tuple[str, str | bytes]] | None) -> int:
    """The trailers' budget for a call: what its client asked for (ERROR_BUDGET_HEADER, within MAX_BUDGET), else
    DEFAULT_BUDGET."""
    for key, value in metadata or ():
        # (isascii: str.isdigit takes "²", which int() refuses; any peer may send the header)
        if key == ERROR_BUDGET_HEADER and isinstance(value, str) and value.isascii() and value.isdigit() \
                and len(value) < 10:
            return max(DEFAULT_BUDGET, min(int(value), MAX_BUDGET))
    return DEFAULT_BUDGET


def _on_the_wire(text: str) -> int:
    """Bytes gRPC sends ``text`` as in grpc-message: percent-encoded outside printable ASCII."""
    return sum(1 if 0x20 <= b < 0x7F and b != 0x25 else 3 for b in text.encode())


def _base64(size: int) -> int:
    return (size + 2) // 3 * 4


def _cut(text: str, keep: int) -> str:
    """``text`` with its middle cut to about ``keep`` characters, saying so (the head and the tail of a compile
    log are where its first error and its summary are)."""
    head = keep * 2 // 3
    return (f"{text[:head]}\n... [{len(text) - keep} characters cut: gRPC's trailers hold no more]\n"
            f"{text[len(text) - (keep - head):]}")


def error_trailers(exc: GpuBrokerError, room: int) -> tuple[str, tuple[tuple[str, bytes], ...]]:
    """The status message and the trailers for ``exc`` within ``room`` bytes (``budget``): the message cut to an
    eighth of it on the wire (MAX_MESSAGE_BYTES at the least), the rich status if it fits in half of what is left,
    our trailer (the WireError, its message left empty: the status has it) with its long texts cut to fit the
    rest. A worker's error may hold 32 texts of 256 KiB: they are cut in one pass, each to its share, so a refused
    call costs the front one encoding of what is sent, not one per text."""
    message = exc.message
    message_room = max(MAX_MESSAGE_BYTES, room // 8)
    if _on_the_wire(message) > message_room:
        keep = min(len(message), message_room)
        while keep > 64 and _on_the_wire(cut := _cut(message, keep)) > message_room:
            keep = keep * 3 // 4
        message = cut if keep > 64 else message[:64]
    left = room - _on_the_wire(message)
    trailers: list[tuple[str, bytes]] = []
    wire = exc.as_wire()
    rich = rich_status(exc, message, wire)
    if rich is not None and _base64(len(rich)) + len(DETAILS_TRAILER) <= left // 2:
        trailers.append((DETAILS_TRAILER, rich))
        left -= _base64(len(rich)) + len(DETAILS_TRAILER)
    wire = msgspec.structs.replace(wire, message="")
    raw_room = (left - len(ERROR_TRAILER)) * 3 // 4  # what our trailer may take before base64
    long = {k: v for k, v in wire.details.items() if isinstance(v, str) and len(v) > MAX_METADATA_VALUE}
    sizes = {k: len(v.encode()) for k, v in long.items()}  # (in UTF-8 bytes: a character may take four)
    if sum(sizes.values()) > raw_room:
        # Each long text its share of the room, less the rest of the error, with room for the cut's note.
        rest = len(encode(msgspec.structs.replace(wire, details={k: v for k, v in wire.details.items()
                                                                 if k not in long})))
        share = (raw_room - rest) // len(long) - 96
        details = dict(wire.details)
        for key, text in long.items():
            size = sizes[key]
            if share < 128:  # (too many to keep any of each: their sizes only)
                details[key] = f"[{len(text)} characters: more than gRPC's trailers hold]"
            elif size > share:
                details[key] = _cut(text, max(64, len(text) * share // size))
        wire = msgspec.structs.replace(wire, details=details)
    ours = encode(wire)
    if _base64(len(ours)) + len(ERROR_TRAILER) > left:  # (many short details and no room: the class and code go)
        ours = encode(msgspec.structs.replace(wire, details={}))
    trailers.insert(0, (ERROR_TRAILER, ours))
    return message, tuple(trailers)
