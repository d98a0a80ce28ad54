"""Open hole (issue 21, round 10): decoding a tenant's torch batches blocks the front's event loop, uncharged.

Every batch on gRPC's ``Commands`` stream is decoded by the front, on its event loop, before it goes to the worker
(``_service.py`` ``_batch``: ``parse_batch(batch.encoded)``), to size its reply and check it. A TorchOp is the
densest thing to decode the protocol has: up to 1024 output metadata of 32 dims and 32 strides each, 64 keyword
arguments, 64 positional ones (lists of 1024 numbers, tensor lists of 1024 handles). msgspec takes about 100 ms of
one CPU for a 4 MiB batch of them (25 ns a byte; a Write's bytes decode at memcpy speed), all of it in the
loop that relays every tenant's gRPC connections, link hellos and segment registrations.

A hostile client streams 3 MiB batches of such TorchOps whose operator is not even on the allowlist (the worker
refuses the first command at once; the front has decoded them all by then). Measured on PoCL (2 cores): the
front used 1.54 CPU-seconds in 2.65 s for one tenant's stream (58 % of a core, 85 ms per batch, charged to
nobody), and another tenant's Heartbeat went from 2.4 ms to 136 ms (p95). The control, the same stream of 3 MiB
batches each one Write of 3 MiB (to no buffer): 153 batches in the same 4 s, 9x the bytes, and the Heartbeat at
22 ms (p95). Nothing bounds the rate:
``max_read_ahead_bytes_per_tenant`` bounds the bytes buffered, not the decoding, and the worker keeps up (a
refused batch costs it one decode of its own).

Not torch's alone: a 3 MiB batch of Launches with 4000 BufferArgs each decodes in ~45 ms (torch's densest: ~85
ms); torch's metadata is the densest form the protocol has.

Fix: decode batches off the event loop (a thread, charged to the tenant like its worker's CPU), or bound a
tenant's decode time per second, or make the worker the only decoder of torch commands (the front only needs
the reply size, which a cheap prefix scan of the command tags gives).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from gpubroker.broker.launcher import BrokerProcess, TenantSpec
from gpubroker.client import connect
from gpubroker.client._remote import RemoteGpu
from gpubroker.v1 import broker_pb2 as pb
from gpubroker.wire.commands import Batch, encode
from gpubroker.wire.torch import TorchOp

FLOOD_SECONDS = 4.0


@pytest.fixture(scope="module")
def broker() -> Iterator[BrokerProcess]:
    with BrokerProcess([TenantSpec("mallory"), TenantSpec("victim")], backend="opencl") as b:
        yield b


def _heartbeat_p95(gpu: RemoteGpu, seconds: float) -> float:
    times: list[float] = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        start = time.perf_counter()
        gpu._stub.Heartbeat(pb.SessionRequest(session=gpu.session), metadata=gpu._metadata, timeout=30)
        times.append(time.perf_counter() - start)
        time.sleep(0.02)
    times.sort()
    return times[int(0.95 * (len(times) - 1))]


def test_torch_batch_decoding_does_not_stall_other_tenants(broker: BrokerProcess) -> None:
    dense = TorchOp("aten::not_an_operator.default", [None] * 64, {str(i): None for i in range(64)}, [None] * 1024,
                    [("float32", (0,) * 32, (0,) * 32, 0)] * 1024)
    count = max(1, (3 << 20) // len(encode(dense)))
    payload = encode(Batch(1, 0, [dense] * count))
    with connect(broker.target, token=broker.tokens["victim"], timeout=60) as victim, \
            connect(broker.target, token=broker.tokens["mallory"], timeout=60, transport="grpc") as gpu:
        assert isinstance(victim, RemoteGpu) and isinstance(gpu, RemoteGpu)
        baseline = _heartbeat_p95(victim, 1.0)
        stop = threading.Event()

        def requests() -> Iterator[pb.CommandBatch]:
            first = True
            while not stop.is_set():
                message = pb.CommandBatch(encoded=payload)
                if first:
                    message.session, first = gpu.session, False
                yield message

        call = gpu._stub.Commands(requests(), metadata=gpu._metadata)
        acked = [0]

        def read() -> None:
            try:
                for _ in call:
                    acked[0] += 1
            except Exception:  # (cancelled at the end)
                pass

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        try:
            flooded = _heartbeat_p95(victim, FLOOD_SECONDS)
        finally:
            stop.set()
            call.cancel()
            reader.join(10)
    print(f"\nvictim's Heartbeat p95: {baseline * 1000:.1f} ms alone, {flooded * 1000:.1f} ms while mallory streamed "
          f"{acked[0]} batches of {len(payload) / (1 << 20):.1f} MiB of TorchOps")
    assert acked[0] > 0, "mallory's batches were not taken at all"
    assert flooded < 0.05, (f"another tenant's Heartbeat took {flooded * 1000:.0f} ms (p95) while mallory's torch "
                            "batches were decoded on the front's event loop")
