"""A compile error whose log is longer than gRPC's metadata limit reaches the client as a misleading RESOURCE_EXHAUSTED.

The hole (issue 24's rich error status, attacked): ``abort_with`` (front/_status.py) sends a refused call's error
in two trailers: ``gpubroker-error-bin`` (the WireError, its details WHOLE: a CompileError's ``log`` may be up to
``MAX_DETAIL_TEXT``, 256 KiB) and ``grpc-status-details-bin`` (bounded to 3 KiB by ``rich_status``), and the status
message carries the log's first lines, each as long as the compiler wrote it. Only the rich Status is bounded: the
client's gRPC (every gRPC library; grpcio's hard limit is 16 KiB of metadata) then refuses the whole response.

The attack: a tenant (or just a real kernel with many warnings) compiles OpenCL C whose build log passes 16 KiB
(N ``#warning`` lines and one ``#error``; or a single 20000-character line, which the message's head repeats).
Measured: ``compile_kernel`` raised ``ResourceExhausted('Stream removed (received metadata size exceeds hard limit
(value length 59597 vs. 16384))')`` over every transport (LoadModule is a typed RPC): not a CompileError, no log,
a code that tells the user to wait or free something. The same holds for every other gRPC client (grpcurl,
other languages), which the rich status was written for. Nobody else is harmed, but a plain, legitimate input
(a big kernel's warnings) gets no clear error.

Suggested fix: bound the trailers as a whole, not only the rich Status: cut the ``log`` detail of the Python
client's trailer (and the message's head, by characters, not only by lines) so that message + trailers stay within
~8 KiB, saying in the message that the log was cut (or carry a long log in the response body: an Ack, not
metadata).

The fix (front/_error_details.py ``error_trailers``): the message and both trailers are bounded together, to 6 KiB
for a client that says nothing (the message cut to 2 KiB, the rich status only where it fits, our trailer's
longest texts cut in the middle, saying so); our client raises gRPC's limit and asks for 512 KiB in each call's
metadata (``gpubroker-error-budget``), so its compile logs arrive whole.
"""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest

from gpubroker.broker.launcher import BrokerProcess, TenantSpec
from gpubroker.client import CompileError, connect
from gpubroker.v1 import broker_pb2 as pb
from gpubroker.v1 import broker_pb2_grpc as pb_grpc


@pytest.fixture(scope="module")
def broker() -> Iterator[BrokerProcess]:
    with BrokerProcess([TenantSpec("alice"), TenantSpec("bob")], backend="opencl", settings={}) as proc:
        yield proc


def _source(warnings: int, line: int) -> str:
    return "".join(f"#warning {'W' * line}{i}\n" for i in range(warnings)) + "#error stop\n__kernel void k(){}\n"


@pytest.mark.parametrize("transport", ["grpc", "ring"])
@pytest.mark.parametrize(("warnings", "line"), [(200, 200), (1, 20000)], ids=["many-lines", "one-long-line"])
def test_a_long_compile_log_is_a_compile_error(broker: BrokerProcess, transport: str, warnings: int,
                                               line: int) -> None:
    with connect(broker.target, token=broker.tokens["alice"], transport=transport) as gpu:
        with pytest.raises(CompileError) as raised:  # measured: ResourceExhausted "received metadata size exceeds"
            gpu.compile_kernel(_source(warnings, line), "k")
        assert "stop" in raised.value.log or "cut" in raised.value.message
        gpu.allocate_memory(64)  # the session goes on


def test_another_grpc_client_gets_the_compile_error_within_its_limits(broker: BrokerProcess) -> None:
    """A client that is not ours (no error budget asked, gRPC's default 8 KiB limit): the same compile error arrives
    as its code and a cut message, with the standard rich status, not as a refused response."""
    from grpc_status import rpc_status

    auth = (("authorization", f"Bearer {broker.tokens['bob']}"),)
    with grpc.secure_channel(broker.target, grpc.local_channel_credentials(grpc.LocalConnectionType.UDS)) as channel:
        stub = pb_grpc.GpuBrokerStub(channel)
        session = stub.OpenSession(pb.OpenSessionRequest(client_name="grpcurl-like"), metadata=auth).session
        try:
            with pytest.raises(grpc.RpcError) as refused:
                stub.LoadModule(pb.LoadModuleRequest(session=session, format=pb.MODULE_FORMAT_OPENCL_C,
                                                     image=_source(200, 200).encode()), metadata=auth)
            assert refused.value.code() != grpc.StatusCode.RESOURCE_EXHAUSTED, refused.value.details()
            status = rpc_status.from_call(refused.value)
            assert status is not None and status.code == refused.value.code().value[0]
        finally:
            stub.CloseSession(pb.CloseSessionRequest(session=session), metadata=auth)
