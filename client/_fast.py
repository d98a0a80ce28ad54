"""The client's end of the same-host fast path: msgpack frames on "<socket>.fast", one call at a time."""

from __future__ import annotations

import itertools
import socket
import threading
from collections.abc import Callable, Iterator
from typing import Any

from ._errors import GpuBrokerError, Unavailable, error_from_wire
from ._frames import recv_frame, send_frame

__all__ = ["FastChannel", "fast_command_stream"]


class FastChannel:
    """A blocking connection that carries synchronous calls for one session."""

    def __init__(self, path: str, token: str, session: str, timeout: float | None) -> None:
        self._send, self._recv = send_frame, recv_frame
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.settimeout(timeout)
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        try:
            self._sock.connect(path)
            self._send(self._sock, {"token": token, "session": session})
            _, status, result = self._recv(self._sock)
        except OSError as exc:
            self._sock.close()
            raise Unavailable(f"no fast path at {path}: {exc}") from None
        if status != 0:
            self._sock.close()
            raise _error(result)

    def call(self, op: str, payload: bytes) -> Any:
        with self._lock:
            req_id = next(self._ids)
            try:
                self._send(self._sock, [req_id, op, payload])
                got_id, status, result = self._recv(self._sock)
            except (OSError, EOFError) as exc:
                raise Unavailable(f"fast path lost: {exc}") from None
        if got_id != req_id:
            raise GpuBrokerError(f"fast path out of step: sent {req_id}, got {got_id}")
        if status != 0:
            raise _error(result)
        return result

    def close(self) -> None:
        self._sock.close()


def _error(wire: dict[str, Any]) -> GpuBrokerError:
    return error_from_wire(wire["code"], wire["message"], wire.get("type"), wire.get("details"))


def fast_command_stream(path: str, token: str, session: str, timeout: float | None
                        ) -> Callable[[Iterator[Any]], Iterator[Any]]:
    """CommandStream's transport over a fast-path connection of its own.

    Batches are written as they come and acknowledged in order by a reader, so the client builds the next
    batch while the broker runs the last (the CommandStream's window bounds how far it runs ahead).
    """
    from gpubroker.v1 import broker_pb2 as pb

    def open_stream(batches: Iterator[Any]) -> Iterator[Any]:
        channel = FastChannel(path, token, session, None)  # acks may be a long kernel away: no timeout

        def pump() -> None:
            try:
                for i, batch in enumerate(batches, 1):
                    send_frame(channel._sock, [i, "batch", batch.SerializeToString()])
                channel._sock.shutdown(socket.SHUT_WR)
            except OSError:
                pass  # the reader sees the connection end and reports it

        threading.Thread(target=pump, name="gpubroker-fast-batches", daemon=True).start()

        def acks() -> Iterator[Any]:
            try:
                while True:
                    try:
                        _, status, result = recv_frame(channel._sock)
                    except (EOFError, OSError):
                        return
                    if status != 0:
                        raise _error(result)
                    yield pb.BatchAck.FromString(result)
            finally:
                channel.close()

        return acks()

    return open_stream
