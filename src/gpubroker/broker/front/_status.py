"""The transport boundary: GpuBrokerError <-> gRPC status, with structured details in a trailer."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import inspect
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol, TypeAlias, TypeVar

import grpc

from gpubroker.broker.front._error_details import budget, error_trailers
from gpubroker.broker.front._grpc_peers import grpc_authenticated, grpc_peer, over_call_rate
from gpubroker.broker.front._metrics import observe_rpc
from gpubroker.broker.front._sessions import Session, SessionManager, out_of_descriptors
from gpubroker.broker.front.auth import (
    REVOKED_CALL_MESSAGE,
    Authenticator,
    Principal,
    RateLimitedLog,
    failure_delay,
    grpc_credentials,
    wait_failure_delay,
)
from gpubroker.broker.logs import bind_log_context, log_context
from gpubroker.wire.errors import (
    DeadlineExceeded,
    GpuBrokerError,
    Internal,
    InvalidArgument,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
)

__all__ = ["Context", "Malformed", "Unread", "add_servicer", "cancel_and_wait", "descriptors_exhausted",
           "log_failure", "principal_of", "release_slot", "rpc", "stream_rpc"]

log = logging.getLogger("gpubroker.server")
# One line per burst of calls refused for want of descriptors (a flood of them must not flood the log too).
_exhausted_log = RateLimitedLog(log)
# How long a client refused for want of the front's descriptors is told to wait.
EXHAUSTED_RETRY_SECONDS = 1.0
# The RPC being served, for audit lines; set by the wrappers below.
current_method: contextvars.ContextVar[str] = contextvars.ContextVar("current_method", default="")
# The session whose concurrent-RPC slot this call holds; released when the call ends.
admitted: contextvars.ContextVar[Session | None] = contextvars.ContextVar("admitted", default=None)
# Who made the call being served: authenticated by the wrappers below before its request is read (``_admit``).
caller: contextvars.ContextVar[Principal | None] = contextvars.ContextVar("caller", default=None)
# The call's hold on its tenant's place among its calls in flight and on its credential (``_Admitted``), from its
# authentication to its end.
counted: contextvars.ContextVar[_Admitted | None] = contextvars.ContextVar("counted", default=None)


async def cancel_and_wait(task: asyncio.Task[None] | None) -> None:
    """End one of the front's background loops (a sweep, a watch, a census) and wait until it has."""
    if task is not None:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def release_slot(session: Session) -> None:
    """Give back the session's concurrent-call slot that the service's ``admit`` took."""
    session.inflight -= 1


def _release_slots() -> None:
    """At the call's end: its session's slot, and its place in its tenant's calls in flight."""
    session = admitted.get()
    if session is not None:
        release_slot(session)
        admitted.set(None)
    call = counted.get()
    if call is not None:
        call.release()
        counted.set(None)


class _Admitted:
    """A call from its authentication (``_admit``) to its end: its place among its tenant's calls in flight
    (``max_inflight_per_tenant``) and its watch on the credential that let it in. The front ends it (cancels its
    task, which the wrapper answers with ``ended``) and gives its place back at once when that credential is revoked
    at a reload, or when its request message has not arrived within ``request_message_timeout_seconds``: a call
    staged with all but the last byte of its request cannot outlive its token nor hold its tenant's places. (Its
    cost on every call: this object, a watch and two dict entries, about a microsecond.)"""

    __slots__ = ("auth", "ended", "principal", "sessions", "task", "watch")

    def __init__(self, auth: Authenticator, sessions: SessionManager, principal: Principal) -> None:
        self.auth, self.principal = auth, principal
        self.sessions: SessionManager | None = sessions  # None once the place is given back
        self.task = asyncio.current_task()
        self.ended: GpuBrokerError | None = None  # why the front ended the call, if it did
        self.watch: int | None = auth.revocations.watch(principal, self.revoke)

    def revoke(self) -> None:
        self.watch = None  # (Revocations has dropped it)
        self._end(Unauthenticated(REVOKED_CALL_MESSAGE))

    def late(self) -> None:
        self._end(DeadlineExceeded(
            f"the call's request message did not arrive within request_message_timeout_seconds "
            f"({self.auth.config.request_message_timeout_seconds:g} s) of its authentication"))

    def _end(self, error: GpuBrokerError) -> None:
        if self.ended is not None:
            return
        self.ended = error
        self.release()
        # (not the task running now: an admin's Reload that revokes its own token finishes its reload)
        if self.task is not None and self.task is not asyncio.current_task():
            self.task.cancel()

    def release(self) -> None:
        """Give back the call's place and drop its watch (once: the call's end and ``_end`` both do)."""
        if self.watch is not None:
            self.auth.revocations.unwatch(self.principal, self.watch)
            self.watch = None
        if self.sessions is not None:
            self.sessions.leave_call(self.principal.tenant)
            self.sessions = None

    async def read(self, request: Unread) -> Any:
        """The unary call's request message, within request_message_timeout_seconds; its credential checked
        again once it has come (a reload may have revoked it while the message was on its way)."""
        _reading.start(self, self.auth.config.request_message_timeout_seconds)
        try:
            message = await request.read()
        finally:
            _reading.stop(self)
        if not self.auth.valid(self.principal.tenant, self.principal.credential):
            raise Unauthenticated(REVOKED_CALL_MESSAGE)
        return message


class _Reading:
    """The calls whose request message is on its way in, each with its deadline, oldest first, and one timer for
    all of them at the oldest's deadline: a timer each would cost more than the rest of ``_Admitted`` together
    (about 2 us a call), this a dict entry. (The timeout is the same for every call, so the order of arrival is the
    order of the deadlines.)"""

    def __init__(self) -> None:
        self.calls: dict[_Admitted, float] = {}
        self.timer: asyncio.TimerHandle | None = None
        self.loop: asyncio.AbstractEventLoop | None = None

    def start(self, call: _Admitted, timeout: float) -> None:
        loop = asyncio.get_running_loop()
        if loop is not self.loop:  # (a new event loop: one of an earlier broker in this process is gone)
            self.calls.clear()
            self.loop, self.timer = loop, None
        deadline = loop.time() + timeout
        self.calls[call] = deadline
        if self.timer is None:
            self.timer = loop.call_at(deadline, self._sweep)

    def stop(self, call: _Admitted) -> None:
        self.calls.pop(call, None)

    def _sweep(self) -> None:
        self.timer = None
        loop = asyncio.get_running_loop()
        now = loop.time()
        due = []
        for call, deadline in self.calls.items():
            if deadline > now:  # the oldest still on time: the next sweep at its deadline
                self.timer = loop.call_at(deadline, self._sweep)
                break
            due.append(call)
        for call in due:
            del self.calls[call]
            call.late()


_reading = _Reading()


def _ended(exc: BaseException) -> GpuBrokerError | None:
    """The error a call ends with when the front cancelled it (``_Admitted``): its cancellation is taken back, the
    call answered with the error. None for any other cancellation (the client's, the server's stop)."""
    call = counted.get()
    if call is None or call.ended is None or not isinstance(exc, asyncio.CancelledError):
        return None
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        task.uncancel()
    return call.ended

Req = TypeVar("Req")
Resp = TypeVar("Resp")


class Admitting(Protocol):
    """What a servicer whose handlers are wrapped here has: the broker's authenticator, and the sessions that
    count each tenant's calls in flight."""

    auth: Authenticator
    sessions: SessionManager


S = TypeVar("S", bound=Admitting)
# The servicers use their context only for metadata, the peer and abort, none of which depend on the message types
# (those matter only to a context's read and write, for streams the servicers read as iterators instead). A string,
# because grpc.aio.ServicerContext is generic only in its stubs, not at run time.
Context: TypeAlias = "grpc.aio.ServicerContext[Any, Any]"


async def abort_with(context: Context, exc: GpuBrokerError) -> None:
    # The status says the code and the message; our trailer, the WireError's class and details; beside it the
    # standard google.rpc.Status that other gRPC clients read: all within what the client accepts
    # (_error_details.py).
    try:
        asked = context.invocation_metadata()
    except Exception:  # (a call the front refused before gRPC read its headers has none)
        asked = None
    try:
        message, trailers = error_trailers(exc, budget(asked))
    except Exception:  # (a bug here must not turn a refusal into a traceback: the code and a short message go)
        log.exception("the trailers of a %s error failed", exc.code)
        message, trailers = exc.message[:1024], ()
    await context.abort(grpc.StatusCode[exc.code], message, trailing_metadata=trailers)


def principal_of(auth: Authenticator, context: Context) -> Principal:
    """Who made the call: authenticated once, by the wrapper, before its request was read (``_admit``)."""
    principal = caller.get()
    return principal if principal is not None else _authenticate(auth, context)


def _authenticate(auth: Authenticator, context: Context) -> Principal:
    """Authenticate the call from its metadata and, on TLS, its verified client certificate."""
    try:
        auth_context = context.auth_context() or {}
    except Exception:  # local credentials carry no auth context on some grpc builds
        auth_context = {}
    principal = auth.authenticate(grpc_credentials(context.invocation_metadata(), auth_context, grpc_peer(context)),
                                  current_method.get())
    bind_log_context(tenant=principal.tenant)
    return principal


class Unread:
    """A unary call's request message, not read yet. Every call of the services is registered with gRPC as
    request-streaming (``add_servicer``), so that gRPC reads no message of a call until the wrapper asks for it,
    once the call has authenticated (``_admit``): gRPC grants the peer a message's bytes only while a read of it
    is pending, so a call that never authenticates holds at most its stream's flow-control window (64 KiB, the
    server probing no BDP: server/_server.py) of a message in the front, however large the message it announces."""

    __slots__ = ("_context",)

    def __init__(self, context: Context) -> None:
        self._context = context

    async def read(self) -> Any:
        # (the context's read, not gRPC's request iterator: one left unfinished is an async generator that the
        # event loop closes later in a task of its own, a measurable cost on every call)
        request = await self._context.read()
        if request is grpc.aio.EOF:
            raise InvalidArgument("the call ended before its request message (a unary call sends exactly one)")
        return request


class Malformed:
    """A request whose bytes did not parse; the handler's wrapper answers it with INVALID_ARGUMENT."""

    __slots__ = ("error",)

    def __init__(self, error: str) -> None:
        self.error = error


# gRPC parses each request with protobuf on the front's event loop, before any handler sees it, at a cost that
# grows with the message's fields: a typed Commands batch (its ``commands``, what other languages send) of 3 MiB
# holding 300,000 kernel arguments cost the loop 30 ms, which the front then refused (4,096 a batch). So a
# CommandBatch larger than this is parsed only if it holds no typed commands: an encoded batch (``encoded``, one
# field of bytes, which parses at the speed of a copy) may be as large as a frame. About 1,000 typed launches fit.
TYPED_BATCH_MAX_BYTES = 64 * 1024
# A CommandBatch's field numbers: what an encoded batch holds (session, batch, encoded), and the typed commands.
_ENCODED_FIELDS = frozenset({1, 2, 10})


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    """The varint at ``pos`` and the position after it; ValueError if ``data`` ends first or it is over 10 bytes."""
    value = shift = 0
    for k in range(pos, min(pos + 10, len(data))):
        value |= (data[k] & 0x7F) << shift
        if data[k] < 0x80:
            return value, k + 1
        shift += 7
    raise ValueError("a varint cut short")


def typed_batch_refusal(data: bytes) -> str | None:
    """Why a CommandBatch of these bytes is refused before it is parsed, or None. A large one must be an encoded
    batch: at most three top-level fields, none of them typed commands; the walk reads no more than three field
    headers, whatever the message's size. Bytes that are no protobuf are left to protobuf's parser to refuse."""
    if len(data) <= TYPED_BATCH_MAX_BYTES:
        return None
    refusal = (f"a Commands batch of {len(data)} bytes holding typed commands: a typed batch is at most "
               f"{TYPED_BATCH_MAX_BYTES} bytes; send several, or the batch encoded (CommandBatch.encoded)")
    pos = 0
    try:
        for _ in range(len(_ENCODED_FIELDS)):
            if pos >= len(data):
                return None
            tag, pos = _varint(data, pos)
            if tag >> 3 not in _ENCODED_FIELDS:
                return refusal
            wire = tag & 7
            if wire == 0:
                _, pos = _varint(data, pos)
            elif wire == 2:
                length, pos = _varint(data, pos)
                pos += length
            else:
                return None  # (no field of a CommandBatch is sent so: protobuf's parser refuses it)
    except ValueError:
        return None
    return None if pos >= len(data) else refusal


def _tolerant(deserialize: Callable[[bytes], Any],
              refused: Callable[[bytes], str | None] | None = None) -> Callable[[bytes], Any]:
    """gRPC ends a call whose request fails to parse with UNKNOWN (INTERNAL for a stream): a client's bad bytes
    are its own error, so they reach the handler as Malformed instead. ``refused``: why a request is refused
    before it is parsed (None: parsed)."""

    def parse(data: bytes) -> Any:
        if refused is not None and (why := refused(data)) is not None:
            return Malformed(why)
        try:
            return deserialize(data)
        except Exception as exc:  # DecodeError, and whatever else hostile bytes provoke in a parser
            return Malformed(f"{type(exc).__name__}: {exc}")

    return parse


def add_servicer(add: Callable[[Any, Any], None], servicer: Any, server: grpc.aio.Server) -> None:
    """Register a servicer as its generated ``add_*_to_server`` would, with requests parsed by ``_tolerant`` and
    read only when the servicer asks (a unary call's request comes as ``Unread``: ``_read_when_asked``)."""
    captured: dict[str, dict[str, Any]] = {}

    class _Capture:
        def add_generic_rpc_handlers(self, handlers: Any) -> None:
            pass  # the same handlers come to add_registered_method_handlers

        def add_registered_method_handlers(self, service: str, handlers: dict[str, Any]) -> None:
            captured[service] = handlers

    add(servicer, _Capture())
    for service, handlers in captured.items():
        tolerant = {name: _read_when_asked(h._replace(request_deserializer=_tolerant(
                        h.request_deserializer, typed_batch_refusal if name == "Commands" else None)))
                    for name, h in handlers.items()}
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, tolerant),))
        server.add_registered_method_handlers(service, tolerant)


def _read_when_asked(handler: grpc.RpcMethodHandler[Any, Any]) -> grpc.RpcMethodHandler[Any, Any]:
    """A unary-request handler registered as request-streaming, its request passed as ``Unread``: gRPC reads a
    unary call's message as soon as the call arrives, before any handler runs, and a streaming call's only when
    the handler reads it. (A server interceptor would not do: it runs at the same point, but sees neither the
    peer, which failure delays are charged to, nor a TLS client's certificate, and gRPC reads a unary call's
    message before whatever handler it returns runs.) gRPC's own request iterator (``requests``) goes unused:
    ``Unread`` reads through the context."""
    if handler.request_streaming:
        return handler
    if handler.response_streaming:
        unary_stream: Any = handler.unary_stream  # (async, whatever the stubs say)

        async def stream_stream(requests: AsyncIterator[Any], context: Context) -> AsyncIterator[Any]:
            async for response in unary_stream(Unread(context), context):
                yield response

        async def stream_writer(requests: AsyncIterator[Any], context: Context) -> None:
            await unary_stream(Unread(context), context)  # (one that writes its responses through its context)

        behavior = stream_writer if inspect.iscoroutinefunction(unary_stream) else stream_stream
        return grpc.stream_stream_rpc_method_handler(behavior, handler.request_deserializer,
                                                     handler.response_serializer)
    unary_unary: Any = handler.unary_unary

    async def stream_unary(requests: AsyncIterator[Any], context: Context) -> Any:
        return await unary_unary(Unread(context), context)

    return grpc.stream_unary_rpc_method_handler(stream_unary, handler.request_deserializer,
                                                handler.response_serializer)


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


async def _admit(servicer: Admitting, context: Context) -> None:
    """Before the call's request is read: authenticate it (from its metadata, and on TLS its certificate) and
    count it among its tenant's calls in flight. A call that fails is answered without its message ever being
    read; one that passes holds its tenant's slot while its message arrives (within
    request_message_timeout_seconds), so what a tenant's messages on their way in hold of the front is bounded by
    its calls in flight; and until its end it is watched for its credential's revocation (``_Admitted``).

    First of all, before any work of authentication: its peer's call rate (``over_call_rate``), whose overflow is
    refused at once and its connection cut, so that opening and cancelling calls in a loop cannot take the loop.
    """
    failure_delay.set(0.0)
    if (too_fast := over_call_rate(context)) is not None:
        raise ResourceExhausted(too_fast)
    auth = servicer.auth
    await auth.prepare(context.invocation_metadata())  # (a legacy scrypt token: checked off the event loop)
    principal = _authenticate(auth, context)
    # (its connection may stay: the gate closes those that never authenticate; and one past its tenant's share of
    # the gate's connections is refused here, so that it stays one of those)
    too_many = grpc_authenticated(context, principal.tenant, functools.partial(_watch, auth, principal))
    if too_many is not None:
        raise ResourceExhausted(too_many)
    caller.set(principal)
    sessions = servicer.sessions
    sessions.enter_call(principal.tenant)
    counted.set(_Admitted(auth, sessions, principal))


def _watch(auth: Authenticator, principal: Principal, on_revoke: Callable[[], None]) -> Callable[[], None]:
    """Watch ``principal``'s credential (a connection's first authenticated call's, for the gRPC gate): returns what
    takes the watch off."""
    watch = auth.revocations.watch(principal, on_revoke)
    return functools.partial(auth.revocations.unwatch, principal, watch)


async def _received(request: Any) -> Any:
    """The call's request, read now if it is a unary call's (``Unread``: within the front's deadline, and its
    credential checked again once read); refused if it did not parse."""
    if isinstance(request, Unread):
        call = counted.get()
        request = await (call.read(request) if call is not None else request.read())
        session = getattr(request, "session", None)  # the session the call names, if its message has one
        if isinstance(session, str):
            bind_log_context(session=session)
    return _parsed(request)


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
    caller.set(None)
    counted.set(None)
    log_context.set(None)
    session = getattr(request, "session", None)  # a request already read (not through gRPC): its session
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


def rpc(fn: Callable[[S, Req, Context], Awaitable[Resp]]) -> Callable[[S, Req, Context], Awaitable[Resp]]:
    """Wrap a unary (or stream-in) handler: gpubroker errors become statuses, bugs become INTERNAL."""

    @functools.wraps(fn)
    async def wrapper(self: S, request: Req, context: Context) -> Resp:
        started = _begin(fn.__name__, request)
        code = "OK"
        try:
            await _admit(self, context)
            return await fn(self, await _received(request), context)
        except Exception as exc:
            code = _status_name(exc, context)
            await wait_failure_delay()
            await _abort_for(context, exc)
        except BaseException as exc:
            if (ended := _ended(exc)) is None:
                code = _status_name(exc, context)
                raise
            code = ended.code
            await abort_with(context, ended)
        finally:
            _release_slots()
            observe_rpc(fn.__name__, code, time.perf_counter() - started)
        raise AssertionError("unreachable: abort raises")

    return wrapper


def stream_rpc(fn: Callable[[S, Req, Context], AsyncIterator[Resp]]
               ) -> Callable[[S, Req, Context], AsyncIterator[Resp]]:
    """The same for server-streaming handlers."""

    @functools.wraps(fn)
    async def wrapper(self: S, request: Req, context: Context) -> AsyncIterator[Resp]:
        started = _begin(fn.__name__, request)
        code = "OK"
        try:
            await _admit(self, context)
            async for item in fn(self, await _received(request), context):
                yield item
        except Exception as exc:
            code = _status_name(exc, context)
            await wait_failure_delay()
            await _abort_for(context, exc)
        except BaseException as exc:
            if (ended := _ended(exc)) is None:
                code = _status_name(exc, context)
                raise
            code = ended.code
            await abort_with(context, ended)
        finally:
            _release_slots()
            observe_rpc(fn.__name__, code, time.perf_counter() - started)

    return wrapper
