"""The gRPC ``Commands`` stream reads ahead of its acks (a client's window of batches received, decoded and queued
behind the running one) and still runs them in order: a failed batch is acknowledged and the next ones run; a
message that is no batch ends the stream after the acks before it, and nothing after it runs."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import msgspec
import pytest

from gpubroker.broker.launcher import BrokerProcess
from gpubroker.v1 import broker_pb2 as pb
from gpubroker.v1 import broker_pb2_grpc as pb_grpc
from gpubroker.wire.commands import (
    MAX_FRONT_COMMANDS,
    Allocate,
    Batch,
    Free,
    Memset,
    Read,
    decode_ack,
    encode,
    new_handle,
)


def _channel(broker: BrokerProcess) -> grpc.Channel:
    credentials = grpc.composite_channel_credentials(grpc.local_channel_credentials(grpc.LocalConnectionType.UDS),
                                                     grpc.access_token_call_credentials(broker.tokens["alice"]))
    return grpc.secure_channel(broker.target, credentials)


def _requests(session: str, batches: list[Batch | bytes]) -> Iterator[pb.CommandBatch]:
    for k, batch in enumerate(batches):
        yield pb.CommandBatch(session=session if k == 0 else "", batch=k + 1,
                              encoded=batch if isinstance(batch, bytes) else encode(batch))


def test_batches_sent_at_once_run_in_order_and_a_bad_one_ends_the_stream(broker: BrokerProcess) -> None:
    with _channel(broker) as channel:
        stub = pb_grpc.GpuBrokerStub(channel)
        session = stub.OpenSession(pb.OpenSessionRequest(device=0), timeout=60).session
        buf = new_handle("buf")
        batches: list[Batch | bytes] = [
            Batch(1, 0, [Allocate(buf, 4096), Memset((buf, 0), 1, -1)]),
            Batch(2, 2, [Read((buf, 0), 4090, 8)]),  # past the end: its error in its ack
            Batch(3, 3, [Memset((buf, 0), 2, 16)]),  # runs after the failed one, after it in order
            Batch(4, 4, [Read((buf, 0), 0, 32)]),
            b"\x93\x01",  # no batch: the stream ends here
            Batch(6, 6, [Free(buf)]),  # read ahead perhaps, but never run
        ]
        acks = []
        with pytest.raises(grpc.RpcError) as info:
            for ack in stub.Commands(_requests(session, batches), timeout=60):
                acks.append(decode_ack(ack.encoded))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert [(a.id, a.done) for a in acks] == [(1, 2), (2, 0), (3, 1), (4, 1)]
        assert acks[1].error is not None and acks[1].error.code == "OUT_OF_RANGE"
        assert acks[3].result == bytes([2] * 16 + [1] * 16)
        again = list(stub.Commands(_requests(session, [Batch(1, 0, [Read((buf, 0), 0, 4)]),
                                                       Batch(2, 1, [Free(buf)])]), timeout=60))
        first, second = (decode_ack(a.encoded) for a in again)
        assert first.result == bytes([2] * 4) and (second.done, second.error) == (1, None)  # still there until now
        stub.CloseSession(pb.SessionRequest(session=session), timeout=60)


def test_a_batch_malformed_where_the_front_does_not_read_is_refused_by_the_worker(broker: BrokerProcess) -> None:
    """The front decodes only an outline of a batch (a kernel's arguments stepped over); the worker decodes all of
    it and refuses one malformed there: the stream ends as for a batch the front refuses, after the acks before it,
    and the session (its worker) goes on."""
    malformed = msgspec.msgpack.encode([2, 1, [["launch", "k1", [1], [1], [{"not": "an argument"}], 0, ""]]])
    too_many = encode(Batch(2, 1, [Free("b1")] * (MAX_FRONT_COMMANDS + 1)))
    with _channel(broker) as channel:
        stub = pb_grpc.GpuBrokerStub(channel)
        session = stub.OpenSession(pb.OpenSessionRequest(device=0), timeout=60).session
        buf = new_handle("buf")
        for bad, why in ((malformed, "malformed batch"), (too_many, f"at most {MAX_FRONT_COMMANDS} commands")):
            acks = []
            with pytest.raises(grpc.RpcError) as info:
                for ack in stub.Commands(_requests(session, [Batch(1, 0, [Allocate(buf, 64)]), bad]), timeout=60):
                    acks.append(decode_ack(ack.encoded))
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and why in (info.value.details() or "")
            assert [(a.id, a.done, a.error) for a in acks] == [(1, 1, None)]
            after = [decode_ack(a.encoded) for a in stub.Commands(_requests(session, [Batch(1, 0, [Free(buf)])]),
                                                                  timeout=60)]
            assert [(a.done, a.error) for a in after] == [(1, None)]
        stub.CloseSession(pb.SessionRequest(session=session), timeout=60)
