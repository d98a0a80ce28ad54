"""What the front accepts from a worker: every reply checked against what the front asked, every error bounded.

A worker runs its tenant's native code, so its replies are the tenant's words: a result of the wrong shape, an
error naming a status a worker never has, a reply to a request never made, are lies. ``WorkerLied`` says which;
the front then kills the worker and charges its tenant (workers/_client.py).

Replies are decoded against a typed schema per request (``decode_result``, ``decode_error``, ``check_ack``), never
as arbitrary msgpack: a generic unpack builds a Python object of ~64 bytes for every one-byte element (an empty
array), so a 5 MiB frame could cost the front hundreds of MiB and its event loop seconds before any check ran.
With a schema, msgspec stops at the first element of the wrong type or an unknown key, builds only what the schema
admits (containers with a bounded length), and the lie is found before the frame is more than read.
"""

from __future__ import annotations

import math
from typing import Annotated, Any

import msgspec
from msgspec import Meta, Raw

from gpubroker.broker.front.workers._output import escape
from gpubroker.wire.commands import Ack, Batch, CommandError, DeviceInfoQuery, LoadModule, Read
from gpubroker.wire.errors import GpuBrokerError, error_from_wire
from gpubroker.wire.types import DeviceInfo

__all__ = ["MAX_ERROR_MESSAGE", "WorkerLied", "check_ack", "check_result", "decode_control", "decode_error",
           "decode_result", "device_info_from_dict", "error_from_worker"]


class WorkerLied(Exception):
    """The worker said something it cannot honestly say; the message says what."""


# Longer messages are cut (a legitimate one quotes a name or a size, not megabytes).
MAX_ERROR_MESSAGE = 4096
_MAX_DETAIL_TEXT = 256 * 1024  # a compile log is the longest legitimate detail
_MAX_DETAILS = 32
_MAX_HANDLE = 256
_MAX_KERNELS = 65536
_MAX_SESSIONS = 65536  # in a usage report (a tenant's sessions on one device: far fewer in any configuration)
# The statuses a worker's errors may carry; authentication and permission are the front's alone to say.
_WORKER_CODES = frozenset({"UNKNOWN", "INVALID_ARGUMENT", "OUT_OF_RANGE", "NOT_FOUND", "ALREADY_EXISTS",
                           "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION", "ABORTED", "UNAVAILABLE",
                           "DEADLINE_EXCEEDED", "CANCELLED", "UNIMPLEMENTED", "INTERNAL"})


# -- the schemas replies are decoded with ------------------------------------------------------------------------
_Scalar = None | bool | int | float
_DetailValue = str | _Scalar | Annotated[list[_Scalar], Meta(max_length=16)]
_DETAIL_DECODER = msgspec.msgpack.Decoder(_DetailValue)
# An error's details, each value left encoded (Raw: one small object) and decoded only if it is a detail's shape.
_Details = Annotated[dict[str, Raw], Meta(max_length=2 * _MAX_DETAILS)]


class _WireError(msgspec.Struct, forbid_unknown_fields=True):
    """An error as a worker sends it (GpuBrokerError.to_wire()); any other key is a lie."""

    code: str
    message: str
    type: str | None = None
    details: _Details | None = None


class _WireCommandError(msgspec.Struct, array_like=True):
    """A batch's CommandError (gpubroker/wire/commands.py), its details bounded."""

    seq: int
    command: str
    code: str
    message: str
    type: str = ""
    details: _Details = {}


class _WireAck(msgspec.Struct, array_like=True):
    """A batch's Ack (gpubroker/wire/commands.py) with its result left encoded: decoded by what the last command
    returns."""

    id: int
    done: int
    error: _WireCommandError | None = None
    result: Raw = Raw(b"\xc0")  # (nil)


_DeviceDict = Annotated[dict[str, str | _Scalar | Annotated[list[int], Meta(max_length=3)]], Meta(max_length=64)]
_KernelNames = Annotated[list[Annotated[str, Meta(max_length=1024)]], Meta(max_length=_MAX_KERNELS)]


class _DeviceTime(msgspec.Struct, forbid_unknown_fields=True):
    seconds: float | int
    memory_used: int


class _Usage(msgspec.Struct, forbid_unknown_fields=True):
    memory_used: int
    sessions: Annotated[dict[str, int], Meta(max_length=_MAX_SESSIONS)]


class _PeerExport(msgspec.Struct, forbid_unknown_fields=True):
    handle: Annotated[bytes, Meta(max_length=4096)]
    size: int


class _Link(msgspec.Struct, forbid_unknown_fields=True):
    link: int


# What each of the front's requests returns (workers/_main.py, _peer.py); a request not listed may return only a
# scalar. Structs are turned back into the plain maps the checks below (and the callers) take.
_RESULT_TYPES: dict[str, Any] = {
    "batch": bytes, "ping": int, "take_device_time": _DeviceTime, "usage": _Usage, "close_session": int,
    "attach_link": _Link, "peer_export": _PeerExport, "peer_open": Annotated[str, Meta(max_length=_MAX_HANDLE)],
    "device_info": _DeviceDict,
}
_RESULT_DECODERS = {op: msgspec.msgpack.Decoder(kind) for op, kind in _RESULT_TYPES.items()}
_SCALAR_DECODER = msgspec.msgpack.Decoder(str | _Scalar)
_ERROR_DECODER = msgspec.msgpack.Decoder(_WireError)
_ACK_DECODER = msgspec.msgpack.Decoder(_WireAck)
# What a batch's last command returns, and what a result of another kind is.
_LAST_RESULT_DECODERS: dict[type, tuple[msgspec.msgpack.Decoder[Any], str]] = {
    Read: (msgspec.msgpack.Decoder(bytes), "a read that returned other than bytes"),
    DeviceInfoQuery: (msgspec.msgpack.Decoder(_DeviceDict), "device info that is not a map of scalars"),
    LoadModule: (msgspec.msgpack.Decoder(_KernelNames), "a module's kernel names are not a list of names"),
}
_NO_RESULT = (msgspec.msgpack.Decoder(None), "a result where none is due")


def _decode_as(decoder: msgspec.msgpack.Decoder[Any], raw: Any, what: str) -> Any:
    """``raw`` decoded with ``decoder``'s schema; WorkerLied if it does not fit."""
    try:
        return decoder.decode(raw)
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:
        raise WorkerLied(f"{what} ({str(exc)[:120]})") from None


def _decode(decoder: msgspec.msgpack.Decoder[Any], raw: Any, what: str) -> Any:
    """``raw`` decoded with ``decoder``'s schema, a struct as a plain map; WorkerLied if it does not fit."""
    value = _decode_as(decoder, raw, what)
    return msgspec.structs.asdict(value) if isinstance(value, msgspec.Struct) else value


def decode_result(op: str, raw: Raw | bytes) -> Any:
    """A successful reply's result to ``op``, decoded against what ``op`` returns (then held to it by
    check_result)."""
    return _decode(_RESULT_DECODERS.get(op, _SCALAR_DECODER), raw, f"a result to {op[:40]!r} of the wrong shape")


class _Released(msgspec.Struct, forbid_unknown_fields=True):
    memory_used: int


_CONTROL_DECODER = msgspec.msgpack.Decoder(_Released | None)


def decode_control(raw: Raw | bytes) -> Any:
    """A lease message's extra: None, or a release's ``{"memory_used": n}``."""
    return _decode(_CONTROL_DECODER, raw, "a lease message of the wrong shape")


def decode_error(raw: Raw | bytes) -> GpuBrokerError:
    """An error reply, decoded as a worker's error (no other keys) and bounded by error_from_worker."""
    return error_from_worker(_decode(_ERROR_DECODER, raw, "an error reply of the wrong shape"))


def _text(value: Any, what: str, limit: int = _MAX_HANDLE, empty: bool = False) -> str:
    if type(value) is not str or len(value) > limit or (not value and not empty):
        raise WorkerLied(f"{what} is not a string of at most {limit} characters")
    return value


def _count(value: Any, what: str, high: int = 1 << 63) -> int:
    if type(value) is not int or not 0 <= value <= high:
        raise WorkerLied(f"{what} is not an integer in [0, {high}]")
    return value


def _scalar_detail(value: Any) -> bool:
    return value is None or type(value) in (bool, int) or (type(value) is float and math.isfinite(value))


def _details(raw: Any) -> dict[str, Any]:
    """Error details bounded: string keys, scalar or short-list values; what does not fit is dropped."""
    if raw is None:
        return {}
    if type(raw) is not dict:
        raise WorkerLied("error details are not a map")
    details: dict[str, Any] = {}
    for key, value in list(raw.items())[:_MAX_DETAILS]:
        if type(key) is not str or len(key) > 64:
            continue
        if isinstance(value, Raw):  # from the wire: decoded only as a detail can be, else dropped
            try:
                value = _DETAIL_DECODER.decode(value)
            except (msgspec.DecodeError, UnicodeDecodeError):
                continue
        if type(value) is str:
            details[key] = value[:_MAX_DETAIL_TEXT]
        elif _scalar_detail(value) or (type(value) is list and len(value) <= 16
                                       and all(_scalar_detail(v) for v in value)):
            details[key] = value
    return details


def error_from_worker(payload: Any) -> GpuBrokerError:
    """The worker's error as a gpubroker error of a status a worker may report, its message and details bounded."""
    if type(payload) is not dict:
        raise WorkerLied("an error reply that is not a map")
    code = payload.get("code")
    if code not in _WORKER_CODES:
        raise WorkerLied(f"an error with a status no worker reports ({str(code)[:40]!r})")
    message = payload.get("message")
    if type(message) is not str:
        raise WorkerLied("an error without a message")
    if len(message) > MAX_ERROR_MESSAGE:
        message = message[:MAX_ERROR_MESSAGE] + " [cut]"
    # Escaped here, at the seam, so that every use downstream (the front logs some of these messages: a fence's,
    # a link hand-off's, set_limits') is safe: a newline in it must not start a forged line in the front's log.
    message = escape(message, quote=False)
    type_name = payload.get("type")
    # Only gpubroker's own classes, and only one that carries this code (error_from_wire falls back otherwise).
    return error_from_wire(code, message, type_name if type(type_name) is str else None,
                           _details(payload.get("details")))


def device_info_from_dict(d: Any) -> DeviceInfo:
    """A device description, every field of the right type: from a worker, or the device probe."""
    if type(d) is not dict:
        raise WorkerLied("device info that is not a map")
    ints = ("id", "total_memory", "free_memory", "multiprocessor_count", "clock_mhz", "l2_cache_bytes",
            "max_threads_per_block")
    texts = ("name", "vendor", "backend", "driver_version", "health_reason")
    fields: dict[str, Any] = {}
    for key in ints:
        fields[key] = _count(d.get(key), f"device info {key}")
    for key in texts:
        if key in d or key in ("name", "vendor", "backend"):
            fields[key] = _text(d.get(key), f"device info {key}", limit=1024, empty=True)
    if type(d.get("unified_memory")) is not bool:
        raise WorkerLied("device info unified_memory is not a boolean")
    fields["unified_memory"] = d["unified_memory"]
    for key in ("max_block_dims", "max_grid_dims"):
        dims = d.get(key)
        # type() refuses subclasses, as everywhere here; isinstance tells the type checker what passed
        if type(dims) not in (list, tuple) or not isinstance(dims, (list, tuple)) or len(dims) != 3:
            raise WorkerLied(f"device info {key} is not three integers")
        fields[key] = tuple(_count(v, f"device info {key}") for v in dims)
    cc = d.get("compute_capability")
    if cc is not None:
        if type(cc) not in (list, tuple) or len(cc) != 2:
            raise WorkerLied("device info compute_capability is not two integers")
        fields["compute_capability"] = tuple(_count(v, "device info compute_capability", 1000) for v in cc)
    version = d.get("opencl_version")
    if version is not None:
        fields["opencl_version"] = _text(version, "device info opencl_version", limit=1024, empty=True)
    for key in ("memory_quota", "memory_used", "memory_available"):
        if d.get(key) is not None:
            fields[key] = _count(d[key], f"device info {key}")
    if d.get("health") is not None:
        fields["health"] = _text(d["health"], "device info health", limit=64)
    return DeviceInfo(**fields)


def _text_result(result: Any, params: Any) -> Any:
    return _text(result, "a handle")


def _link(result: Any, params: Any) -> Any:
    if result != {"link": 1}:
        raise WorkerLied("a link hand-off answered other than {'link': 1}")
    return result


def _peer_export(result: Any, params: Any) -> Any:
    if type(result) is not dict or type(result.get("handle")) is not bytes or len(result["handle"]) > 4096:
        raise WorkerLied("a peer export that is not a handle")
    _count(result.get("size"), "a peer export's size")
    return result


def _count_result(result: Any, params: Any) -> Any:
    return _count(result, "a count")


def _device_info(result: Any, params: Any) -> Any:
    device_info_from_dict(result)
    return result


def _usage(result: Any, params: Any) -> Any:
    if type(result) is not dict or type(result.get("sessions")) is not dict:
        raise WorkerLied("a usage report that is not {memory_used, sessions}")
    _count(result.get("memory_used"), "a usage report's memory_used")
    for session, used in result["sessions"].items():
        _text(session, "a usage report's session")
        _count(used, "a session's memory use")
    return result


def check_ack(batch: Batch, result: Any) -> Ack:
    """A worker's answer to ``batch``, decoded and held to it: the batch's id, no more commands done than it
    held, an error for one of its commands (and only when not all of them ran), and the last command's result
    of the kind and size that command returns (decoded only as that kind: nothing else is built)."""
    if type(result) is not bytes:
        raise WorkerLied("a batch answer that is not an encoded ack")
    ack: _WireAck = _decode_as(_ACK_DECODER, result, "a batch answer that is not an ack")
    ack_id, done, error = ack.id, ack.done, ack.error
    count = len(batch.commands)
    if ack_id != batch.id:
        raise WorkerLied(f"an ack for batch {ack_id}, not the batch {batch.id} it was sent")
    if not 0 <= done <= count:
        raise WorkerLied(f"an ack saying {done} of a batch's {count} commands ran")
    if error is not None:
        if not batch.first <= error.seq < batch.first + count or done == count:
            raise WorkerLied("a batch error for a command the batch did not hold")
        failure = error_from_worker({"code": error.code, "message": error.message, "type": error.type,
                                     "details": error.details})
        command = escape(error.command[:1024], quote=False)
        return Ack(ack_id, done, CommandError(error.seq, command, failure.code, failure.message,
                                              type(failure).__name__, failure.details))
    if done != count:
        raise WorkerLied(f"an ack saying {done} of a batch's {count} commands ran, with no error")
    last = batch.commands[-1] if batch.commands else None
    decoder, lie = _LAST_RESULT_DECODERS.get(type(last), _NO_RESULT)
    return Ack(ack_id, done, None, _last_result(last, _decode(decoder, ack.result, lie)))


def _last_result(last: Any, result: Any) -> Any:
    """The result a batch's last command returns, checked: a read's bytes, a device, kernel names; else None."""
    if isinstance(last, Read):
        if type(result) is not bytes or len(result) != last.size:
            raise WorkerLied(f"a read that returned other than the {last.size} bytes asked for")
        return result
    if isinstance(last, DeviceInfoQuery):
        device_info_from_dict(result)
        return result
    if isinstance(last, LoadModule):
        if type(result) is not list or len(result) > _MAX_KERNELS:
            raise WorkerLied("a module's kernel names are not a list")
        for name in result:
            _text(name, "a kernel name", limit=1024)
        return result
    if result is not None:
        raise WorkerLied("a result where none is due")
    return None


# What each front request may get back; a request not listed gets a result the front does not use (bounded by
# the frame size only). ``batch`` answers are held to their batch by check_ack.
_RESULTS = {
    "peer_open": _text_result, "peer_export": _peer_export, "device_info": _device_info, "ping": _count_result,
    "attach_link": _link, "usage": _usage,
}


def check_result(op: str, params: Any, result: Any) -> Any:
    """``result`` if it is what ``op`` with ``params`` can return; WorkerLied otherwise."""
    if op == "batch":
        return check_ack(params, result)
    check = _RESULTS.get(op)
    return result if check is None else check(result, params)
