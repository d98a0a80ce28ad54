"""Real kernels through a real broker process, compared with numpy."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest

from gpubroker.broker import samples
from gpubroker.broker.launcher import BrokerProcess
from gpubroker.client import Buffer, GpuCompute, RemoteGpu, connect
from gpubroker.v1 import broker_pb2 as pb

from ..conftest import TRANSPORTS, OpenGpu


@pytest.fixture(scope="module", params=TRANSPORTS)
def gpu(open_gpu: OpenGpu, request: pytest.FixtureRequest) -> Iterator[RemoteGpu]:
    with open_gpu("alice", request.param) as g:
        yield g


@pytest.fixture(scope="module")
def kernels(gpu: RemoteGpu) -> dict[str, object]:
    src = samples.source(gpu.device_info().backend)
    return {name: gpu.compile_kernel(src, name) for name in ("vector_add", "saxpy", "reduce_sum", "matmul")}


def _upload(gpu: GpuCompute, array: np.ndarray):
    buf = gpu.allocate_memory(max(array.nbytes, 1))
    gpu.copy_h2d(array, buf)
    return buf


def test_device_info_is_real_and_tenant_scoped(gpu: RemoteGpu, backend: str) -> None:
    info = gpu.device_info()
    assert info.backend == backend
    assert info.name and info.vendor
    assert info.total_memory > 0 and 0 < info.free_memory <= info.total_memory
    assert info.multiprocessor_count > 0 and info.clock_mhz > 0
    assert info.max_threads_per_block >= 64 and min(info.max_block_dims) >= 1
    assert (info.compute_capability is not None) == (backend == "cuda")
    assert (info.opencl_version is not None) == (backend == "opencl")
    assert info.memory_quota == 1 << 40
    assert info.memory_used is not None


def test_vector_add(gpu: RemoteGpu, kernels: dict) -> None:
    n = 100_003
    rng = np.random.default_rng(0)
    a, b = rng.random(n, dtype=np.float32), rng.random(n, dtype=np.float32)
    da, db, dc = _upload(gpu, a), _upload(gpu, b), gpu.allocate_memory(a.nbytes)
    gpu.execute_kernel(kernels["vector_add"], (n + 255) // 256, 256, [da, db, dc, np.int32(n)])
    gpu.synchronize()
    out = np.empty_like(a)
    gpu.copy_d2h(dc, out)
    np.testing.assert_array_equal(out, a + b)
    for buf in (da, db, dc):
        gpu.free_memory(buf)


def test_saxpy_on_a_stream(gpu: RemoteGpu, kernels: dict) -> None:
    n = 4097
    x = np.arange(n, dtype=np.float32)
    y = np.full(n, 2.0, dtype=np.float32)
    dx, dy = _upload(gpu, x), _upload(gpu, y)
    stream = gpu.create_stream()
    gpu.execute_kernel(kernels["saxpy"], (n + 127) // 128, 128, [np.float32(3.0), dx, dy, np.int32(n)],
                       stream=stream)
    gpu.synchronize(stream)
    out = np.empty_like(y)
    gpu.copy_d2h(dy, out)
    np.testing.assert_allclose(out, 3.0 * x + 2.0)
    gpu.destroy_stream(stream)


def test_reduction_with_shared_memory(gpu: RemoteGpu, kernels: dict) -> None:
    n, block = 1 << 16, 128
    x = np.random.default_rng(3).random(n, dtype=np.float32)
    dx = _upload(gpu, x)
    blocks = n // block
    partial = gpu.allocate_memory(blocks * 4)
    gpu.execute_kernel(kernels["reduce_sum"], blocks, block, [dx, partial, np.int32(n)], shared_mem=block * 4)
    gpu.synchronize()
    out = np.empty(blocks, dtype=np.float32)
    gpu.copy_d2h(partial, out)
    np.testing.assert_allclose(out, x.reshape(blocks, block).sum(axis=1), rtol=1e-5)
    assert abs(out.sum(dtype=np.float64) - x.sum(dtype=np.float64)) < 1e-2


def test_two_dimensional_matmul(gpu: RemoteGpu, kernels: dict) -> None:
    m, k, n = 70, 33, 45
    rng = np.random.default_rng(4)
    a, b = rng.random((m, k), dtype=np.float32), rng.random((k, n), dtype=np.float32)
    da, db, dc = _upload(gpu, a), _upload(gpu, b), gpu.allocate_memory(m * n * 4)
    gpu.execute_kernel(kernels["matmul"], ((n + 7) // 8, (m + 7) // 8), (8, 8),
                       [da, db, dc, np.int32(m), np.int32(k), np.int32(n)])
    gpu.synchronize()
    out = np.empty((m, n), dtype=np.float32)
    gpu.copy_d2h(dc, out)
    np.testing.assert_allclose(out, a @ b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("size", [0, 1, 1001, 3 * 1024 * 1024 + 7])
def test_copy_round_trip_sizes(gpu: RemoteGpu, size: int) -> None:
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
    buf = gpu.allocate_memory(size + 16)
    gpu.copy_h2d(data, buf, offset=16)
    out = np.zeros(size, dtype=np.uint8)
    gpu.copy_d2h(buf, out, offset=16)
    np.testing.assert_array_equal(out, data)
    gpu.free_memory(buf)


def test_copy_64_mib_in_chunks(gpu: RemoteGpu) -> None:
    size = 64 * 1024 * 1024
    data = np.random.default_rng(64).integers(0, 256, size, dtype=np.uint8)
    buf = gpu.allocate_memory(size)
    gpu.copy_h2d(data, buf)
    out = np.empty(size, dtype=np.uint8)
    gpu.copy_d2h(buf, out)
    assert gpu.chunk_bytes <= 1024 * 1024 < size  # so this really went as many chunks
    np.testing.assert_array_equal(out, data)
    gpu.free_memory(buf)


@pytest.fixture(scope="module")
def streamed(broker: BrokerProcess) -> Iterator[RemoteGpu]:
    """Copies over the gRPC streams (no shared memory), as a client on another host makes them."""
    with connect(broker.target, token=broker.tokens["alice"], shared_memory=False) as g:
        yield g


def test_streamed_copies_pipeline_many_chunks(streamed: RemoteGpu) -> None:
    size = 5 * streamed.chunk_bytes + 12345  # several chunks in flight at once, and a short last one
    data = np.random.default_rng(5).integers(0, 256, size, dtype=np.uint8)
    buf = streamed.allocate_memory(size + 16)
    streamed.copy_h2d(data, buf, offset=16)
    out = np.zeros(size, dtype=np.uint8)
    streamed.copy_d2h(buf, out, offset=16)
    np.testing.assert_array_equal(out, data)
    streamed.free_memory(buf)


def test_streamed_write_failing_mid_stream_is_a_status(streamed: RemoteGpu) -> None:
    chunk = streamed.chunk_bytes
    buf = streamed.allocate_memory(4 * chunk)
    header = pb.HostToDeviceHeader(session=streamed.session, buffer=pb.BufferRef(handle=buf.handle), size=3 * chunk)
    # Four full chunks for a copy of three: the broker finds out with writes still in flight.
    chunks = [pb.HostToDeviceChunk(header=header, data=bytes(chunk))] + [
        pb.HostToDeviceChunk(data=bytes(chunk)) for _ in range(3)]
    with pytest.raises(grpc.RpcError) as info:
        streamed._stub.CopyHostToDevice(iter(chunks), metadata=streamed._metadata)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "more than" in (info.value.details() or "")
    streamed.copy_h2d(b"\x05" * chunk, buf)  # the session (and the broker) still serve
    out = bytearray(chunk)
    streamed.copy_d2h(buf, out)
    assert out == b"\x05" * chunk
    streamed.free_memory(buf)


def test_bytes_memoryview_and_views(gpu: RemoteGpu) -> None:
    buf = gpu.allocate_memory(64)
    gpu.copy_h2d(b"\x01" * 64, buf)
    gpu.copy_h2d(memoryview(b"\x02" * 8), buf.at(8))
    gpu.memset(buf, 7, size=4, offset=20)
    out = bytearray(64)
    gpu.copy_d2h(buf, out)
    assert out == b"\x01" * 8 + b"\x02" * 8 + b"\x01" * 4 + b"\x07" * 4 + b"\x01" * 40
    tail = bytearray(8)
    gpu.copy_d2h(buf.at(56), tail)
    assert tail == b"\x01" * 8


def test_device_to_device_copy_and_memset(gpu: RemoteGpu) -> None:
    src = _upload(gpu, np.arange(256, dtype=np.uint8))
    dst = gpu.allocate_memory(256)
    gpu.memset(dst, 0xAB)
    gpu.copy_d2d(src, dst, 100, src_offset=10, dst_offset=50)
    gpu.synchronize()
    out = np.empty(256, dtype=np.uint8)
    gpu.copy_d2h(dst, out)
    expected = np.full(256, 0xAB, dtype=np.uint8)
    expected[50:150] = np.arange(10, 110)
    np.testing.assert_array_equal(out, expected)


def test_buffer_view_as_kernel_argument(gpu: RemoteGpu, kernels: dict) -> None:
    n = 256
    x = np.ones(2 * n, dtype=np.float32)
    dx = _upload(gpu, x)
    dy = _upload(gpu, np.zeros(2 * n, dtype=np.float32))
    # Offsets of 1 KiB keep every backend's alignment rule satisfied.
    gpu.execute_kernel(kernels["saxpy"], 2, 128, [np.float32(5.0), dx.at(1024), dy.at(1024), np.int32(n)])
    gpu.synchronize()
    out = np.empty(2 * n, dtype=np.float32)
    gpu.copy_d2h(dy, out)
    np.testing.assert_array_equal(out[:n], 0.0)
    np.testing.assert_array_equal(out[n:], 5.0)


def test_load_module_lists_kernels_and_get_kernel(gpu: RemoteGpu, backend: str) -> None:
    from gpubroker.client import ModuleFormat

    fmt = ModuleFormat.CUDA_C if backend == "cuda" else ModuleFormat.OPENCL_C
    module = gpu.load_module(samples.source(backend), fmt)
    if backend == "opencl":
        assert set(samples.KERNELS) <= set(module.kernel_names)
    kernel = gpu.get_kernel(module, "empty_kernel")
    gpu.execute_kernel(kernel, 1, 1, [])
    gpu.synchronize()


def test_same_code_runs_in_process(backend: str) -> None:
    """The GpuCompute interface: the demo's jobs run unchanged on the in-process backend."""
    from gpubroker.broker.backends import open_backend
    from gpubroker.broker.demo import matmul_job, vector_add_job

    with open_backend(backend, 0) as local:
        assert vector_add_job(local, n=10_000)["ok"]
        assert matmul_job(local, m=20, k=10, n=30)["ok"]


@pytest.mark.parametrize("transport", ["link", "grpc"])
def test_copies_from_two_threads_at_once_come_out_right(broker: BrokerProcess, transport: str) -> None:
    """One session shared by two threads: their chunked copies interleave on the one transport, each chunk's bytes
    landing where its own copy asked."""
    size = 3 * 1024 * 1024 + 777
    data = [np.random.default_rng(i).integers(0, 256, size, dtype=np.uint8) for i in range(2)]
    with connect(broker.target, token=broker.tokens["bob"], shared_memory=False, transport=transport) as g:
        bufs = [g.allocate_memory(size) for _ in data]
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda i: g.copy_h2d(data[i], bufs[i]), range(2)))
            outs = list(pool.map(lambda i: _read(g, bufs[i], size), range(2)))
        for out, expected in zip(outs, data, strict=True):
            np.testing.assert_array_equal(out, expected)


def _read(g: RemoteGpu, buf: Buffer, size: int) -> np.ndarray:
    out = np.empty(size, dtype=np.uint8)
    g.copy_d2h(buf, out)
    return out


_SCALARS = [np.int8(-5), np.uint8(250), np.int16(-30000), np.uint16(65000), np.int32(-(2**31)), np.uint32(2**32 - 1),
            np.int64(-(2**63)), np.uint64(2**64 - 1), np.float32(-1.5), np.float64(np.pi)]
_CTYPES = {"cuda": {"int8": "signed char", "uint8": "unsigned char", "int16": "short", "uint16": "unsigned short",
                    "int32": "int", "uint32": "unsigned int", "int64": "long long", "uint64": "unsigned long long",
                    "float32": "float", "float64": "double"},
           "opencl": {"int8": "char", "uint8": "uchar", "int16": "short", "uint16": "ushort", "int32": "int",
                      "uint32": "uint", "int64": "long", "uint64": "ulong", "float32": "float", "float64": "double"}}


def test_every_scalar_type_reaches_the_kernel_bit_for_bit(gpu: RemoteGpu, backend: str) -> None:
    """Each NumPy scalar type a launch takes arrives with its exact bytes (the client packs them without numpy for
    the common types): a kernel stores each argument in its own 8-byte slot."""
    types = _CTYPES[backend]
    space = "" if backend == "cuda" else "__global "  # (OpenCL's pointers into a buffer name their address space)
    params = ", ".join(f"{types[v.dtype.name]} a{i}" for i, v in enumerate(_SCALARS))
    stores = " ".join(f"*(({space}{types[v.dtype.name]}*)(out + {8 * i})) = a{i};" for i, v in enumerate(_SCALARS))
    if backend == "cuda":
        src = f'extern "C" __global__ void store(unsigned char* out, {params}) {{ {stores} }}'
    else:
        src = f"__kernel void store(__global uchar* out, {params}) {{ {stores} }}"
    kernel = gpu.compile_kernel(src, "store")
    out = gpu.allocate_memory(8 * len(_SCALARS))
    gpu.memset(out, 0)
    for _ in range(2):  # the first launch of each type takes the full check, the second the fast path
        gpu.execute_kernel(kernel, 1, 1, [out, *_SCALARS])
    gpu.synchronize()
    got = np.empty(8 * len(_SCALARS), np.uint8)
    gpu.copy_d2h(out, got)
    for i, value in enumerate(_SCALARS):
        assert got[8 * i: 8 * i + value.itemsize].tobytes() == value.tobytes(), value
