"""The same-host fast path: msgpack frames on a plain Unix socket beside the gRPC one.

gRPC in Python costs hundreds of microseconds a call; a raw Unix socket costs tens. Synchronous device calls
(launch, memset, device copy, synchronize) and whole command batches come here from local clients, are
authenticated once per connection (bearer token + session), take the same scheduler turns and reach the same
worker as their gRPC twins. Requests are ``[id, op, protobuf bytes]``; replies ``[id, 0, result]`` or
``[id, 1, error]``. A connection whose hello asks for ``direct`` is handed to the session's worker instead
(workers/_direct.py), with the tenant's turns leased to that worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar, cast

from google.protobuf.message import DecodeError, Message

from gpubroker.client import GpuBrokerError, Internal, InvalidArgument, Unauthenticated, WorkerCrashed
from gpubroker.v1 import broker_pb2 as pb

from ..auth import Principal, wait_failure_delay
from ..logs import bind_log_context
from ..scheduler import TurnLease
from ..sessions import Session
from ..workers._frames import (
    FrameClosed,
    FrameTooLarge,
    pack_frame,
    read_frame_async,
    read_payload_async,
    unpack_frame,
    write_frame_async,
)
from ._metrics import observe_rpc
from ._preauth import Idle, IdleSweeper, PreAuthGate, Ticket
from ._status import release_slot

__all__ = ["FastPathServer", "fast_path_address"]

log = logging.getLogger("gpubroker.fastpath")
M = TypeVar("M", bound=Message)


def fast_path_address(unix_path: str) -> str:
    return f"{unix_path}.fast"


def _parse(message: type[M], payload: object) -> M:
    """A request's protobuf payload; bytes that are not one are the client's error, not the broker's."""
    if not isinstance(payload, bytes):
        raise InvalidArgument(f"a fast-path payload is bytes, got {type(payload).__name__}")
    try:
        return message.FromString(payload)
    except DecodeError as exc:
        raise InvalidArgument(f"malformed request: {exc}") from None


class FastPathServer:
    """Serves one fast-path socket for the service it fronts."""

    def __init__(self, service: Any, path: str, mode: int, gate: PreAuthGate | None = None) -> None:
        self.service = service
        self.path = path
        self.mode = mode
        self._server: asyncio.AbstractServer | None = None
        self.gate = gate if gate is not None else PreAuthGate(service.config)
        self.idle = IdleSweeper(service.config.connection_idle_seconds, f"fast path {path}")
        self._link_watches: dict[tuple[str, str], tuple[Principal, int]] = {}  # (session, credential) -> watch
        self._tasks: set[asyncio.Task[None]] = set()
        service.sessions.closing_hooks.append(self._session_closing)
        self._ops: dict[str, Callable[[Session, bytes], Awaitable[Any]]] = {
            "launch": self._launch, "memset": self._memset, "copy_d2d": self._copy_d2d,
            "synchronize": self._synchronize, "batch": self._batch, "copy_shared": self._copy_shared,
        }

    async def start(self) -> None:
        path = Path(self.path)
        if path.exists() or path.is_symlink():
            path.unlink()
        # The reader's buffer limit bounds what an unauthenticated peer can make the front hold (it stops reading
        # the socket at twice this); larger authenticated frames still arrive whole through readexactly.
        self._server = await asyncio.start_unix_server(self._serve, path=self.path, limit=self.gate.hello_max_bytes)
        path.chmod(self.mode)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        await self.idle.stop()
        for task in list(self._tasks):
            task.cancel()
        Path(self.path).unlink(missing_ok=True)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        ticket = self.gate.admit(writer.get_extra_info("socket"), self.path)
        if ticket is None:  # past a cap on unauthenticated connections: refused (and audited) at once
            writer.transport.abort()
            return
        auth = self.service.auth
        watch: int | None = None
        idle: Idle | None = None
        principal: Principal | None = None
        try:
            hello = await self._hello(reader, writer, ticket)
            if hello is None:
                return
            session, direct, principal = hello
            ticket.done()
            bind_log_context(tenant=session.tenant, session=session.id)
            if direct:
                try:
                    if await self._hand_to_worker(session, writer):
                        self._watch_links(session, principal)
                        return
                except WorkerCrashed as exc:  # (it died before the front noticed): the client learns why
                    await write_frame_async(writer, [0, 1, exc.to_wire()])
                    return
            # Closed at once when its token is rotated or its tenant removed, and when it sits idle too long.
            watch = auth.revocations.watch(principal, writer.transport.abort)
            idle = self.idle.add(writer.transport.abort)
            await write_frame_async(writer, [0, 0, None])
            while True:
                frame = await read_frame_async(reader)
                idle.busy += 1
                req_id = frame[0] if isinstance(frame, list) and frame else 0
                started, code, method = time.perf_counter(), "OK", "fast/unknown"
                try:
                    if not auth.valid(principal.tenant, principal.credential):
                        raise Unauthenticated("the token that opened this connection was rotated or its tenant "
                                              "removed; reconnect with the current token")
                    if not (isinstance(frame, list) and len(frame) == 3):
                        raise InvalidArgument("a fast-path request is [id, operation, payload]")
                    _, op, payload = frame
                    handler = self._ops.get(op) if isinstance(op, str) else None
                    if handler is None:
                        raise InvalidArgument(f"unknown fast-path operation {op!r}")
                    method = f"fast/{op}"
                    bind_log_context(method=method)
                    session = self.service.sessions.get(session.id, session.tenant)
                    session.check_alive()
                    self.service.admit(session)  # the same concurrent-call limits as gRPC calls
                    try:
                        reply = [req_id, 0, await handler(session, payload)]
                    finally:
                        release_slot(session)
                except GpuBrokerError as exc:
                    code, reply = exc.code, [req_id, 1, exc.to_wire()]
                except Exception as exc:  # a bug: report it, keep the connection
                    log.exception("fast-path %s failed", method)
                    code = "INTERNAL"
                    reply = [req_id, 1, Internal(f"internal broker error: {type(exc).__name__}").to_wire()]
                finally:
                    idle.busy -= 1
                    idle.last_active = time.monotonic()
                observe_rpc(method, code, time.perf_counter() - started)
                await write_frame_async(writer, reply)
                if code == "UNAUTHENTICATED":
                    return
        except (FrameClosed, ConnectionError, ValueError):
            pass
        finally:
            ticket.done()
            if watch is not None and principal is not None:
                auth.revocations.unwatch(principal, watch)
            if idle is not None:
                self.idle.remove(idle)
            writer.close()

    async def _hello(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, ticket: Ticket
                     ) -> tuple[Session, bool, Principal] | None:
        """The first frame: {token, session, direct?}. Same rules and messages as the gRPC front.

        Read under the pre-authentication limits: a header announcing more than ``hello_max_bytes`` is refused
        before a byte of the body is read, and the whole hello must arrive within ``hello_timeout_seconds``.
        """
        limit = self.gate.hello_max_bytes
        try:
            async with asyncio.timeout(self.gate.hello_timeout):
                payload = await read_payload_async(reader, limit)
        except FrameTooLarge as exc:
            ticket.refuse(f"hello of {exc.length} bytes exceeds hello_max_bytes ({limit})")
            writer.write(pack_frame([0, 1, InvalidArgument(
                f"a fast-path hello is at most {limit} bytes, got {exc.length}").to_wire()]))
            return None
        except TimeoutError:
            ticket.refuse(f"no hello within hello_timeout_seconds ({self.service.config.hello_timeout_seconds:g} s)")
            return None
        except (FrameClosed, ConnectionError):
            return None
        auth = self.service.auth
        try:
            try:
                hello = unpack_frame(payload)
            except ValueError:  # (msgpack's unpack errors: a malformed hello is no credentials, as a wrong token)
                hello = None
            token = hello.get("token") if isinstance(hello, dict) else None
            token = token if isinstance(token, str) and token else None
            await auth.tokens.prepare(token)
            metadata = [("authorization", f"Bearer {token}")] if token else []
            try:
                principal = auth.authenticate(metadata, {}, ticket.peer, "fast/hello", penalty_key=f"uid:{ticket.uid}")
            except Unauthenticated:
                await wait_failure_delay()
                raise
            assert isinstance(hello, dict)
            session = self.service.sessions.get(str(hello.get("session", "")), principal.tenant)
            session.check_alive()
        except GpuBrokerError as exc:
            await write_frame_async(writer, [0, 1, exc.to_wire()])
            return None
        return session, hello.get("direct") is True, principal

    def _watch_links(self, session: Session, principal: Principal) -> None:
        """A direct link lives in the worker: at a revocation, the front tells the worker to close the session's
        links (the client reconnects with the current token). One watch per session and credential."""
        key = (session.id, principal.credential)
        if key in self._link_watches:
            return

        def close_links() -> None:
            self._link_watches.pop(key, None)
            task = asyncio.get_running_loop().create_task(self._close_links(session))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

        self._link_watches[key] = (principal, self.service.auth.revocations.watch(principal, close_links))

    async def _close_links(self, session: Session) -> None:
        if session.lost is None:
            with contextlib.suppress(GpuBrokerError):
                await session.worker.call("close_links", session.id)

    async def _session_closing(self, session: Session) -> None:
        for key in [k for k in self._link_watches if k[0] == session.id]:
            principal, watch = self._link_watches.pop(key)
            self.service.auth.revocations.unwatch(principal, watch)

    async def _hand_to_worker(self, session: Session, writer: asyncio.StreamWriter) -> bool:
        """Give the connection to the session's worker, which answers the hello and serves it from then on.

        Reading stops first, so no byte the client sends after the worker's answer is read here. False (the
        front keeps serving the connection) when the worker cannot take it.
        """
        sock = writer.get_extra_info("socket")
        if sock is None:
            return False
        # A stream's transport reads too (typed as the WriteTransport a writer needs)
        transport = cast(asyncio.Transport, writer.transport)
        transport.pause_reading()
        dup = os.dup(sock.fileno())
        try:
            worker = session.check_alive()
            self._lease(session)
            await worker.call_with_fd("attach_direct", session.id, dup)
        except WorkerCrashed:
            transport.resume_reading()
            raise
        except GpuBrokerError as exc:
            log.info("no direct link for session %s: %s", session.id, exc)
            transport.resume_reading()
            return False
        finally:
            os.close(dup)  # the worker holds its own copy now
        writer.transport.abort()  # closes only this process's descriptor: the connection lives on in the worker
        return True

    def _lease(self, session: Session) -> None:
        """The worker's turns on the device for its direct links come from this device's scheduler."""
        worker = session.worker
        if worker.on_control is None:
            lease = TurnLease(self.service.schedulers[session.device], session.tenant, worker.send_control)
            worker.on_control = lease.on_message
            worker.on_death.append(lease.close)

    # -- operations: the gRPC handlers' parameters, the same scheduler turns -------------------------
    async def _launch(self, session: Session, payload: bytes) -> None:
        request = _parse(pb.LaunchKernelRequest, payload)
        await self.service._device(session, "launch", **self.service._launch_params(session, request))

    async def _memset(self, session: Session, payload: bytes) -> None:
        request = _parse(pb.MemsetRequest, payload)
        await self.service._device(session, "memset", **self.service._memset_params(session, request))

    async def _copy_d2d(self, session: Session, payload: bytes) -> None:
        request = _parse(pb.CopyDeviceToDeviceRequest, payload)
        await self.service._device(session, "copy_d2d", **self.service._d2d_params(session, request))

    async def _synchronize(self, session: Session, payload: bytes) -> None:
        request = _parse(pb.StreamRequest, payload)
        await self.service._device(session, "synchronize", stream=self.service._stream(session, request.stream))

    async def _copy_shared(self, session: Session, payload: bytes) -> None:
        await self.service.copy_shared(session, _parse(pb.CopySharedRequest, payload))

    async def _batch(self, session: Session, payload: bytes) -> bytes:
        """A command batch, answered with its BatchAck (the error, if any, rides in the ack)."""
        ack = await self.service.run_batch(session, _parse(pb.CommandBatch, payload))
        return bytes(ack.SerializeToString())
