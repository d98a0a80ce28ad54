"""Health (grpc.health.v1) and server reflection: whether the broker, and each of its devices, takes new sessions.

Service names: ``""`` and ``"gpubroker.v1.GpuBroker"`` stand for the whole broker, ``"gpubroker.v1.GpuBroker/device/N"``
for device N (the index clients pass to ``connect(..., device=N)``). A device is NOT_SERVING

- while its workers keep failing through no tenant's fault: ``device_failure_threshold`` failed starts, or deaths
  before any tenant code ran, within ``device_failure_window_seconds``; it serves again once a window has passed
  since the last failure. A worker that dies after running its tenant's code is that tenant's failure (its
  crash budget, workers/_pool.py), never the device's;
- for good (until the broker restarts) once NVML reported a critical Xid that is not an application error.

The whole broker is NOT_SERVING while it drains (for good) and while no device serves. A device or broker that is
not serving refuses new sessions with UNAVAILABLE and a retry hint; sessions already open go on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
from collections import deque
from collections.abc import AsyncIterable, AsyncIterator, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc

from gpubroker.broker.config import BrokerConfig
from gpubroker.broker.front._grpc_peers import grpc_peer_key, over_call_rate
from gpubroker.broker.front._metrics import HEALTH_REASONS
from gpubroker.broker.front._status import Malformed, Unread, add_servicer
from gpubroker.broker.front.auth import RateLimitedLog
from gpubroker.broker.front.listeners import take_place_of
from gpubroker.broker.front.workers import WorkerClient
from gpubroker.v1 import admin_pb2 as apb
from gpubroker.v1 import broker_pb2 as pb
from gpubroker.wire.errors import Unavailable
from gpubroker.wire.types import DeviceInfo

__all__ = ["APPLICATION_XIDS", "BROKER_SERVICE", "BrokerHealth", "device_service", "nvml_handle"]

T = TypeVar("T")
log = logging.getLogger("gpubroker.health")
audit = logging.getLogger("gpubroker.audit")

BROKER_SERVICE = pb.DESCRIPTOR.services_by_name["GpuBroker"].full_name
_ADMIN_SERVICE = apb.DESCRIPTOR.services_by_name["Admin"].full_name
# Xids that an application's own kernel causes (NVIDIA's Xid catalogue: illegal address, MMU fault from the
# program, ...): logged, the device stays in service. Any other critical Xid means the GPU needs care.
APPLICATION_XIDS = frozenset({13, 31, 43, 45, 68})
_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def device_service(device: int) -> str:
    """The health service name of one device."""
    return f"{BROKER_SERVICE}/device/{device}"


@dataclass
class _DeviceState:
    failures: deque[float] = field(default_factory=deque)
    out_until: float = 0.0  # worker failures keep the device out of service until then
    failure_reason: str = ""
    xid: int | None = None  # a critical Xid: out of service until the broker restarts


class BrokerHealth:
    """The health servicer's statuses, kept from worker failures, NVML Xid events and the drain."""

    def __init__(self, config: BrokerConfig, devices: list[DeviceInfo],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.devices = devices
        # Watch and reflection streams are served without a token and live until the peer ends them: both
        # count against max_health_streams (and per peer), refused with RESOURCE_EXHAUSTED past it; so do Check
        # requests on their way in, in a count of their own.
        self.streams = StreamLimiter(config)
        self.refusals = self.streams.refusals  # (endpoint, reason) -> count: gpubroker_endpoint_refusals
        self.servicer = _BoundedHealthServicer(self.streams)
        self.draining = False
        self.drain_deadline: float | None = None  # when the drain ends the sessions left (clock time)
        self._clock = clock
        self._states = [_DeviceState() for _ in devices]
        self._tasks: set[asyncio.Task[None]] = set()
        self._timers: dict[int, asyncio.TimerHandle] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._recent_start_errors: deque[BaseException] = deque(maxlen=16)
        self._xids: _XidWatcher | None = None

    # -- wiring ------------------------------------------------------------------------------------
    def add_to_server(self, server: grpc.aio.Server) -> None:
        """Health and reflection (so `grpcurl` can list and call the API); neither needs a token. Health's requests
        are read only within a slot of ``self.streams`` (``add_servicer``: gRPC reads a request only when asked)."""
        add_servicer(health_pb2_grpc.add_HealthServicer_to_server, self.servicer, server)
        reflector = _BoundedReflectionServicer(
            [BROKER_SERVICE, _ADMIN_SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME], self.streams)
        reflection_pb2_grpc.add_ServerReflectionServicer_to_server(reflector, server)  # type: ignore[no-untyped-call]

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        await self.publish()
        if self.config.nvml_xid_events and self.devices and self.devices[0].backend == "cuda":
            self._xids = _XidWatcher.open([d.id for d in self.devices], self._report_xid)

    async def stop(self) -> None:
        for timer in self._timers.values():
            timer.cancel()
        if self._xids is not None:
            await asyncio.to_thread(self._xids.stop)

    # -- state -------------------------------------------------------------------------------------
    def problem(self, device: int) -> str | None:
        """Why ``device`` takes no new sessions, or None when it does."""
        if not 0 <= device < len(self._states):
            return None  # OpenSession answers NOT_FOUND for it
        state = self._states[device]
        if state.xid is not None:
            return f"the GPU reported Xid {state.xid}; it needs attention (and a broker restart) first"
        left = state.out_until - self._clock()
        if left > 0:
            return f"{state.failure_reason}; back in service in {left:.0f} s without another failure"
        return None

    def not_ready(self) -> str | None:
        """Why the whole broker takes no new sessions (its health status ``""`` is NOT_SERVING), or None when it
        does: the metrics listener's ``/readyz`` answers from this, as the health service does."""
        if self.draining:
            return "draining: new sessions are refused"
        problems = [self.problem(d) for d in range(len(self._states))]
        if any(p is None for p in problems):
            return None
        return "no device serves new sessions: " + "; ".join(f"device {d}: {p}" for d, p in enumerate(problems))

    def recent_failures(self, device: int) -> int:
        state = self._states[device]
        self._expire(state, self._clock())
        return len(state.failures)

    def retry_after(self, device: int | None = None) -> float:
        """Seconds after which retrying here may succeed (a hint; clients should try another broker first)."""
        now = self._clock()
        if self.draining:
            if self.drain_deadline is not None:
                return max(1.0, self.drain_deadline - now)
            return max(1.0, self.config.drain_grace_seconds)
        if device is not None and 0 <= device < len(self._states):
            return max(1.0, self._states[device].out_until - now)
        return 1.0

    def check_open(self, device: int) -> None:
        """Refuse a new session on a draining broker or an out-of-service device, with a retry hint."""
        if self.draining:
            raise Unavailable("the broker is draining and accepts no new sessions; retry on another broker",
                              reason="draining", retry_after_seconds=round(self.retry_after(), 1))
        problem = self.problem(device)
        if problem is not None:
            hint: dict[str, Any] = {"reason": "device not serving", "device": device}
            if self._states[device].xid is None:
                hint["retry_after_seconds"] = round(self.retry_after(device), 1)
            raise Unavailable(f"device {device} is not serving new sessions: {problem}; retry on another device "
                              "or broker", **hint)

    # -- events ------------------------------------------------------------------------------------
    def worker_exited(self, worker: WorkerClient) -> None:
        """A worker's death, once the pool settled its cause: only the device's own failures count here.

        A death after its tenant's code ran (a kernel, a compile, any tenant request), or a kill for the tenant's
        sake, is the tenant's (its crash budget, workers/_pool.py); a stop or a drain is nobody's.
        """
        if worker.blame != "device":
            return
        self._record_failure(worker.device, worker.death or f"the worker exited with {worker.returncode}")

    def worker_start_failed(self, device: int, error: BaseException) -> None:
        # Callers waiting on one shared start all see the same exception: count it once.
        if any(e is error for e in self._recent_start_errors):
            return
        self._recent_start_errors.append(error)
        self._record_failure(device, f"a worker failed to start: {error}")

    def gpu_fault(self, device: int, xid: int) -> None:
        """NVML reported a critical Xid on ``device``."""
        if xid in APPLICATION_XIDS:
            log.warning("device %d: Xid %d, an application error; the device stays in service", device, xid)
            return
        log.error("device %d: Xid %d; the device takes no new sessions until it is looked after and the broker "
                  "restarts", device, xid)
        self._states[device].xid = xid
        self._spawn(self.publish())

    def _expire(self, state: _DeviceState, now: float) -> None:
        window = self.config.device_failure_window_seconds
        while state.failures and state.failures[0] <= now - window:
            state.failures.popleft()

    def _record_failure(self, device: int, reason: str) -> None:
        threshold = self.config.device_failure_threshold
        if threshold <= 0 or not 0 <= device < len(self._states):
            return
        state, now = self._states[device], self._clock()
        state.failures.append(now)
        self._expire(state, now)
        if len(state.failures) < threshold:
            return
        window = self.config.device_failure_window_seconds
        if state.out_until <= now:
            log.error("device %d is not serving new sessions: %d worker failures within %g s (the last: %s)",
                      device, len(state.failures), window, reason)
        state.out_until = now + window
        state.failure_reason = f"{len(state.failures)} worker failures within {window:g} s, the last: {reason}"
        self._spawn(self.publish())
        # Back in service when the window has passed with no further failure: publish again then.
        if device in self._timers:
            self._timers[device].cancel()
        self._timers[device] = asyncio.get_running_loop().call_later(window + 0.05,
                                                                     lambda: self._spawn(self.publish()))

    def _report_xid(self, device: int, xid: int) -> None:
        """From the NVML thread: hand the event to the event loop."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self.gpu_fault, device, xid)

    # -- publishing --------------------------------------------------------------------------------
    async def drain(self, deadline: float | None) -> None:
        """From now on the broker takes no new sessions; every health status goes NOT_SERVING until ``undrain``."""
        self.draining = True
        if deadline is not None and (self.drain_deadline is None or deadline < self.drain_deadline):
            self.drain_deadline = deadline
        await self.publish()

    async def undrain(self) -> bool:
        """Take new sessions again, each device's health its own; whether the broker was draining."""
        was, self.draining, self.drain_deadline = self.draining, False, None
        await self.publish()
        return was

    async def publish(self) -> None:
        """Write the current statuses into the servicer (all NOT_SERVING while draining)."""
        serving = [self.problem(d) is None and not self.draining for d in range(len(self._states))]
        for device, ok in enumerate(serving):
            await self.servicer.set(device_service(device), _SERVING if ok else _NOT_SERVING)
        overall = _SERVING if any(serving) else _NOT_SERVING
        for name in ("", BROKER_SERVICE):
            await self.servicer.set(name, overall)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


@dataclass(eq=False)
class _Hold:
    """One stream or request a peer holds open: its call's task, to end it if a newcomer takes its place."""

    peer: str
    task: asyncio.Task[Any] | None
    counted: bool = True


@dataclass
class _Tally:
    """What is open, in all and per peer (each peer's holds oldest first)."""

    open: int = 0
    by_peer: dict[str, dict[_Hold, None]] = field(default_factory=dict)

    def held(self, peer: str) -> int:
        return len(self.by_peer.get(peer, ()))

    def add(self, hold: _Hold) -> None:
        self.open += 1
        self.by_peer.setdefault(hold.peer, {})[hold] = None

    def release(self, hold: _Hold) -> None:
        if not hold.counted:
            return
        hold.counted = False
        self.open -= 1
        mine = self.by_peer[hold.peer]
        del mine[hold]
        if not mine:
            del self.by_peer[hold.peer]

    def evictable(self, peer: str) -> _Hold | None:
        """The hold a newcomer of ``peer`` takes the place of at the total (`listeners.take_place_of`)."""
        found = take_place_of(self.by_peer, peer)
        return None if found is None else found[1]


class StreamLimiter:
    """Counts what unauthenticated calls hold open, in all and per peer: health Watch and reflection streams
    (``slot``), and apart from them health requests on their way in (``reading``). Any request may be announced at
    up to max_message_bytes and never completed, which gRPC buffers while the front reads it; a real probe's
    arrives with its call, in microseconds."""

    def __init__(self, config: BrokerConfig) -> None:
        self.config = config
        self.streams = _Tally()
        self.requests = _Tally()
        self.refusals: dict[tuple[str, str], int] = {}
        for reason in HEALTH_REASONS:
            self.refusals[("health", reason)] = 0
        self._log = RateLimitedLog(audit)

    def slot(self, context: grpc.aio.ServicerContext[Any, Any], what: str
             ) -> contextlib.AbstractAsyncContextManager[None]:
        """Hold one stream slot for the ``with`` body; abort the call with RESOURCE_EXHAUSTED when none is free."""
        return self._hold(self.streams, "streams", context, what)

    def reading(self, context: grpc.aio.ServicerContext[Any, Any], what: str
                ) -> contextlib.AbstractAsyncContextManager[None]:
        """The same for a request being read, in a count of its own (a Check is served at the stream cap)."""
        return self._hold(self.requests, "requests", context, what)

    @contextlib.asynccontextmanager
    async def _hold(self, tally: _Tally, kind: str, context: grpc.aio.ServicerContext[Any, Any], what: str
                    ) -> AsyncIterator[None]:
        if (too_fast := over_call_rate(context)) is not None:  # (first: its connection is being cut)
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, too_fast)
        peer = grpc_peer_key(context)  # (the gate's key: one local user is one peer, whatever its socket)
        total, per_peer = self.config.max_health_streams, self.config.max_health_streams_per_peer
        refusal = None
        if tally.held(peer) >= per_peer:
            refusal = (f"peer {kind}", f"this peer has {tally.held(peer)} {what} {kind} open, "
                       f"max_health_streams_per_peer is {per_peer}")
        elif tally.open >= total:
            # Four peers at their share held the whole total (the readiness probe refused for as long as they
            # liked): a newcomer takes the place of the oldest of the peer holding the most, if that is more than
            # its own would hold, which ends.
            victim = tally.evictable(peer)
            if victim is None:
                refusal = (kind, f"{tally.open} {what} {kind} open, max_health_streams is {total}")
            else:
                tally.release(victim)
                if victim.task is not None:
                    victim.task.cancel()
                self.refusals[("health", f"evicted {kind}")] += 1
                self._log.warning(f"health evicted {kind}", "action=end-%s listener=grpc peer=%s reason=max_health_"
                                  "streams (%d) open: its place taken by %s (its peer holds the most)",
                                  kind.removesuffix("s"), victim.peer, total, peer)
        if refusal is not None:
            reason, detail = refusal
            self.refusals[("health", reason)] += 1
            self._log.warning(f"health {reason}", "action=refuse-%s listener=grpc method=%s peer=%s reason=%s",
                              kind.removesuffix("s"), what, peer, detail)
            hint = "end one (Check needs no stream)" if kind == "streams" else "send whole requests"
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"too many open {kind}: {detail}; {hint} or "
                                "retry later")
        hold = _Hold(peer, asyncio.current_task())
        tally.add(hold)
        try:
            yield
        finally:
            tally.release(hold)


async def _read(request: Any, context: grpc.aio.ServicerContext[Any, Any], config: BrokerConfig) -> Any:
    """A health call's request, read now (``Unread``) within request_message_timeout_seconds (as an
    authenticated call's: a request held one byte short would otherwise keep its place in the per-peer count until
    the connection ends); INVALID_ARGUMENT if it does not parse."""
    if isinstance(request, Unread):
        timeout = config.request_message_timeout_seconds
        try:
            async with asyncio.timeout(timeout):
                request = await request.read()
        except TimeoutError:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "the call's request message did not arrive "
                                f"within request_message_timeout_seconds ({timeout:g} s)")
    if isinstance(request, Malformed):
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed request: {request.error}")
    return request


class _BoundedHealthServicer(health.aio.HealthServicer):  # type: ignore[misc]
    """grpc.health.v1 with Watch streams bounded by a ``StreamLimiter``, and the requests of its unary calls
    (Check, List: one cheap call each) read only within a ``reading`` slot of it."""

    def __init__(self, streams: StreamLimiter) -> None:
        super().__init__()
        self._streams = streams

    async def Check(self, request: Unread | health_pb2.HealthCheckRequest,
                    context: grpc.aio.ServicerContext[Any, Any]) -> health_pb2.HealthCheckResponse:
        if isinstance(request, Unread):  # (not yet read: within a slot)
            async with self._streams.reading(context, "Check"):
                request = await _read(request, context, self._streams.config)
        return await super().Check(request, context)

    async def List(self, request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        async with self._streams.reading(context, "List"):
            await _read(request, context, self._streams.config)
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "List is not served: Check or Watch a service by name")

    async def Watch(self, request: Unread | health_pb2.HealthCheckRequest,
                    context: grpc.aio.ServicerContext[Any, Any]) -> None:
        async with self._streams.slot(context, "Watch"):
            await super().Watch(await _read(request, context, self._streams.config), context)


class _BoundedReflectionServicer(reflection.aio.ReflectionServicer):
    """Server reflection with its streams bounded by the same ``StreamLimiter``: they too stay open for good."""

    def __init__(self, service_names: list[str], streams: StreamLimiter) -> None:
        super().__init__(service_names)
        self._streams = streams

    async def ServerReflectionInfo(  # type: ignore[override]
            self, request_iterator: AsyncIterable[reflection_pb2.ServerReflectionRequest],
            context: grpc.aio.ServicerContext[Any, Any]) -> AsyncIterator[reflection_pb2.ServerReflectionResponse]:
        async with self._streams.slot(context, "ServerReflectionInfo"):
            # (an async generator, though its stub says a coroutine that returns an AsyncIterable)
            responses = cast(AsyncIterable[reflection_pb2.ServerReflectionResponse],
                             super().ServerReflectionInfo(_each_a_call(request_iterator, context), context))
            async for response in responses:
                yield response


async def _each_a_call(requests: AsyncIterable[T], context: grpc.aio.ServicerContext[Any, Any]) -> AsyncIterator[T]:
    """A reflection stream's requests, each taking a token of its peer's call rate as a call does: each is answered
    by the front's loop (a whole file descriptor serialised again), and a stream, started once, carried them
    unbounded (two uids' streams, 37,800 answers in 5 s, held the front at a CPU). Past the rate the stream is
    refused and its connection cut (``over_call_rate``)."""
    async for request in requests:
        if (too_fast := over_call_rate(context)) is not None:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, too_fast)
        yield request


class _XidWatcher:
    """Waits on NVML's critical-Xid events in a thread of its own; only where ``pynvml`` is importable."""

    def __init__(self, nvml: Any, event_set: Any, uuids: dict[str, int], report: Callable[[int, int], None]) -> None:
        self._nvml = nvml
        self._events = event_set
        self._uuids = uuids
        self._report = report
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gpubroker-nvml-xid", daemon=True)
        self._thread.start()

    @classmethod
    def open(cls, cuda_ordinals: list[int], report: Callable[[int, int], None]) -> _XidWatcher | None:
        try:
            import pynvml as nvml  # optional (nvidia-ml-py): without it, only worker failures count
        except ImportError:
            log.info("pynvml is not installed: GPU Xid errors are not watched")
            return None
        try:
            nvml.nvmlInit()
            event_set = nvml.nvmlEventSetCreate()
            uuids: dict[str, int] = {}
            for device, ordinal in enumerate(cuda_ordinals):
                handle = nvml_handle(nvml, ordinal)
                uuids[_text(nvml.nvmlDeviceGetUUID(handle))] = device
                nvml.nvmlDeviceRegisterEvents(handle, nvml.nvmlEventTypeXidCriticalError, event_set)
        except Exception as exc:  # NVMLError (no driver, not supported), or a CUDA_VISIBLE_DEVICES we cannot map
            log.warning("GPU Xid errors are not watched: NVML: %s", exc)
            return None
        log.info("watching NVML for critical Xid errors on %d devices", len(uuids))
        return cls(nvml, event_set, uuids, report)

    def _run(self) -> None:
        nvml = self._nvml
        while not self._stopping.is_set():
            try:
                event = nvml.nvmlEventSetWait_v2(self._events, 500)
            except nvml.NVMLError_Timeout:
                continue
            except Exception as exc:
                log.warning("NVML event wait failed, no longer watching Xid errors: %s", exc)
                return
            try:
                device = self._uuids.get(_text(nvml.nvmlDeviceGetUUID(event.device)))
            except Exception:
                device = None
            if device is not None:
                self._report(device, int(event.eventData))

    def stop(self) -> None:
        self._stopping.set()
        self._thread.join(5.0)
        try:
            self._nvml.nvmlEventSetFree(self._events)
            self._nvml.nvmlShutdown()
        except Exception:
            pass


def nvml_handle(nvml: Any, ordinal: int) -> Any:
    """CUDA's device ``ordinal`` as an NVML handle, through CUDA_VISIBLE_DEVICES (indices or GPU-UUIDs).

    NVML numbers GPUs in PCI bus order; set CUDA_DEVICE_ORDER=PCI_BUS_ID so that CUDA numbers them alike.
    """
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    if not visible:
        return nvml.nvmlDeviceGetHandleByIndex(ordinal)
    entry = visible[ordinal]
    if entry.isdigit():
        return nvml.nvmlDeviceGetHandleByIndex(int(entry))
    return nvml.nvmlDeviceGetHandleByUUID(entry)


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value
