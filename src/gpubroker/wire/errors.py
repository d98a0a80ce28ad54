"""One error hierarchy for every implementation of GpuCompute, local or remote, and its one wire form.

An error crosses a process boundary as a `WireError` (its status code's name, message, class name and details),
whatever carries it: a worker's reply to the front, a command's error in a batch's Ack, the gRPC error trailer,
a refused link hello. `GpuBrokerError.as_wire` makes one, bounded so that it always decodes (details are short
scalars); `error_from_wire` rebuilds the most specific class known for it.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, ClassVar, Final

import msgspec

__all__ = [
    "ERROR_BUDGET_HEADER",
    "ERROR_TRAILER",
    "Aborted",
    "AlreadyExists",
    "ArgumentTypeError",
    "Cancelled",
    "CompileError",
    "DeadlineExceeded",
    "FailedPrecondition",
    "GpuBrokerError",
    "Internal",
    "InvalidArgument",
    "NotFound",
    "OutOfRange",
    "PermissionDenied",
    "ResourceExhausted",
    "Unauthenticated",
    "Unavailable",
    "Unimplemented",
    "WireError",
    "WorkerCrashed",
    "decode_wire_error",
    "error_from_wire",
]

# The gRPC trailer in which the front sends a refused call's WireError (the status carries the code and message
# too, for clients in other languages).
ERROR_TRAILER: Final = "gpubroker-error-bin"
# The call metadata in which a client says how many bytes of error trailers it accepts (it raised gRPC's limit on
# received metadata to that): the front then sends an error's details whole within it (a long compile log), and
# bounds them to gRPC's default for a client that says nothing.
ERROR_BUDGET_HEADER: Final = "gpubroker-error-budget"

# What an error's details may hold on the wire: a few short scalars by name (a quota's numbers, a retry delay, a
# compile log). Anything else is sent as its str (as_wire), so an honest sender's error always decodes, and a
# receiver that trusts nothing (the front, reading a worker) decodes only these shapes.
MAX_DETAILS: Final = 32
MAX_DETAIL_KEY: Final = 64
MAX_DETAIL_TEXT: Final = 256 * 1024  # a compile log is the longest legitimate detail
_Scalar = None | bool | int | float
DetailValue = (Annotated[str, msgspec.Meta(max_length=MAX_DETAIL_TEXT)] | _Scalar
               | Annotated[list[_Scalar], msgspec.Meta(max_length=16)])
Details = Annotated[dict[Annotated[str, msgspec.Meta(max_length=MAX_DETAIL_KEY)], DetailValue],
                    msgspec.Meta(max_length=MAX_DETAILS)]


class WireError(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """An error as it crosses a process boundary: the one envelope of every error on every channel.

    A map (``{"code", "message", "type", "details"}``, the keys a client in another language reads in the gRPC
    trailer), with no other key: a receiver refuses one that has any (the front kills a worker that sends it).
    """

    code: str  # the gRPC status code's name
    message: str
    type: str = ""  # the GpuBrokerError class's name ("CompileError"), "" for the code's plain class
    details: Details = {}


_wire_error_decoder = msgspec.msgpack.Decoder(WireError)


def decode_wire_error(data: bytes | bytearray | memoryview) -> WireError:
    """A WireError from its encoding (msgspec.DecodeError if it is none)."""
    try:
        return _wire_error_decoder.decode(data)
    except UnicodeDecodeError as exc:  # msgspec lets a str that is not UTF-8 through as this, not a DecodeError
        raise msgspec.DecodeError(f"malformed string: {exc}") from None


def _wire_scalar(value: Any) -> Any:
    """``value`` as a detail's scalar, or its str when it has no such form (a non-finite float, a huge int)."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, int):
        return int(value) if -(1 << 63) <= value < 1 << 64 else str(value)
    if isinstance(value, float):
        return float(value) if math.isfinite(value) else str(value)
    return str(value)[:MAX_DETAIL_TEXT]


def _wire_detail(value: Any) -> Any:
    if isinstance(value, (list, tuple)) and len(value) <= 16:
        items = [_wire_scalar(v) for v in value]
        if not any(type(v) is str for v in items):
            return items
    return _wire_scalar(value)


class GpuBrokerError(Exception):
    """Root of every error gpubroker raises; ``code`` is the gRPC status name.

    Every implementation of GpuCompute, local or remote, raises these same classes, and errors keep their class
    across the wire: a `CompileError` in the tenant's worker is a `CompileError` in the client. Catch
    `GpuBrokerError` for all of them, or a subclass for one kind. The class itself stands for gRPC's `UNKNOWN`, a
    status no subclass names.

    Args:
        message: What went wrong, for a person.
        **details: Machine-readable facts about it (numbers, names), kept as ``details``.

    Attributes:
        code: The gRPC status code's name (`"INVALID_ARGUMENT"`, ...), the same on every subclass of one code.
        message: What went wrong, for a person (also ``str(exc)``).
        details: Facts about the error, by name: for example `quota`, `used` and `requested` on a quota refusal,
            `retry_after_seconds` where waiting helps, `seq` and `command` on a deferred command's error, `log` on
            a `CompileError`.
    """

    code: ClassVar[str] = "UNKNOWN"

    def __init__(self, message: str, **details: Any) -> None:
        super().__init__(message)
        self.message = message
        self.details = details

    def as_wire(self) -> WireError:
        """The error as it crosses a process boundary (a worker's reply, a batch's Ack, a gRPC trailer).

        Returns:
            Its code, message and class name, and its details bounded to what every receiver decodes: at most 32,
            each a short scalar or a short list of them (anything else as its text).
        """
        details = {str(key)[:MAX_DETAIL_KEY]: _wire_detail(value)
                   for key, value in list(self.details.items())[:MAX_DETAILS]}
        return WireError(self.code, self.message, type(self).__name__, details)


class InvalidArgument(GpuBrokerError):
    """`INVALID_ARGUMENT`: a request that is wrong on its face, whatever the state of the device.

    A size or offset that is negative or not an integer, a memset value that is not a byte, a launch whose grid or
    block is malformed or exceeds the device's limits or whose arguments do not match the kernel, a module format
    the device's backend does not load, a library call whose op, params, dtypes or shapes are wrong. The same
    request fails again: fix it.
    """

    code = "INVALID_ARGUMENT"


class ArgumentTypeError(InvalidArgument, TypeError):
    """A kernel argument of the wrong type (for example a bare Python int).

    Raised by `execute_kernel` for a bare Python `int`, `float` or `bool` (its width is ambiguous: pass
    `np.int32(...)`, `np.float32(...)`), an object that is neither a `Buffer` nor a NumPy scalar, or, checked
    against the kernel's parameters, a scalar of the wrong width or kind. Also a `TypeError`, so code that
    catches `TypeError` sees it. Fix the arguments.
    """


class CompileError(InvalidArgument):
    """Kernel source that did not compile; ``log`` holds the compiler's output.

    Raised by `compile_kernel` and `load_module` (NVRTC on CUDA, the OpenCL compiler on OpenCL). The message
    carries the first lines of the log. Fix the source; print `exc.log` to see every diagnostic.
    """

    @property
    def log(self) -> str:
        """The compiler's whole output (its errors and warnings); empty when the compiler wrote none."""
        return str(self.details.get("log", ""))


class OutOfRange(GpuBrokerError):
    """`OUT_OF_RANGE`: a copy or memset that runs past the end of its buffer.

    The offset plus the size reaches beyond the allocation (counted from the view's start); a host copy checks
    this before any byte moves. Fix the offset or the size (`buf.nbytes` is what a view holds).
    """

    code = "OUT_OF_RANGE"


class NotFound(GpuBrokerError):
    """`NOT_FOUND`: a handle, session, device or kernel name that does not exist for the caller.

    - A buffer, stream, event, module or kernel that this session never created, already freed, or that belongs
      to another session (the three read alike, so guessing teaches nothing): a bug in the caller, typically a
      use after free.
    - The session itself (the message names it): it was closed, its lease expired (the client stopped sending
      heartbeats), an operator ended it, or the broker restarted. Open a new session.
    - A device index the broker does not have, or a kernel name the module lacks (the message lists its
      kernels): fix the name.
    """

    code = "NOT_FOUND"


class AlreadyExists(GpuBrokerError):
    """`ALREADY_EXISTS`: something to be created is there already.

    Raised by the operator's tools, not by device calls: adding a tenant whose name is taken, or writing
    certificates over existing files without `--force`. Pick another name, or remove or replace the old one.
    """

    code = "ALREADY_EXISTS"


class ResourceExhausted(GpuBrokerError):
    """`RESOURCE_EXHAUSTED`: a limit of the tenant, the session or the device is reached.

    - An allocation past the tenant's memory quota on the device (the message and `details` give `quota`,
      `used` and `requested`), or past the memory the device has.
    - A session over the broker's limits: handles (`max_handles_per_session`), streams, calls in flight, host
      memory shared as same-host segments; a module larger than `max_module_bytes`.
    - A new session past the tenant's session limit, or (no device named) on a broker where the tenant's quota is
      used up on every device.
    - A call on a worker the front killed for device memory: on CUDA it held more than the tenant's quota plus
      the broker's `device_memory_headroom` (NVML's count: allocations the quota does not see, such as a
      module's global arrays or memory native code took), or it reported more in use than its quota (its
      accounting was overwritten). The session's device state is lost: open a new session and stay within the
      quota (`DeviceInfo.memory_available`), or ask the operator for more.

    Free what you hold (buffers, streams, sessions) and retry, or ask the operator for a larger quota. Calls in
    flight: retry once your other calls finish.
    """

    code = "RESOURCE_EXHAUSTED"


class PermissionDenied(GpuBrokerError):
    """`PERMISSION_DENIED`: the caller is known but may not do this.

    An Admin call ([AdminClient][gpubroker.client.AdminClient], the `gpubroker status`, `sessions`, `drain` ...
    commands) by a tenant without `admin = true`. Use an admin tenant's token.
    """

    code = "PERMISSION_DENIED"


class Unauthenticated(GpuBrokerError):
    """`UNAUTHENTICATED`: no valid credential.

    The token is missing or wrong, or no tenant is named by the client certificate; or, on a live session, the
    token was rotated or its tenant removed (the broker closes the connections it opened). Get the tenant's
    current token from the operator and connect again.
    """

    code = "UNAUTHENTICATED"


class FailedPrecondition(GpuBrokerError):
    """`FAILED_PRECONDITION`: the call is not possible in the current state of the object or the system.

    A `RemoteGpu` used after `close()` or before `initialize()`; `host_array` where shared memory is off; freeing
    a buffer a `copy_peer` is using; in-process, a backend whose runtime library (CuPy, pyopencl) is missing.
    Retrying as it is fails again: change the order of calls or the setup.
    """

    code = "FAILED_PRECONDITION"


class Aborted(GpuBrokerError):
    """`ABORTED`: the session's device work was cut short and cannot go on.

    On CUDA, a kernel that faulted (an illegal address, a trap) corrupts its device context: the error is raised
    at the next wait, the tenant's worker then exits, and the session's later calls raise
    [WorkerCrashed][gpubroker.client.WorkerCrashed] (its subclass). The session's device state is gone: fix the
    kernel and open a new session.
    """

    code = "ABORTED"


class WorkerCrashed(Aborted):
    """The tenant's worker process died; the session's device state is gone.

    The worker (one process per tenant and device, where the tenant's kernels run) was killed or exited: a
    kernel that crashed it, a fatal device error, the sandbox's limits, an operator. The message says why
    (`killed by signal SIGKILL`, ...). Every call of the session raises it from then on, and the tenant's other
    sessions on that device fail the same way. Close the session and open a new one (it gets a fresh worker),
    then upload the data again. A tenant whose workers keep crashing has its new sessions refused for a while
    (`Unavailable`, with `retry_after_seconds`).
    """


class Unavailable(GpuBrokerError):
    """`UNAVAILABLE`: the broker cannot serve this now; often transient.

    The broker cannot be reached, or the connection to it was lost (it stopped or restarted); it is draining
    and takes no new sessions; the device does not serve new sessions (its workers keep failing); the tenant
    crashed its workers too often lately; a `transport` insisted on is not offered; none of several brokers took
    the session (`details["endpoints"]` gives each one's reason). Retry after a while, or on another broker;
    `details["retry_after_seconds"]`, where present, says how long to wait. Queued work of a lost connection may
    not have run.
    """

    code = "UNAVAILABLE"


class DeadlineExceeded(GpuBrokerError):
    """`DEADLINE_EXCEEDED`: something took longer than allowed.

    - No answer within the session's `timeout` (`connect(..., timeout=...)`, 300 s by default): the call may or
      may not have run. The connection is dropped and later calls work; retry, or raise the timeout for long
      kernels.
    - The tenant's device work held the device longer than the broker's kernel time limit while other tenants
      waited, or a compile ran past the compile time limit: the tenant's worker was killed and the session's
      device state is gone. Open a new session, with shorter kernels or simpler source.
    """

    code = "DEADLINE_EXCEEDED"


class Cancelled(GpuBrokerError):
    """`CANCELLED`: gRPC's status for a call cancelled before it completed.

    gpubroker's own code does not raise it; it comes from gRPC, for a call whose channel was closed under it
    (`close()` from another thread). Whether the call ran is unknown; on a live session, repeat it if needed.
    """

    code = "CANCELLED"


class Unimplemented(GpuBrokerError):
    """`UNIMPLEMENTED`: gRPC's status for a call the broker does not know.

    gpubroker's own code does not raise it; gRPC does, when the client calls a method the broker lacks, as an
    older broker would. Upgrade the broker, or use the client version that matches it.
    """

    code = "UNIMPLEMENTED"


class Internal(GpuBrokerError):
    """`INTERNAL`: a bug in gpubroker, or a runtime error it did not translate.

    The worker reports it and keeps running, so the session may still work. It should not happen: report it
    with the message (and the broker's log).
    """

    code = "INTERNAL"


def _all_subclasses(cls: type[GpuBrokerError]) -> list[type[GpuBrokerError]]:
    found = [cls]
    for sub in cls.__subclasses__():
        found.extend(_all_subclasses(sub))
    return found


# Tracebacks, reprs and pickles name the module a user imports them from (`gpubroker.client.CompileError`), not
# this one: gpubroker.client exports every one of them, so pickle finds the same class there.
PUBLIC_MODULE: Final = "gpubroker.client"
for _cls in _all_subclasses(GpuBrokerError):
    _cls.__module__ = PUBLIC_MODULE

_BY_NAME = {cls.__name__: cls for cls in _all_subclasses(GpuBrokerError)}
# The first class declared for a code is its plain form: InvalidArgument, not CompileError.
_BY_CODE: dict[str, type[GpuBrokerError]] = {}
for _cls in _all_subclasses(GpuBrokerError):
    _BY_CODE.setdefault(_cls.code, _cls)


def error_from_wire(error: WireError) -> GpuBrokerError:
    """Rebuild the most specific error known for a WireError: its class when that class carries its code, else
    the code's plain class (never any other class: a name is only looked up among gpubroker's errors)."""
    code = error.code
    cls = _BY_NAME.get(error.type) or _BY_CODE.get(code, GpuBrokerError)
    if cls.code != code and code in _BY_CODE:
        cls = _BY_CODE[code]
    return cls(error.message, **error.details)
