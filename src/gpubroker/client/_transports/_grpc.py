"""The gRPC carrier: the same encoded batches inside gRPC's ``Commands`` stream (``CommandBatch.encoded`` one way,
``BatchAck.encoded`` the other), for clients with no link to the broker's workers (another host without a link
port, a VM without vsock, a broker with links off)."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from typing import Any

import grpc

from gpubroker.client._channel import translate_rpc_error
from gpubroker.client._transports._core import BatchingTransport, Lost
from gpubroker.v1 import broker_pb2 as pb
from gpubroker.v1 import broker_pb2_grpc as pb_grpc
from gpubroker.wire.errors import GpuBrokerError, Unavailable

__all__ = ["GrpcStream", "grpc_commands"]

_END = object()


def grpc_commands(stub: pb_grpc.GpuBrokerStub, metadata: tuple[tuple[str, str], ...], session: str, *,
                  max_data: int, timeout: float | None, window: int = 4, batch_size: int = 256) -> BatchingTransport:
    """A transport whose batches go in gRPC's ``Commands`` stream; the stream is opened at the first batch."""
    return BatchingTransport(GrpcStream(stub, metadata, session, max_data=max_data), timeout=timeout, window=window,
                             batch_size=batch_size)


class GrpcStream:
    """The carrier of batches on one ``Commands`` stream per connection; a new stream after a lost one.

    gRPC's Python streams need its own threads: requests are pulled from a queue by gRPC, and a reader moves
    acks into another queue so that waiting for one can time out.
    """

    kind = "grpc"
    codec = ""  # (no codec is negotiated on the Commands stream: copies' bytes go as they are)

    def __init__(self, stub: pb_grpc.GpuBrokerStub, metadata: tuple[tuple[str, str], ...], session: str, *,
                 max_data: int) -> None:
        self.max_data = max_data
        self._stub = stub
        self._metadata = metadata
        self._session = session
        self._outbox: queue.SimpleQueue[Any] | None = None
        self._acks: queue.SimpleQueue[Any] | None = None
        self._call: Any = None
        self._first = True
        self._ended: GpuBrokerError | None = None  # the status the last stream ended with

    def open(self) -> None:
        outbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        acks: queue.SimpleQueue[Any] = queue.SimpleQueue()

        def requests() -> Iterator[pb.CommandBatch]:
            while (item := outbox.get()) is not _END:
                yield item

        call = self._stub.Commands(requests(), metadata=self._metadata)

        def read() -> None:
            try:
                for ack in call:
                    acks.put(ack.encoded)
                acks.put(Lost("the broker ended the command stream"))
            except grpc.RpcError as err:
                acks.put(translate_rpc_error(err))
            finally:
                outbox.put(_END)  # ends the request generator, whichever way the stream ended

        threading.Thread(target=read, name="gpubroker-acks", daemon=True).start()
        self._outbox, self._acks, self._call, self._first = outbox, acks, call, True

    def send(self, payload: bytes) -> None:
        assert self._outbox is not None
        message = pb.CommandBatch(encoded=payload)
        if self._first:  # the stream names its session once
            message.session = self._session
            self._first = False
        self._outbox.put(message)

    def receive(self, timeout: float | None, in_flight: int, into: memoryview | None = None) -> bytes | bytearray:
        assert self._acks is not None
        try:
            item = self._acks.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError from None
        if isinstance(item, GpuBrokerError):
            self._ended = item
            raise Lost(item.message)
        if isinstance(item, Lost):
            self._ended = None
            raise item
        return bytes(item)

    def arrived(self) -> bytes | bytearray | None:
        return None  # (the ack reader thread's queue: read by receive alone, which also tells why a stream ended)

    @property
    def sees_acks(self) -> bool:
        return False

    def shut(self) -> None:
        if self._outbox is not None:
            self._outbox.put(_END)
        if self._call is not None:
            self._call.cancel()
        self._outbox = self._acks = self._call = None

    def hung_up(self) -> bool:
        return False  # (not asked of a stream: one that ended is seen at its next ack, by its status)

    def why_lost(self, reason: str) -> GpuBrokerError:
        # The stream's own status says why (the session ended, the worker died, a revoked token).
        ended, self._ended = self._ended, None
        if ended is not None:
            return ended
        return Unavailable(f"grpc transport lost: {reason}")
