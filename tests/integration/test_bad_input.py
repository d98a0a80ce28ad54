"""Every bad input gets a clear status and message, and the broker stays healthy afterwards."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import numpy as np
import pytest

from gpubroker.broker import samples
from gpubroker.broker.launcher import BrokerProcess
from gpubroker.client import (
    ArgumentTypeError,
    CompileError,
    InvalidArgument,
    NotFound,
    OutOfRange,
    RemoteGpu,
    ResourceExhausted,
    Unauthenticated,
    connect,
    list_devices,
)
from gpubroker.v1 import broker_pb2 as pb
from gpubroker.v1 import broker_pb2_grpc as pb_grpc

from ..conftest import TRANSPORTS, OpenGpu


@pytest.fixture(scope="module", params=TRANSPORTS)
def gpu(open_gpu: OpenGpu, request: pytest.FixtureRequest) -> Iterator[RemoteGpu]:
    with open_gpu("bob", request.param) as g:
        yield g


@pytest.fixture(scope="module")
def saxpy(gpu: RemoteGpu):
    return gpu.compile_kernel(samples.source(gpu.device_info().backend), "saxpy")


@pytest.fixture(scope="module")
def stub(broker: BrokerProcess) -> Iterator[pb_grpc.GpuBrokerStub]:
    with grpc.secure_channel(broker.target, grpc.local_channel_credentials(grpc.LocalConnectionType.UDS)) as channel:
        yield pb_grpc.GpuBrokerStub(channel)


def _status(call, *args, **kwargs) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        call(*args, **kwargs)
    return info.value.code(), info.value.details()


def test_missing_and_wrong_token_get_the_same_unauthenticated(broker: BrokerProcess, stub) -> None:
    missing = _status(stub.ListDevices, pb.ListDevicesRequest())
    wrong = _status(stub.ListDevices, pb.ListDevicesRequest(), metadata=(("authorization", "Bearer gpb_x_y"),))
    forged_id = broker.tokens["alice"].rsplit("_", 1)[0] + "_" + "A" * 43
    forged = _status(stub.ListDevices, pb.ListDevicesRequest(), metadata=(("authorization", f"Bearer {forged_id}"),))
    assert missing[0] == wrong[0] == forged[0] == grpc.StatusCode.UNAUTHENTICATED
    assert missing[1] == wrong[1] == forged[1]
    with pytest.raises(Unauthenticated):
        connect(broker.target, token="gpb_nope_nope")


def test_unknown_session_and_handles_are_not_found(gpu: RemoteGpu, stub, broker: BrokerProcess) -> None:
    auth = (("authorization", f"Bearer {broker.tokens['bob']}"),)
    code, _ = _status(stub.Allocate, pb.AllocateRequest(session="ses_invented", size=8), metadata=auth)
    assert code == grpc.StatusCode.NOT_FOUND
    from gpubroker.client import Buffer, Kernel, Stream

    with pytest.raises(NotFound):
        gpu.free_memory(Buffer("buf_invented", 8))
    with pytest.raises(NotFound):
        gpu.execute_kernel(Kernel("krn_invented", "x"), 1, 1, [])
    with pytest.raises(NotFound):
        gpu.synchronize(Stream("str_invented"))


def test_a_device_the_broker_lacks_says_which_it_has(broker: BrokerProcess) -> None:
    count = len(list_devices(broker.target, broker.tokens["bob"]))
    with pytest.raises(NotFound, match=rf"no device {count + 6}: this broker serves {count} \(device=0 to "
                                       rf"{count - 1}; list_devices\(\)"):
        connect(broker.target, token=broker.tokens["bob"], device=count + 6)


def test_free_twice(gpu: RemoteGpu) -> None:
    buf = gpu.allocate_memory(128)
    gpu.free_memory(buf)
    with pytest.raises(NotFound, match="no buf"):
        gpu.free_memory(buf)


def test_copies_past_the_end_or_with_negative_offsets(gpu: RemoteGpu) -> None:
    buf = gpu.allocate_memory(100)
    with pytest.raises(OutOfRange, match="past the end"):
        gpu.copy_h2d(b"x" * 101, buf)
    with pytest.raises(OutOfRange):
        gpu.copy_h2d(b"x" * 10, buf, offset=95)
    with pytest.raises(OutOfRange):
        gpu.copy_d2h(buf, bytearray(10), offset=91)
    with pytest.raises(InvalidArgument, match="offset"):
        gpu.copy_h2d(b"x", buf, offset=-1)
    with pytest.raises(InvalidArgument):
        gpu.copy_d2h(buf, bytearray(1), offset=-5)
    with pytest.raises(OutOfRange):
        gpu.copy_d2d(buf, buf, 60, src_offset=0, dst_offset=50)
    with pytest.raises(OutOfRange):
        gpu.memset(buf, 1, size=200)
    gpu.free_memory(buf)


def test_bad_allocations(gpu: RemoteGpu) -> None:
    with pytest.raises(InvalidArgument, match="> 0"):
        gpu.allocate_memory(0)
    with pytest.raises(InvalidArgument):
        gpu.allocate_memory(-5)
    with pytest.raises(ResourceExhausted, match="quota"):
        gpu.allocate_memory(1 << 40)


def test_allocation_beyond_the_device(broker: BrokerProcess) -> None:
    # alice's quota (1 TiB) is larger than the device, so the device's own limit answers.
    with connect(broker.target, token=broker.tokens["alice"]) as g:
        with pytest.raises(ResourceExhausted) as info:
            g.allocate_memory(g.device_info().total_memory + 1)
        assert "quota" not in info.value.message
        assert g.device_info().memory_used == 0 or g.device_info().memory_used is not None


def test_compile_error_returns_the_log(gpu: RemoteGpu) -> None:
    with pytest.raises(CompileError) as info:
        gpu.compile_kernel("this is not a kernel { at all", "nothing")
    assert info.value.code == "INVALID_ARGUMENT"
    assert info.value.log.strip(), "the compiler log must come back"


def test_unknown_kernel_name(gpu: RemoteGpu) -> None:
    with pytest.raises(NotFound, match="no_such_kernel"):
        gpu.compile_kernel(samples.source(gpu.device_info().backend), "no_such_kernel")


def test_wrong_argument_count_and_types(gpu: RemoteGpu, saxpy) -> None:
    x = gpu.allocate_memory(1024)
    with pytest.raises(InvalidArgument):
        gpu.execute_kernel(saxpy, 1, 32, [np.float32(1), x])
    with pytest.raises(ArgumentTypeError) as bare:
        gpu.execute_kernel(saxpy, 1, 32, [1.0, x, x, np.int32(4)])
    assert isinstance(bare.value, TypeError)
    with pytest.raises(ArgumentTypeError):
        gpu.execute_kernel(saxpy, 1, 32, [np.float32(1), x, x, 4])
    with pytest.raises(InvalidArgument):  # a double where the kernel takes a float
        gpu.execute_kernel(saxpy, 1, 32, [np.float64(1), x, x, np.int32(4)])
    with pytest.raises(InvalidArgument):  # a scalar where the kernel takes a pointer
        gpu.execute_kernel(saxpy, 1, 32, [np.float32(1), np.int64(0), x, np.int32(4)])


def test_grid_and_block_limits(gpu: RemoteGpu, saxpy, stub, broker: BrokerProcess) -> None:
    x = gpu.allocate_memory(1024)
    args = [np.float32(1), x, x, np.int32(0)]
    info = gpu.device_info()
    for grid, block in [(0, 32), (1, 0), ((1, 0), 32), (1, info.max_threads_per_block + 1),
                        (info.max_grid_dims[0] + 1, 1), (1, (1, 1, info.max_block_dims[2] + 1))]:
        with pytest.raises(InvalidArgument):
            gpu.execute_kernel(saxpy, grid, block, args)
    # The broker checks too, not only the client library.
    launch = pb.LaunchKernelRequest(session=gpu.session, kernel=saxpy.handle, grid=[0], block=[32])
    code, message = _status(stub.LaunchKernel, launch,
                            metadata=(("authorization", f"Bearer {broker.tokens['bob']}"),))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "grid" in message


def test_message_over_the_size_limit(gpu: RemoteGpu) -> None:
    from gpubroker.client import ModuleFormat

    huge = "//" + "x" * (5 * 1024 * 1024)
    with pytest.raises(ResourceExhausted):
        gpu.load_module(huge, ModuleFormat.OPENCL_C)


def test_broker_still_healthy_after_bad_input(gpu: RemoteGpu, saxpy) -> None:
    n = 64
    x = np.ones(n, dtype=np.float32)
    dx, dy = gpu.allocate_memory(x.nbytes), gpu.allocate_memory(x.nbytes)
    gpu.copy_h2d(x, dx)
    gpu.copy_h2d(x, dy)
    gpu.execute_kernel(saxpy, 1, 64, [np.float32(2), dx, dy, np.int32(n)])
    gpu.synchronize()
    out = np.empty_like(x)
    gpu.copy_d2h(dy, out)
    np.testing.assert_array_equal(out, 3.0)


def test_a_refused_call_carries_the_standard_rich_status_for_other_grpc_clients(broker: BrokerProcess, stub) -> None:
    """Beside our client's own trailer, a refused call carries a google.rpc.Status in grpc-status-details-bin, read
    here as a client in another language (or grpcurl) would, with grpcio-status: the code and message repeated, an
    ErrorInfo naming the error's class and its details, and a QuotaFailure on a refusal over the quota."""
    from google.rpc import error_details_pb2
    from grpc_status import rpc_status

    auth = (("authorization", f"Bearer {broker.tokens['carol']}"),)
    with pytest.raises(grpc.RpcError) as missing:
        stub.Allocate(pb.AllocateRequest(session="ses_invented", size=8), metadata=auth)
    status = rpc_status.from_call(missing.value)  # (raises if the code or message differ from the call's)
    assert status is not None and status.code == grpc.StatusCode.NOT_FOUND.value[0]
    info = error_details_pb2.ErrorInfo()
    assert status.details[0].Unpack(info) and info.reason == "NOT_FOUND" and info.domain == "gpubroker"

    session = stub.OpenSession(pb.OpenSessionRequest(client_name="rich-status"), metadata=auth).session
    try:
        with pytest.raises(grpc.RpcError) as over:
            stub.Allocate(pb.AllocateRequest(session=session, size=128 << 20), metadata=auth)  # carol has 64 MiB
        assert over.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        status = rpc_status.from_call(over.value)
        assert status is not None and status.message == over.value.details()
        kinds = {detail.type_url.rsplit("/", 1)[-1]: detail for detail in status.details}
        assert {"google.rpc.ErrorInfo", "google.rpc.QuotaFailure"} <= set(kinds), set(kinds)
        kinds["google.rpc.ErrorInfo"].Unpack(info)
        assert info.metadata["quota"] == str(64 << 20) and info.metadata["requested"] == str(128 << 20), info
        quota = error_details_pb2.QuotaFailure()
        kinds["google.rpc.QuotaFailure"].Unpack(quota)
        assert quota.violations[0].subject.startswith("device memory")
    finally:
        stub.CloseSession(pb.CloseSessionRequest(session=session), metadata=auth)
