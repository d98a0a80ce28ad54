"""A batch whose undecoded fields hold a string that is not UTF-8 is the client's error, never a traceback.

The hole (issue 21, a fresh attack on the protocol): the front reads only an outline of an encoded ``Commands``
batch (a kernel's arguments, a library operation's arrays and parameters are stepped over, undecoded) and the
worker decodes the whole batch with ``parse_batch``, which turned msgspec's DecodeError into INVALID_ARGUMENT but
let a string that is not UTF-8 through as a UnicodeDecodeError (msgspec raises that, not a DecodeError, for a
malformed str). The worker logged it as a bug: a 17-line traceback relayed into the broker's log for every such
batch (taking the tenant's share of worker output), and the client got INTERNAL ("UnicodeDecodeError: 'utf-8'
codec can't decode byte 0xc1 ..."). Measured: 15 of 3,000 randomly mutated batches (PoCL).

Now the worker answers INVALID_ARGUMENT ("malformed batch: ..."), as for any other malformed batch, with no
traceback, and the session goes on.
"""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest

from gpubroker.broker.launcher import BrokerProcess, TenantSpec
from gpubroker.v1 import broker_pb2 as pb
from gpubroker.v1 import broker_pb2_grpc as pb_grpc
from gpubroker.wire.commands import Batch, BufferArg, Launch, RunLibrary, ScalarArg, encode

from ._probes import tenant_credentials

NOT_UTF8 = b"\xc1"  # (never valid in UTF-8)


@pytest.fixture(scope="module")
def broker() -> Iterator[BrokerProcess]:
    with BrokerProcess([TenantSpec("alice")], backend="opencl") as proc:
        yield proc


def _malformed(buf: str) -> dict[str, bytes]:
    """Encoded batches, each with a string of its skipped fields made not UTF-8 (same length: still msgpack)."""
    launch = encode(Batch(1, 0, [Launch(kernel="k_1", grid=(1,), block=(1,),
                                        args=[BufferArg((buf, 0)), ScalarArg("int32", b"\0\0\0\0")])]))
    library = encode(Batch(2, 0, [RunLibrary(name="linalg.svd", inputs=[((buf, 0), "float32", (2, 2))],
                                             outputs=[((buf, 0), "float32", (2,))])]))
    return {"a kernel argument's dtype": launch.replace(b"int32", NOT_UTF8 + b"nt32"),
            "a library array's dtype": library.replace(b"float32", NOT_UTF8 + b"loat32", 1)}


def test_a_batch_with_a_string_that_is_not_utf8_is_invalid_argument_and_no_traceback(broker: BrokerProcess) -> None:
    with grpc.secure_channel(broker.target, tenant_credentials(broker, "alice")) as channel:
        stub = pb_grpc.GpuBrokerStub(channel)
        session = stub.OpenSession(pb.OpenSessionRequest(), timeout=60).session
        buf = stub.Allocate(pb.AllocateRequest(session=session, size=4096), timeout=30).handle
        for what, encoded in _malformed(buf).items():
            with pytest.raises(grpc.RpcError) as failed:
                for _ack in stub.Commands(iter([pb.CommandBatch(session=session, batch=1, encoded=encoded)]),
                                          timeout=30):
                    pass
            assert failed.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (
                f"a batch with {what} not UTF-8: {failed.value.code().name} {failed.value.details()}")
            assert "malformed batch" in (failed.value.details() or ""), failed.value.details()
        # The session goes on.
        stub.Heartbeat(pb.SessionRequest(session=session), timeout=30)
        stub.Memset(pb.MemsetRequest(session=session, buffer=pb.BufferRef(handle=buf), size=16, value=1), timeout=30)
    log = broker.log_tail(1 << 20)
    assert "Traceback" not in log, "a malformed batch put a traceback in the broker's log:\n" + log[-3000:]
