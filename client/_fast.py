"""The client's end of the same-host fast path: msgpack frames on "<socket>.fast", one call at a time.

A connection that asks for ``direct`` is handed by the front to the session's worker: its calls then carry the
worker's own parameters (plain msgpack, named by the client's handles) and never pass through the front.
"""

from __future__ import annotations

import itertools
import select
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from ._errors import DeadlineExceeded, GpuBrokerError, Unavailable, error_from_wire
from ._frames import recv_frame, send_frame

__all__ = ["DirectCommands", "FastChannel", "fast_command_stream", "peer_hung_up"]

_RDHUP = getattr(select, "POLLRDHUP", 0x2000)  # the peer shut its end (Linux)
_QUIET = 1.0  # seconds unused after which a connection is checked for a hang-up before a call


def peer_hung_up(sock: socket.socket) -> bool:
    """Whether the broker closed this idle connection (its idle timeout, a revoked token): nothing is waiting to
    be read on a connection between calls, so a hang-up there means it is gone, and a call not yet sent can go
    another way instead of failing. (A zero-timeout poll: a recv would wait out the socket's timeout first.)"""
    if sock.fileno() == -1:
        return True
    poller = select.poll()
    poller.register(sock, select.POLLIN | _RDHUP)
    return any(events & (_RDHUP | select.POLLHUP | select.POLLERR | select.POLLNVAL) for _, events in poller.poll(0))


class FastChannel:
    """A blocking connection that carries synchronous calls for one session."""

    def __init__(self, path: str, token: str, session: str, timeout: float | None, direct: bool = False) -> None:
        self._send, self._recv = send_frame, recv_frame
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.settimeout(timeout)
        self._sock_timeout = timeout
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._last = time.monotonic()  # the last answer: a connection in use is not polled for a hang-up
        try:
            self._sock.connect(path)
            hello: dict[str, Any] = {"token": token, "session": session}
            if direct:
                hello["direct"] = True
            self._send(self._sock, hello)
            _, status, result = self._recv(self._sock)
        except (OSError, EOFError) as exc:  # (closed unanswered: refused before authentication, at a cap)
            self._sock.close()
            raise Unavailable(f"no fast path at {path}: {exc}") from None
        if status != 0:
            self._sock.close()
            raise _error(result)
        # Whether the worker answered (a direct link) or the front did (it may decline: an older broker).
        self.direct = isinstance(result, dict) and result.get("direct") is True

    def call(self, op: str, payload: bytes | dict[str, Any]) -> Any:
        with self._lock:
            req_id = next(self._ids)
            try:
                self._send(self._sock, [req_id, op, payload])
            except OSError as exc:
                # The broker closed the connection before this request went out (a revoked token, idleness):
                # nothing ran, so the caller may send it another way.
                self._sock.close()
                raise Unavailable(f"fast path closed: {exc}", sent=False) from None
            try:
                got_id, status, result = self._recv(self._sock)
            except TimeoutError:
                # Its answer may still come, and would be read as the next call's: this connection is done.
                self._sock.close()
                raise DeadlineExceeded(f"no answer on the fast path within {self._sock_timeout:g} s") from None
            except (OSError, EOFError) as exc:
                self._sock.close()
                raise Unavailable(f"fast path lost: {exc}") from None
        self._last = time.monotonic()
        if got_id != req_id:
            raise GpuBrokerError(f"fast path out of step: sent {req_id}, got {got_id}")
        if status != 0:
            raise _error(result)
        return result

    @property
    def closed(self) -> bool:
        """Whether the connection is gone (closed, lost, or dropped out of step by a call past its deadline)."""
        return self._sock.fileno() == -1

    def hung_up(self) -> bool:
        """Whether the broker closed it between calls (then it is closed here too). Only a connection unused for
        a while is asked (a poll costs a system call): the broker closes idle ones, and a revoked one in use
        fails its next call anyway."""
        if time.monotonic() - self._last < _QUIET:
            return self._sock.fileno() == -1
        if peer_hung_up(self._sock):
            self._sock.close()
            return True
        return False

    def close(self) -> None:
        self._sock.close()


def _error(wire: dict[str, Any]) -> GpuBrokerError:
    return error_from_wire(wire["code"], wire["message"], wire.get("type"), wire.get("details"))


def fast_command_stream(path: str, token: str, session: str, timeout: float | None
                        ) -> Callable[[Iterator[Any]], Iterator[Any]]:
    """CommandStream's transport over a fast-path connection of its own (protobuf batches, served by the front).

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


_FIRST_BATCH = 16


class DirectCommands:
    """Asynchronous commands on a direct link to the worker, with no threads: the caller's own thread sends.

    The worker runs batches while the caller builds the next; acknowledgements wait in the socket until the
    window is full or a sync point reads them. A sync rides in the last batch, so launch + sync is one round
    trip. The first failure is kept and raised by ``wait(raise_error=True)``, naming the command.
    """

    def __init__(self, connect: Callable[[], FastChannel], batch_size: int = 256, window: int = 4) -> None:
        self._connect = connect
        self.batch_size = batch_size
        self._window = window
        self._channel: FastChannel | None = None
        self._pending: list[Any] = []
        self._seq = self._sent = self._acked = 0
        self._error: GpuBrokerError | None = None

    def submit_one(self, kind: str, payload: Any) -> int:
        self._seq += 1
        self._pending.append([self._seq, kind, payload])
        # The first batch of a burst goes out small, so the device starts while the rest is being built.
        if len(self._pending) >= (self.batch_size if self._sent > self._acked else _FIRST_BATCH):
            self.flush()
        return self._seq

    def flush(self) -> None:
        if not self._pending:
            return
        if self._channel is None:
            self._channel = self._connect()  # a new link after a lost one: the front says if the session is gone
            self._sent = self._acked = 0
        while self._sent - self._acked >= self._window and self._channel is not None:
            self._read_ack()  # back-pressure: the worker is `window` batches behind
        pending, self._pending = self._pending, []
        if self._channel is None:
            return  # the link died while we waited: its error is kept; these commands are lost
        self._sent += 1
        try:
            send_frame(self._channel._sock, [self._sent, "batch", {"commands": pending}])
        except OSError as exc:
            self._lost(exc)

    def wait(self, raise_error: bool) -> None:
        """Flush and read every acknowledgement; then raise the kept error if asked."""
        self.flush()
        while self._channel is not None and self._acked < self._sent:
            self._read_ack()
        error = self._error
        if raise_error and error is not None:
            self._error = None
            raise error

    def close(self) -> None:
        if self._channel is not None:
            self._channel.close()
            self._channel = None

    def _read_ack(self) -> None:
        assert self._channel is not None
        try:
            number, status, result = recv_frame(self._channel._sock)
        except (EOFError, OSError) as exc:
            self._lost(exc)
            return
        self._acked = number
        failed = _error(result) if status != 0 else None
        if status == 0 and result["error"] is not None:
            e = result["error"]
            failed = error_from_wire(e["code"], f"command {e['seq']} ({e['command']}) failed: {e['message']}",
                                     e.get("type"), {"seq": e["seq"], "command": e["command"]})
        if failed is not None and self._error is None:
            self._error = failed

    def _lost(self, exc: BaseException) -> None:
        self.close()
        if self._error is None:
            self._error = self._why_lost(exc)

    def _why_lost(self, exc: BaseException) -> GpuBrokerError:
        """The front knows why a link dropped (the session's worker died, the session ended): ask it by opening
        another; a broker that is gone answers Unavailable itself."""
        try:
            self._connect().close()
        except GpuBrokerError as reason:
            return reason
        except (OSError, EOFError, ValueError):
            pass  # no answer at all
        return Unavailable(f"direct link lost: {exc}")
