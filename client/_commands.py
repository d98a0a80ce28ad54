"""Asynchronous commands: batched on one gRPC stream, acknowledged in order, errors kept for the next sync."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any

import grpc

from gpubroker.v1 import broker_pb2 as pb

from ._errors import GpuBrokerError, Unavailable, error_from_wire
from ._transport import translate_rpc_error

__all__ = ["CommandStream"]

_CLOSE = object()


class CommandStream:
    """Launches, memsets and device copies that return at once.

    Commands collect into a batch, sent when it fills or at a sync point. At most ``window`` batches are
    unacknowledged: a caller that outruns the device blocks (back-pressure), and nothing grows without bound.
    The first failure is kept and raised by ``wait(raise_error=True)``, naming the command, as CUDA reports
    an asynchronous error at the next synchronize.
    """

    def __init__(self, open_stream: Callable[[Iterator[pb.CommandBatch]], Iterator[pb.BatchAck]], session: str,
                 batch_size: int = 256, window: int = 4) -> None:
        self._open_stream = open_stream
        self._session = session
        self.batch_size = batch_size
        self._window = window
        self._pending: list[pb.Command] = []
        self._seq = 0
        self._sent = 0
        self._acked = 0
        self._error: GpuBrokerError | None = None
        self._cond = threading.Condition()
        self._outbox: queue.Queue[Any] | None = None
        self._reader: threading.Thread | None = None

    # -- the caller's side -------------------------------------------------------------------------
    def submit(self, **command: Any) -> int:
        """Queue one command (``launch=``, ``memset=`` or ``copy_d2d=``); returns its sequence number."""
        ((kind, payload),) = command.items()
        return self.submit_one(kind, payload)

    def submit_one(self, kind: str, payload: Any) -> int:
        self._seq += 1
        self._pending.append(pb.Command(seq=self._seq, **{kind: payload}))
        if len(self._pending) >= self.batch_size:
            self.flush()
        return self._seq

    def flush(self) -> None:
        if not self._pending:
            return
        if self._outbox is None:
            self._start()
        assert self._outbox is not None
        with self._cond:
            # Back-pressure: wait until fewer than `window` batches are unacknowledged.
            self._cond.wait_for(lambda: self._sent - self._acked < self._window or self._outbox is None)
            if self._outbox is None:  # the stream died meanwhile: its error is kept; these commands are lost
                self._pending.clear()
                return
            self._sent += 1
            batch = pb.CommandBatch(batch=self._sent, commands=self._pending)
            if self._sent == 1:
                batch.session = self._session
        self._pending = []
        self._outbox.put(batch)

    def wait(self, raise_error: bool) -> None:
        """Flush and wait until every batch is acknowledged; then raise the kept error if asked."""
        self.flush()
        with self._cond:
            self._cond.wait_for(lambda: self._acked >= self._sent or self._outbox is None)
            error = self._error
            if raise_error:
                self._error = None
        if raise_error and error is not None:
            raise error

    def close(self) -> None:
        if self._outbox is not None:
            self._outbox.put(_CLOSE)
        if self._reader is not None:
            self._reader.join(timeout=10)

    # -- the stream --------------------------------------------------------------------------------
    def _start(self) -> None:
        self._outbox = queue.Queue()
        self._sent = self._acked = 0
        outbox = self._outbox

        def requests() -> Iterator[pb.CommandBatch]:
            while True:
                item = outbox.get()
                if item is _CLOSE:
                    return
                yield item

        acks = self._open_stream(requests())
        self._reader = threading.Thread(target=self._read_acks, args=(acks, outbox), name="gpubroker-acks",
                                        daemon=True)
        self._reader.start()

    def _note_ack(self, ack: pb.BatchAck) -> None:
        if ack.HasField("error") and self._error is None:
            e = ack.error
            self._error = error_from_wire(e.code, f"command {e.seq} ({e.command}) failed: {e.message}", None,
                                          {"seq": e.seq, "command": e.command})

    def _read_acks(self, acks: Iterator[pb.BatchAck], outbox: queue.Queue[Any]) -> None:
        try:
            for ack in acks:
                with self._cond:
                    self._acked = max(self._acked, ack.batch)
                    self._note_ack(ack)
                    self._cond.notify_all()
        except grpc.RpcError as err:
            with self._cond:
                if self._error is None:
                    self._error = translate_rpc_error(err)
        except GpuBrokerError as err:  # the fast-path transport reports failures this way
            with self._cond:
                if self._error is None:
                    self._error = err
        finally:
            with self._cond:
                if self._acked < self._sent and self._error is None:
                    # The stream ended with batches unanswered (a transport that ends quietly on a closed
                    # connection, say): their commands may not have run, which the next sync must not hide.
                    self._error = Unavailable(f"the command stream ended with {self._sent - self._acked} batches "
                                              "unacknowledged; their commands may not have run")
                # A new stream starts with the next command; the old one's unacknowledged batches are gone.
                if self._outbox is outbox:
                    self._outbox = None
                self._cond.notify_all()
            outbox.put(_CLOSE)  # ends the request generator, whichever way the stream ended
