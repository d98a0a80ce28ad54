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
import logging
import os
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

from google.protobuf.message import DecodeError, Message

from gpubroker.client import GpuBrokerError, Internal, InvalidArgument, Unauthenticated, WorkerCrashed
from gpubroker.v1 import broker_pb2 as pb

from ..logs import bind_log_context
from ..scheduler import TurnLease
from ..sessions import Session
from ..workers._frames import FrameClosed, read_frame_async, write_frame_async
from ._metrics import observe_rpc
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

    def __init__(self, service: Any, path: str, mode: int) -> None:
        self.service = service
        self.path = path
        self.mode = mode
        self._server: asyncio.AbstractServer | None = None
        self._ops: dict[str, Callable[[Session, bytes], Awaitable[Any]]] = {
            "launch": self._launch, "memset": self._memset, "copy_d2d": self._copy_d2d,
            "synchronize": self._synchronize, "batch": self._batch, "copy_shared": self._copy_shared,
        }

    async def start(self) -> None:
        path = Path(self.path)
        if path.exists() or path.is_symlink():
            path.unlink()
        self._server = await asyncio.start_unix_server(self._serve, path=self.path, limit=1 << 20)
        path.chmod(self.mode)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        Path(self.path).unlink(missing_ok=True)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            hello = await self._hello(reader, writer)
            if hello is None:
                return
            session, direct = hello
            bind_log_context(tenant=session.tenant, session=session.id)
            if direct:
                try:
                    if await self._hand_to_worker(session, writer):
                        return
                except WorkerCrashed as exc:  # (it died before the front noticed): the client learns why
                    await write_frame_async(writer, [0, 1, exc.to_wire()])
                    return
            await write_frame_async(writer, [0, 0, None])
            while True:
                frame = await read_frame_async(reader)
                req_id = frame[0] if isinstance(frame, list) and frame else 0
                started, code, method = time.perf_counter(), "OK", "fast/unknown"
                try:
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
                observe_rpc(method, code, time.perf_counter() - started)
                await write_frame_async(writer, reply)
        except (FrameClosed, ConnectionError, ValueError):
            pass
        finally:
            writer.close()

    async def _hello(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
                     ) -> tuple[Session, bool] | None:
        """The first frame: {token, session, direct?}. Same rules and messages as the gRPC front."""
        hello = await read_frame_async(reader)
        try:
            if not isinstance(hello, dict):
                raise Unauthenticated("missing or invalid bearer token")
            token = hello.get("token")
            tenant = self.service.auth.tokens.tenant_for(token if isinstance(token, str) else None)
            session = self.service.sessions.get(str(hello.get("session", "")), tenant)
            session.check_alive()
        except GpuBrokerError as exc:
            await write_frame_async(writer, [0, 1, exc.to_wire()])
            return None
        return session, hello.get("direct") is True

    async def _hand_to_worker(self, session: Session, writer: asyncio.StreamWriter) -> bool:
        """Give the connection to the session's worker, which answers the hello and serves it from then on.

        Reading stops first, so no byte the client sends after the worker's answer is read here. False (the
        front keeps serving the connection) when the worker cannot take it.
        """
        sock = writer.get_extra_info("socket")
        if sock is None:
            return False
        writer.transport.pause_reading()
        dup = os.dup(sock.fileno())
        try:
            worker = session.check_alive()
            self._lease(session)
            await worker.call_with_fd("attach_direct", session.id, dup)
        except WorkerCrashed:
            writer.transport.resume_reading()
            raise
        except GpuBrokerError as exc:
            log.info("no direct link for session %s: %s", session.id, exc)
            writer.transport.resume_reading()
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
