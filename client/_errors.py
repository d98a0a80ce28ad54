"""One error hierarchy for every implementation of GpuCompute, local or remote."""

from __future__ import annotations

from typing import Any, ClassVar

__all__ = [
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
    "WorkerCrashed",
    "error_from_wire",
]


class GpuBrokerError(Exception):
    """Root of every error gpubroker raises; ``code`` is the gRPC status name."""

    code: ClassVar[str] = "UNKNOWN"

    def __init__(self, message: str, **details: Any) -> None:
        super().__init__(message)
        self.message = message
        self.details = details

    def to_wire(self) -> dict[str, Any]:
        """A msgpack-able form that survives IPC and gRPC trailers."""
        return {"type": type(self).__name__, "code": self.code, "message": self.message,
                "details": self.details}


class InvalidArgument(GpuBrokerError):
    code = "INVALID_ARGUMENT"


class ArgumentTypeError(InvalidArgument, TypeError):
    """A kernel argument of the wrong type (for example a bare Python int)."""


class CompileError(InvalidArgument):
    """Kernel source that did not compile; ``log`` holds the compiler's output."""

    @property
    def log(self) -> str:
        return str(self.details.get("log", ""))


class OutOfRange(GpuBrokerError):
    code = "OUT_OF_RANGE"


class NotFound(GpuBrokerError):
    code = "NOT_FOUND"


class AlreadyExists(GpuBrokerError):
    code = "ALREADY_EXISTS"


class ResourceExhausted(GpuBrokerError):
    code = "RESOURCE_EXHAUSTED"


class PermissionDenied(GpuBrokerError):
    code = "PERMISSION_DENIED"


class Unauthenticated(GpuBrokerError):
    code = "UNAUTHENTICATED"


class FailedPrecondition(GpuBrokerError):
    code = "FAILED_PRECONDITION"


class Aborted(GpuBrokerError):
    code = "ABORTED"


class WorkerCrashed(Aborted):
    """The tenant's worker process died; the session's device state is gone."""


class Unavailable(GpuBrokerError):
    code = "UNAVAILABLE"


class DeadlineExceeded(GpuBrokerError):
    code = "DEADLINE_EXCEEDED"


class Cancelled(GpuBrokerError):
    code = "CANCELLED"


class Unimplemented(GpuBrokerError):
    code = "UNIMPLEMENTED"


class Internal(GpuBrokerError):
    code = "INTERNAL"


def _all_subclasses(cls: type[GpuBrokerError]) -> list[type[GpuBrokerError]]:
    found = [cls]
    for sub in cls.__subclasses__():
        found.extend(_all_subclasses(sub))
    return found


_BY_NAME = {cls.__name__: cls for cls in _all_subclasses(GpuBrokerError)}
# The first class declared for a code is its plain form: InvalidArgument, not CompileError.
_BY_CODE: dict[str, type[GpuBrokerError]] = {}
for _cls in _all_subclasses(GpuBrokerError):
    _BY_CODE.setdefault(_cls.code, _cls)


def error_from_wire(code: str, message: str, type_name: str | None = None,
                    details: dict[str, Any] | None = None) -> GpuBrokerError:
    """Rebuild the most specific error known for a wire (code, type) pair."""
    cls = _BY_NAME.get(type_name or "") or _BY_CODE.get(code, GpuBrokerError)
    if cls.code != code and code in _BY_CODE:
        cls = _BY_CODE[code]
    return cls(message, **(details or {}))
