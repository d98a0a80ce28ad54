"""The transport boundary: GpuBrokerError <-> gRPC status, with structured details in a trailer."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeAlias, TypeVar

import grpc
import msgpack

from gpubroker.client import GpuBrokerError, Internal, InvalidArgument, Unavailable

from ..auth import Authenticator, Principal, RateLimitedLog, failure_delay, wait_failure_delay
from ..logs import bind_log_context, log_context
from ..sessions import Session, out_of_descriptors
from ._grpc_peers import grpc_peer
from ._metrics import observe_rpc

__all__ = ["ERROR_TRAILER", "Context", "add_servicer", "cancel_and_wait", "descriptors_exhausted", "log_failure",
           "principal_of", "release_slot", "rpc", "stream_rpc"]

log = logging.getLogger("gpubroker.server")
# One line per burst of calls refused for want of descriptors (a flood of them must not flood the log too).
_exhausted_log = RateLimitedLog(log)
# How long a client refused for want of the front's descriptors is told to wait.
EXHAUSTED_RETRY_SECONDS = 1.0
# The RPC being served, for audit lines; set by the wrappers below.
current_method: contextvars.ContextVar[str] = contextvars.ContextVar("current_method", default="")
# The session whose concurrent-RPC slot this call holds; released when the call ends.
admitted: contextvars.ContextVar[Session | None] = contextvars.ContextVar("admitted", default=None)


async def cancel_and_wait(task: asyncio.Task[None] | None) -> None:
    """End one of the front's background loops (a sweep, a watch, a census) and wait until it has."""
    if task is not None:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def release_slot(session: Session) -> None:
    """Give back the concurrent-call slot that the service's ``admit`` took."""
    session.inflight -= 1
    session.tenant_inflight[session.tenant] -= 1


def _release_slot() -> None:
    session = admitted.get()
    if session is not None:
        release_slot(session)
        admitted.set(None)
ERROR_TRAILER = "gpubroker-error-bin"

Req = TypeVar("Req")
Resp = TypeVar("Resp")
# The servicers use their context only for metadata, the peer and abort, none of which depend on the message types
# (those matter only to a context's read and write, for streams the servicers read as iterators instead). A string,
# because grpc.aio.ServicerContext is generic only in its stubs, not at run time.
Context: TypeAlias = "grpc.aio.ServicerContext[Any, Any]"


async def abort_with(context: Context, exc: GpuBrokerError) -> None:
    details = msgpack.packb({"type": type(exc).__name__, "details": exc.details}, use_bin_type=True)
    await context.abort(grpc.StatusCode[exc.code], exc.message, trailing_metadata=((ERROR_TRAILER, details),))


def principal_of(auth: Authenticator, context: Context) -> Principal:
    """Authenticate the call from its metadata and, on TLS, its verified client certificate."""
    try:
        auth_context = context.auth_context() or {}
    except Exception:  # local credentials carry no auth context on some grpc builds
        auth_context = {}
    principal = auth.authenticate(context.invocation_metadata(), auth_context, grpc_peer(context), current_method.get())
    bind_log_context(tenant=principal.tenant)
    return principal


class Malformed:
    """A request whose bytes did not parse; the handler's wrapper answers it with INVALID_ARGUMENT."""

    __slots__ = ("error",)

    def __init__(self, error: str) -> None:
        self.error = error


def _tolerant(deserialize: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    """gRPC ends a call whose request fails to parse with UNKNOWN (INTERNAL for a stream): a client's bad bytes
    are its own error, so they reach the handler as Malformed instead."""

    def parse(data: bytes) -> Any:
        try:
            return deserialize(data)
        except Exception as exc:  # DecodeError, and whatever else hostile bytes provoke in a parser
            return Malformed(f"{type(exc).__name__}: {exc}")

    return parse


def add_servicer(add: Callable[[Any, Any], None], servicer: Any, server: grpc.aio.Server) -> None:
    """Register a servicer as its generated ``add_*_to_server`` would, with requests parsed by ``_tolerant``."""
    captured: dict[str, dict[str, Any]] = {}

    class _Capture:
        def add_generic_rpc_handlers(self, handlers: Any) -> None:
            pass  # the same handlers come to add_registered_method_handlers

        def add_registered_method_handlers(self, service: str, handlers: dict[str, Any]) -> None:
            captured[service] = handlers

    add(servicer, _Capture())
    for service, handlers in captured.items():
        tolerant = {name: h._replace(request_deserializer=_tolerant(h.request_deserializer))
                    for name, h in handlers.items()}
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, tolerant),))
        server.add_registered_method_handlers(service, tolerant)


def _parsed(request: Any) -> Any:
    """The request, refused if it did not parse; a stream of requests, each refused if it did not."""
    if isinstance(request, Malformed):
        raise InvalidArgument(f"malformed request: {request.error}")
    if hasattr(request, "__aiter__"):
        return _parsed_stream(request)
    return request


async def _parsed_stream(requests: AsyncIterator[Any]) -> AsyncIterator[Any]:
    async for request in requests:
        yield _parsed(request)


async def _prepare(servicer: Any, context: Context) -> None:
    """Whatever the call's authentication needs off the event loop (a legacy scrypt token), before the handler."""
    failure_delay.set(0.0)
    auth = getattr(servicer, "auth", None)
    if auth is not None:
        await auth.prepare(context.invocation_metadata())


def descriptors_exhausted(exc: OSError) -> Unavailable:
    """The answer to a call that failed because the front is out of file descriptors (``out_of_descriptors``): a
    line in the log (rate-limited, no traceback: no bug) and UNAVAILABLE with a retry hint for the caller."""
    _exhausted_log.warning("out of descriptors", "a call failed: the broker is out of file descriptors (%s); "
                           "raise its LimitNOFILE if this persists", exc.strerror or exc)
    return Unavailable("the broker is out of file descriptors for now (too many connections or workers open); "
                       "retry in a moment, and tell the operator if it persists",
                       retry_after_seconds=EXHAUSTED_RETRY_SECONDS)


def log_failure(logger: logging.Logger, message: str, exc: Exception) -> None:
    """Log a failure of the front's own periodic work (``message`` says what failed): for want of descriptors, a
    line (rate-limited: the next round may fail too, and no traceback: no bug); anything else with its
    traceback."""
    if out_of_descriptors(exc):
        _exhausted_log.warning(f"out of descriptors: {message}", "%s: the broker is out of file descriptors (%s)",
                               message, exc.strerror or exc)
    else:
        logger.error("%s", message, exc_info=exc)


def _unexpected(exc: Exception) -> GpuBrokerError:
    if out_of_descriptors(exc):
        return descriptors_exhausted(exc)
    log.exception("unexpected error in an RPC handler")
    return Internal(f"internal broker error: {type(exc).__name__}")


async def _abort_for(context: Context, exc: Exception) -> None:
    """End the call with the status the exception stands for (an abort already under way passes through)."""
    if isinstance(exc, grpc.aio.AbortError):
        raise exc
    await abort_with(context, exc if isinstance(exc, GpuBrokerError) else _unexpected(exc))


def _begin(method: str, request: object) -> float:
    """Set the call's context (for audit and log lines) and return its start time."""
    current_method.set(method)
    admitted.set(None)
    log_context.set(None)
    session = getattr(request, "session", None)  # the session the call names, if its message has one
    bind_log_context(method=method, session=session if isinstance(session, str) else "")
    return time.perf_counter()


def _status_name(exc: BaseException, context: Context) -> str:
    """The status a failed call ends with, for the latency histogram."""
    if isinstance(exc, GpuBrokerError):
        return exc.code
    if isinstance(exc, grpc.aio.AbortError):
        code = context.code()
        return code.name if isinstance(code, grpc.StatusCode) else "UNKNOWN"
    if isinstance(exc, (asyncio.CancelledError, GeneratorExit)):
        return "CANCELLED"
    return "INTERNAL"


def rpc(fn: Callable[[Any, Req, Context], Awaitable[Resp]]) -> Callable[..., Awaitable[Resp]]:
    """Wrap a unary (or stream-in) handler: gpubroker errors become statuses, bugs become INTERNAL."""

    @functools.wraps(fn)
    async def wrapper(self: Any, request: Req, context: Context) -> Resp:
        started = _begin(fn.__name__, request)
        code = "OK"
        try:
            await _prepare(self, context)
            return await fn(self, _parsed(request), context)
        except Exception as exc:
            code = _status_name(exc, context)
            await wait_failure_delay()
            await _abort_for(context, exc)
        except BaseException as exc:
            code = _status_name(exc, context)
            raise
        finally:
            _release_slot()
            observe_rpc(fn.__name__, code, time.perf_counter() - started)
        raise AssertionError("unreachable: abort raises")

    return wrapper


def stream_rpc(fn: Callable[[Any, Req, Context], AsyncIterator[Resp]]
               ) -> Callable[..., AsyncIterator[Resp]]:
    """The same for server-streaming handlers."""

    @functools.wraps(fn)
    async def wrapper(self: Any, request: Req, context: Context) -> AsyncIterator[Resp]:
        started = _begin(fn.__name__, request)
        code = "OK"
        try:
            await _prepare(self, context)
            async for item in fn(self, _parsed(request), context):
                yield item
        except Exception as exc:
            code = _status_name(exc, context)
            await wait_failure_delay()
            await _abort_for(context, exc)
        except BaseException as exc:
            code = _status_name(exc, context)
            raise
        finally:
            _release_slot()
            observe_rpc(fn.__name__, code, time.perf_counter() - started)

    return wrapper
