"""What the front accepts from a worker: every reply checked against what the front asked, every error bounded.

A worker runs its tenant's native code, so its replies are the tenant's words: a result of the wrong shape, an
error naming a status a worker never has, a reply to a request never made, are lies. ``WorkerLied`` says which;
the front then kills the worker and charges its tenant (workers/_client.py).

Replies are decoded by the protocol's own types (gpubroker/wire/worker.py, gpubroker/wire/commands.py), each as the
one type the request it answers returns, never as arbitrary msgpack: a generic unpack builds a Python object of ~64
bytes for every one-byte element (an empty array), so a 5 MiB frame could cost the front hundreds of MiB and its
event loop seconds before any check ran. With a type, msgspec stops at the first element of the wrong type or an
unknown key, builds only what the type admits (containers with a bounded length), and the lie is found before the
frame is more than read. What a type cannot say (a read's size, a batch's ids and counts, a device's fields) is
checked here, against the request.
"""

from __future__ import annotations

import math
from typing import Any

import msgspec
from msgspec import Raw

from gpubroker.broker.front.workers._output import escape
from gpubroker.wire.commands import Ack, Batch, CommandError, decode_ack_for, tag_of
from gpubroker.wire.errors import GpuBrokerError, WireError, decode_wire_error, error_from_wire
from gpubroker.wire.types import DeviceInfo, device_info_from_report
from gpubroker.wire.worker import LeaseToFront, WorkerRequest, decode_device_report, decode_lease, decode_result

__all__ = ["MAX_ERROR_MESSAGE", "WorkerLied", "check_ack", "decode_control", "decode_error", "decode_reply",
           "device_info_from_dict", "error_from_worker", "first_words"]


class WorkerLied(Exception):
    """The worker said something it cannot honestly say; the message says what."""


# Longer messages are cut (a legitimate one quotes a name or a size, not megabytes).
MAX_ERROR_MESSAGE = 4096
# The statuses a worker's errors may carry; authentication and permission are the front's alone to say.
_WORKER_CODES = frozenset({"UNKNOWN", "INVALID_ARGUMENT", "OUT_OF_RANGE", "NOT_FOUND", "ALREADY_EXISTS",
                           "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION", "ABORTED", "UNAVAILABLE",
                           "DEADLINE_EXCEEDED", "CANCELLED", "UNIMPLEMENTED", "INTERNAL"})


def _lie(what: str, exc: Exception) -> WorkerLied:
    return WorkerLied(f"{what} ({str(exc)[:120]})")


def decode_reply(request: type[WorkerRequest[Any]], body: Raw | bytes) -> Any:
    """A successful reply's result to a ``request``, decoded as the type that request returns; WorkerLied if it
    is not one. (A batch's result, its encoded Ack, is then held to the batch by ``check_ack``.)"""
    try:
        return decode_result(request, body)
    except msgspec.DecodeError as exc:
        raise _lie(f"a result to {tag_of_request(request)!r} of the wrong shape", exc) from None


def tag_of_request(request: type[WorkerRequest[Any]]) -> str:
    return str(request.__struct_config__.tag)[:40]


def decode_control(body: Raw | bytes) -> LeaseToFront:
    """A lease message (Want or Released); WorkerLied for any other."""
    try:
        return decode_lease(body)
    except msgspec.DecodeError as exc:
        raise _lie("an unknown lease message", exc) from None


def decode_error(body: Raw | bytes) -> GpuBrokerError:
    """An error reply: a WireError (no other keys, details of a detail's shapes), bounded by error_from_worker."""
    try:
        error = decode_wire_error(body)
    except msgspec.DecodeError as exc:
        raise _lie("an error reply of the wrong shape", exc) from None
    return error_from_worker(error)


def first_words(status: int, body: Raw | bytes) -> DeviceInfo | GpuBrokerError:
    """A worker's first frame: its device (status 0) or why it could not start; WorkerLied if it is neither."""
    if status != 0:
        return decode_error(body)
    try:
        report = decode_device_report(body)
    except msgspec.DecodeError as exc:
        raise _lie("device info that is not a map of scalars", exc) from None
    return device_info_from_dict(report)


def _finite(value: Any) -> bool:
    return type(value) is not float or math.isfinite(value)


def error_from_worker(error: WireError) -> GpuBrokerError:
    """The worker's error as a gpubroker error of a status a worker may report, its message and details bounded."""
    code = error.code
    if code not in _WORKER_CODES:
        raise WorkerLied(f"an error with a status no worker reports ({code[:40]!r})")
    message = error.message
    if len(message) > MAX_ERROR_MESSAGE:
        message = message[:MAX_ERROR_MESSAGE] + " [cut]"
    # Escaped here, at the seam, so that every use downstream (the front logs some of these messages: a fence's,
    # a link hand-off's, set_limits') is safe: a newline in it must not start a forged line in the front's log.
    message = escape(message, quote=False)
    # The type has bounded the details' number, keys and shapes; a float that is no number is dropped.
    details = {key: value for key, value in error.details.items()
               if _finite(value) and (type(value) is not list or all(_finite(v) for v in value))}
    # Only gpubroker's own classes, and only one that carries this code (error_from_wire falls back otherwise).
    return error_from_wire(WireError(code, message, error.type[:64], details))


def device_info_from_dict(d: Any) -> DeviceInfo:
    """A device description, every field of the right type: from a worker, or the device probe."""
    try:
        return device_info_from_report(d)
    except ValueError as exc:
        raise WorkerLied(str(exc)) from None


def check_ack(batch: Batch, result: bytes) -> Ack:
    """A worker's answer to ``batch`` (its encoded Ack), decoded and held to it: the batch's id, no more commands
    done than it held, an error for one of its commands (and only when not all of them ran), and the last
    command's result of the type that command returns (decoded only as that type: nothing else is built) and held
    to it (``Command.check_result``: a read's bytes exactly the size asked for)."""
    try:
        ack = decode_ack_for(result, batch)
    except msgspec.DecodeError as exc:
        raise _lie("a batch answer that is not an ack of its batch", exc) from None
    ack_id, done, error = ack.id, ack.done, ack.error
    count = len(batch.commands)
    if ack_id != batch.id:
        raise WorkerLied(f"an ack for batch {ack_id}, not the batch {batch.id} it was sent")
    if not 0 <= done <= count:
        raise WorkerLied(f"an ack saying {done} of a batch's {count} commands ran")
    if error is not None:
        if not batch.first <= error.seq < batch.first + count or done == count:
            raise WorkerLied("a batch error for a command the batch did not hold")
        failure = error_from_worker(error.error)
        command = escape(error.command[:1024], quote=False)
        return Ack(ack_id, done, CommandError.of(error.seq, command, failure))
    if done != count:
        raise WorkerLied(f"an ack saying {done} of a batch's {count} commands ran, with no error")
    if not batch.commands:
        return Ack(ack_id, done)
    last = batch.commands[-1]
    if ack.result is None:
        if last.result is not None:
            raise WorkerLied(f"no result to a {tag_of(last)}, which returns one")
        return Ack(ack_id, done)
    if last.result is None:
        raise WorkerLied("a result where none is due")
    try:
        last.check_result(ack.result)
    except ValueError as exc:
        raise WorkerLied(str(exc)) from None
    return Ack(ack_id, done, None, ack.result)
