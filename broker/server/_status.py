"""The transport boundary: GpuBrokerError <-> gRPC status, with structured details in a trailer."""

from __future__ import annotations

import contextvars
import functools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import grpc
import msgpack

from gpubroker.client import GpuBrokerError, Internal

from ..auth import Authenticator, Principal
from ..sessions import Session

__all__ = ["ERROR_TRAILER", "principal_of", "release_slot", "rpc", "stream_rpc"]

log = logging.getLogger("gpubroker.server")
# The RPC being served, for audit lines; set by the wrappers below.
current_method: contextvars.ContextVar[str] = contextvars.ContextVar("current_method", default="")
# The session whose concurrent-RPC slot this call holds; released when the call ends.
admitted: contextvars.ContextVar[Session | None] = contextvars.ContextVar("admitted", default=None)


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


async def abort_with(context: grpc.aio.ServicerContext, exc: GpuBrokerError) -> None:
    details = msgpack.packb({"type": type(exc).__name__, "details": exc.details}, use_bin_type=True)
    await context.abort(grpc.StatusCode[exc.code], exc.message, trailing_metadata=((ERROR_TRAILER, details),))


def principal_of(auth: Authenticator, context: grpc.aio.ServicerContext) -> Principal:
    """Authenticate the call from its metadata and, on TLS, its verified client certificate."""
    try:
        auth_context = context.auth_context() or {}
    except Exception:  # local credentials carry no auth context on some grpc builds
        auth_context = {}
    return auth.authenticate(context.invocation_metadata(), auth_context, context.peer(), current_method.get())


def _unexpected(exc: Exception) -> GpuBrokerError:
    log.exception("unexpected error in an RPC handler")
    return Internal(f"internal broker error: {type(exc).__name__}")


async def _abort_for(context: grpc.aio.ServicerContext, exc: Exception) -> None:
    """End the call with the status the exception stands for (an abort already under way passes through)."""
    if isinstance(exc, grpc.aio.AbortError):
        raise exc
    await abort_with(context, exc if isinstance(exc, GpuBrokerError) else _unexpected(exc))


def rpc(fn: Callable[[Any, Req, grpc.aio.ServicerContext], Awaitable[Resp]]) -> Callable[..., Awaitable[Resp]]:
    """Wrap a unary (or stream-in) handler: gpubroker errors become statuses, bugs become INTERNAL."""

    @functools.wraps(fn)
    async def wrapper(self: Any, request: Req, context: grpc.aio.ServicerContext) -> Resp:
        current_method.set(fn.__name__)
        admitted.set(None)
        try:
            return await fn(self, request, context)
        except Exception as exc:
            await _abort_for(context, exc)
        finally:
            _release_slot()
        raise AssertionError("unreachable: abort raises")

    return wrapper


def stream_rpc(fn: Callable[[Any, Req, grpc.aio.ServicerContext], AsyncIterator[Resp]]
               ) -> Callable[..., AsyncIterator[Resp]]:
    """The same for server-streaming handlers."""

    @functools.wraps(fn)
    async def wrapper(self: Any, request: Req, context: grpc.aio.ServicerContext) -> AsyncIterator[Resp]:
        current_method.set(fn.__name__)
        admitted.set(None)
        try:
            async for item in fn(self, request, context):
                yield item
        except Exception as exc:
            await _abort_for(context, exc)
        finally:
            _release_slot()

    return wrapper
