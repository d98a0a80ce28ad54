"""OpenCLBackend against a real OpenCL device (PoCL's CPU device in CI): results checked with numpy."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pyopencl as cl
import pytest

from gpubroker.broker.backends import _opencl
from gpubroker.broker.backends._opencl import OpenCLBackend, list_opencl_devices
from gpubroker.broker.backends._opencl_info import translate_cl_error
from gpubroker.client import (
    ArgumentTypeError,
    Buffer,
    CompileError,
    FailedPrecondition,
    GpuCompute,
    Internal,
    InvalidArgument,
    Kernel,
    Module,
    ModuleFormat,
    NotFound,
    OutOfRange,
    ResourceExhausted,
    Stream,
)

SOURCE = """
__kernel void vadd(__global const float* a, __global const float* b, __global float* c, uint n) {
    size_t i = get_global_id(0);
    if (i < n) c[i] = a[i] + b[i];
}

__kernel void saxpy(float alpha, __global const float* x, __global float* y, uint n) {
    size_t i = get_global_id(0);
    if (i < n) y[i] = alpha * x[i] + y[i];
}

__kernel void block_sum(__global const float* in, __global float* out, uint n, __local float* scratch) {
    size_t lid = get_local_id(0);
    size_t gid = get_global_id(0);
    scratch[lid] = gid < n ? in[gid] : 0.0f;
    barrier(CLK_LOCAL_MEM_FENCE);
    for (size_t s = get_local_size(0) / 2; s > 0; s >>= 1) {
        if (lid < s) scratch[lid] += scratch[lid + s];
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    if (lid == 0) out[get_group_id(0)] = scratch[0];
}

__kernel void transpose(__global const float* in, __global float* out, uint rows, uint cols) {
    size_t c = get_global_id(0);
    size_t r = get_global_id(1);
    if (r < rows && c < cols) out[c * rows + r] = in[r * cols + c];
}

__kernel void fill_index(__global int* out, uint n) {
    size_t i = get_global_id(0);
    if (i < n) out[i] = (int)i;
}

typedef float real;
__kernel void takes_typedef(__global float* out, real v) { out[0] = v; }
"""

F32 = np.float32


@pytest.fixture(scope="module")
def gpu() -> Iterator[OpenCLBackend]:
    with OpenCLBackend(0) as backend:
        yield backend


@pytest.fixture(scope="module")
def module(gpu: OpenCLBackend) -> Module:
    return gpu.load_module(SOURCE, ModuleFormat.OPENCL_C)


@pytest.fixture(scope="module")
def kernels(gpu: OpenCLBackend, module: Module) -> dict[str, Kernel]:
    return {name: gpu.get_kernel(module, name) for name in module.kernel_names}


@pytest.fixture(scope="module")
def align() -> int:
    """Sub-buffer alignment in bytes for device 0, read straight from pyopencl."""
    return max(int(cl.get_platforms()[0].get_devices()[0].mem_base_addr_align) // 8, 1)


def upload(gpu: OpenCLBackend, array: np.ndarray) -> Buffer:
    buf = gpu.allocate_memory(max(array.nbytes, 1))
    gpu.copy_h2d(array, buf)
    return buf


def download(gpu: OpenCLBackend, buf: Buffer, like: np.ndarray, offset: int = 0) -> np.ndarray:
    out = np.empty_like(like)
    gpu.copy_d2h(buf, out, offset)
    return out


# -- devices and lifecycle ---------------------------------------------------------------------


def test_list_devices_numbers_all_platforms() -> None:
    devices = list_opencl_devices()
    flat = [d for p in cl.get_platforms() for d in p.get_devices()]
    assert [d.id for d in devices] == list(range(len(flat)))
    assert [d.name for d in devices] == [d.name.strip() for d in flat]
    assert all(d.backend == "opencl" for d in devices)


def test_device_info_reports_real_values(gpu: OpenCLBackend) -> None:
    dev = cl.get_platforms()[0].get_devices()[0]
    info = gpu.device_info()
    assert isinstance(gpu, GpuCompute)
    assert (info.id, info.backend, info.compute_capability) == (0, "opencl", None)
    assert info.name == dev.name.strip() and info.vendor == dev.vendor.strip()
    assert info.total_memory == dev.global_mem_size
    assert info.multiprocessor_count == dev.max_compute_units
    assert info.clock_mhz == dev.max_clock_frequency
    assert info.l2_cache_bytes == dev.global_mem_cache_size
    assert info.max_threads_per_block == dev.max_work_group_size
    assert info.max_block_dims == tuple(dev.max_work_item_sizes[:3])
    assert info.max_grid_dims == (2**31 - 1,) * 3
    assert info.opencl_version == dev.version.strip() and info.driver_version == dev.driver_version.strip()
    before = info.free_memory
    buf = gpu.allocate_memory(1 << 20)
    assert gpu.device_info().free_memory == before - (1 << 20)
    gpu.free_memory(buf)
    assert gpu.device_info().free_memory == before


def test_lifecycle_errors() -> None:
    with pytest.raises(NotFound):
        OpenCLBackend(len(list_opencl_devices())).initialize()
    with pytest.raises(NotFound):
        OpenCLBackend(-1).initialize()
    backend = OpenCLBackend(0)
    with pytest.raises(FailedPrecondition):
        backend.allocate_memory(16)
    backend.initialize()
    backend.initialize()  # idempotent
    buf = backend.allocate_memory(16)
    stream = backend.create_stream()
    backend.memset(buf, 1, stream=stream)
    backend.close()
    backend.close()  # idempotent
    for call in (
        backend.device_info,
        lambda: backend.allocate_memory(16),
        lambda: backend.free_memory(buf),
        backend.synchronize,
        backend.initialize,
    ):
        with pytest.raises(FailedPrecondition):
            call()


# -- kernels compared with numpy ---------------------------------------------------------------


def test_vector_add(gpu: OpenCLBackend, kernels: dict[str, Kernel]) -> None:
    n = 1000
    a, b = np.random.default_rng(1).random((2, n), dtype=F32)
    da, db, dc = upload(gpu, a), upload(gpu, b), gpu.allocate_memory(a.nbytes)
    gpu.execute_kernel(kernels["vadd"], (n + 63) // 64, 64, [da, db, dc, np.uint32(n)])
    np.testing.assert_array_equal(download(gpu, dc, a), a + b)


def test_saxpy_with_float32_scalar(gpu: OpenCLBackend, kernels: dict[str, Kernel]) -> None:
    n = 777
    x, y = np.random.default_rng(2).random((2, n), dtype=F32)
    dx, dy = upload(gpu, x), upload(gpu, y)
    gpu.execute_kernel(kernels["saxpy"], (n + 63) // 64, (64,), [F32(2.5), dx, dy, np.uint32(n)])
    np.testing.assert_allclose(download(gpu, dy, y), F32(2.5) * x + y, rtol=1e-6)


def test_reduction_with_shared_mem(gpu: OpenCLBackend, kernels: dict[str, Kernel]) -> None:
    n, block = 5000, 64
    groups = (n + block - 1) // block
    data = np.random.default_rng(3).random(n, dtype=F32)
    din, dout = upload(gpu, data), gpu.allocate_memory(groups * 4)
    gpu.execute_kernel(kernels["block_sum"], groups, block, [din, dout, np.uint32(n)], shared_mem=block * 4)
    partial = download(gpu, dout, np.empty(groups, F32))
    np.testing.assert_allclose(partial.sum(), data.sum(dtype=np.float64), rtol=1e-4)


def test_transpose_2d_grid(gpu: OpenCLBackend, kernels: dict[str, Kernel]) -> None:
    rows, cols = 37, 53
    m = np.arange(rows * cols, dtype=F32).reshape(rows, cols)
    din, dout = upload(gpu, m), gpu.allocate_memory(m.nbytes)
    grid = ((cols + 7) // 8, (rows + 7) // 8)
    gpu.execute_kernel(kernels["transpose"], grid, (8, 8), [din, dout, np.uint32(rows), np.uint32(cols)])
    np.testing.assert_array_equal(download(gpu, dout, m.T.copy()), m.T)


def test_view_as_kernel_arg(gpu: OpenCLBackend, kernels: dict[str, Kernel], align: int) -> None:
    n = 64
    buf = gpu.allocate_memory(align + n * 4)
    gpu.memset(buf, 0xFF)
    gpu.execute_kernel(kernels["fill_index"], 1, n, [buf.at(align), np.uint32(n)])
    head = download(gpu, buf, np.empty(align, np.uint8))
    assert (head == 0xFF).all()  # nothing written before the view
    np.testing.assert_array_equal(download(gpu, buf.at(align), np.empty(n, np.int32)), np.arange(n))
    if align > 1:
        with pytest.raises(InvalidArgument, match="multiple of"):
            gpu.execute_kernel(kernels["fill_index"], 1, 1, [buf.at(4), np.uint32(1)])
    with pytest.raises(InvalidArgument):
        gpu.execute_kernel(kernels["fill_index"], 1, 1, [buf.at(buf.size), np.uint32(0)])


# -- copies, memset, d2d, streams --------------------------------------------------------------


@pytest.mark.parametrize("size", [0, 1, 1001])
def test_round_trip_sizes(gpu: OpenCLBackend, size: int) -> None:
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
    buf = gpu.allocate_memory(max(size, 1))
    gpu.copy_h2d(bytes(data), buf)
    out = bytearray(size)
    gpu.copy_d2h(buf, out)
    assert bytes(out) == data.tobytes()
    view = memoryview(bytearray(size))
    gpu.copy_d2h(buf, view)
    assert view.tobytes() == data.tobytes()
    gpu.free_memory(buf)


def test_copies_honour_views_and_offsets(gpu: OpenCLBackend) -> None:
    buf = gpu.allocate_memory(100)
    gpu.memset(buf, 0)
    gpu.copy_h2d(b"abcd", buf.at(10), offset=5)
    assert download(gpu, buf, np.empty(4, np.uint8), offset=15).tobytes() == b"abcd"
    assert download(gpu, buf.at(15), np.empty(4, np.uint8)).tobytes() == b"abcd"
    assert download(gpu, buf.at(7), np.empty(4, np.uint8), offset=8).tobytes() == b"abcd"
    gpu.copy_h2d(b"", buf.at(100))  # an empty copy at the very end is legal


def test_memset(gpu: OpenCLBackend) -> None:
    buf = gpu.allocate_memory(64)
    gpu.memset(buf, 7)
    gpu.memset(buf.at(8), 0xAB, size=16, offset=4)
    gpu.memset(buf.at(60), 1)  # to the end of the view
    gpu.memset(buf, 9, size=0, offset=64)
    expected = np.full(64, 7, np.uint8)
    expected[12:28] = 0xAB
    expected[60:] = 1
    np.testing.assert_array_equal(download(gpu, buf, np.empty(64, np.uint8)), expected)
    for bad in (-1, 256):
        with pytest.raises(InvalidArgument):
            gpu.memset(buf, bad)
    with pytest.raises(OutOfRange):
        gpu.memset(buf.at(60), 0, size=5)


def test_copy_d2d(gpu: OpenCLBackend) -> None:
    data = np.arange(256, dtype=np.uint8)
    src, dst = upload(gpu, data), gpu.allocate_memory(256)
    gpu.memset(dst, 0)
    gpu.copy_d2d(src.at(16), dst.at(32), 50, src_offset=4, dst_offset=8)
    gpu.copy_d2d(src, dst, 0, src_offset=256, dst_offset=256)
    expected = np.zeros(256, np.uint8)
    expected[40:90] = data[20:70]
    np.testing.assert_array_equal(download(gpu, dst, expected), expected)
    gpu.copy_d2d(src, src, 16, src_offset=0, dst_offset=128)  # same buffer, disjoint ranges
    np.testing.assert_array_equal(download(gpu, src, data)[128:144], data[:16])
    with pytest.raises(InvalidArgument, match="overlap"):
        gpu.copy_d2d(src, src, 16, src_offset=0, dst_offset=8)
    with pytest.raises(OutOfRange):
        gpu.copy_d2d(src, dst.at(250), 7)
    with pytest.raises(OutOfRange):
        gpu.copy_d2d(src.at(250), dst, 7)


def test_streams(gpu: OpenCLBackend, kernels: dict[str, Kernel]) -> None:
    n = 256
    s1, s2 = gpu.create_stream(), gpu.create_stream()
    assert s1 != s2
    out1, out2 = gpu.allocate_memory(n * 4), gpu.allocate_memory(n * 4)
    gpu.memset(out2, 0, stream=s2)
    gpu.execute_kernel(kernels["fill_index"], n // 64, 64, [out1, np.uint32(n)], stream=s1)
    gpu.copy_d2d(out1, out2, n * 4, stream=s1)
    gpu.synchronize(s1)
    host = np.empty(n, np.int32)
    gpu.copy_d2h(out2, host, stream=s2)
    np.testing.assert_array_equal(host, np.arange(n))
    gpu.synchronize()
    gpu.destroy_stream(s1)
    gpu.destroy_stream(s2)
    with pytest.raises(NotFound):
        gpu.destroy_stream(s1)
    with pytest.raises(NotFound):
        gpu.synchronize(s2)


# -- bad inputs --------------------------------------------------------------------------------


def test_allocation_errors(gpu: OpenCLBackend) -> None:
    for bad in (0, -5):
        with pytest.raises(InvalidArgument):
            gpu.allocate_memory(bad)
    with pytest.raises(InvalidArgument):
        gpu.allocate_memory(1.5)  # type: ignore[arg-type]
    info = gpu.device_info()
    max_alloc = cl.get_platforms()[0].get_devices()[0].max_mem_alloc_size
    with pytest.raises(ResourceExhausted, match="largest single allocation"):
        gpu.allocate_memory(max_alloc + 1)
    with pytest.raises(ResourceExhausted):
        gpu.allocate_memory(info.total_memory + 1)
    buf = gpu.allocate_memory(8)
    gpu.free_memory(buf)
    with pytest.raises(NotFound):
        gpu.free_memory(buf)


def test_range_errors(gpu: OpenCLBackend) -> None:
    buf = gpu.allocate_memory(16)
    with pytest.raises(OutOfRange):
        gpu.copy_h2d(bytes(17), buf)
    with pytest.raises(OutOfRange):
        gpu.copy_h2d(bytes(4), buf, offset=13)
    with pytest.raises(OutOfRange):
        gpu.copy_d2h(buf.at(8), bytearray(9))
    with pytest.raises(OutOfRange):
        gpu.copy_h2d(b"", buf, offset=17)
    with pytest.raises(InvalidArgument):
        gpu.copy_h2d(b"x", buf, offset=-1)
    with pytest.raises(InvalidArgument):
        gpu.copy_d2h(buf, bytearray(1), offset=-1)
    with pytest.raises(InvalidArgument):
        gpu.copy_d2h(buf, b"read-only")
    # A forged Buffer that claims more bytes than were allocated is checked against the real allocation.
    with pytest.raises(OutOfRange):
        gpu.copy_h2d(bytes(32), Buffer(buf.handle, 1 << 20))


def test_unknown_handles(gpu: OpenCLBackend, kernels: dict[str, Kernel]) -> None:
    ghost = Buffer("buf-999999", 16)
    for call in (
        lambda: gpu.copy_h2d(b"x", ghost),
        lambda: gpu.copy_d2h(ghost, bytearray(1)),
        lambda: gpu.memset(ghost, 0),
        lambda: gpu.free_memory(ghost),
        lambda: gpu.synchronize(Stream("stream-999999")),
        lambda: gpu.get_kernel(Module("mod-999999"), "vadd"),
        lambda: gpu.execute_kernel(Kernel("kern-999999", "vadd"), 1, 1, []),
        lambda: gpu.execute_kernel(kernels["fill_index"], 1, 1, [ghost, np.uint32(1)]),
    ):
        with pytest.raises(NotFound):
            call()


def test_compile_errors(gpu: OpenCLBackend) -> None:
    with pytest.raises(CompileError) as info:
        gpu.compile_kernel("__kernel void broken(__global int* a) { a[0] = undeclared_name; }", "broken")
    assert "undeclared_name" in info.value.log
    assert "undeclared_name" in str(info.value)
    with pytest.raises(NotFound, match="vadd"):
        gpu.compile_kernel(SOURCE, "no_such_kernel")
    with pytest.raises(InvalidArgument, match="not supported by the opencl backend"):
        gpu.load_module(b"\x7fELF", ModuleFormat.CUBIN)
    with pytest.raises(InvalidArgument):
        gpu.load_module("", ModuleFormat.OPENCL_C)
    with pytest.raises(CompileError, match="INVALID_BUILD_OPTIONS"):
        gpu.compile_kernel("__kernel void k(__global int* a) { a[0] = 1; }", "k", ["-no-such-option"])


def test_get_kernel_and_unload(gpu: OpenCLBackend) -> None:
    mod = gpu.load_module(b"__kernel void one(__global int* a) { a[0] = 1; }", ModuleFormat.OPENCL_C, ["-DX=1"])
    assert mod.kernel_names == ("one",)
    k1, k2 = gpu.get_kernel(mod, "one"), gpu.get_kernel(mod, "one")
    assert k1.handle != k2.handle
    with pytest.raises(NotFound, match="one"):
        gpu.get_kernel(mod, "two")
    buf = gpu.allocate_memory(4)
    gpu.execute_kernel(k2, 1, 1, [buf])
    gpu.unload_module(mod)
    np.testing.assert_array_equal(download(gpu, buf, np.empty(1, np.int32)), [1])
    for kernel in (k1, k2):
        with pytest.raises(NotFound):
            gpu.execute_kernel(kernel, 1, 1, [buf])
    with pytest.raises(NotFound):
        gpu.unload_module(mod)


def test_argument_errors(gpu: OpenCLBackend, kernels: dict[str, Kernel]) -> None:
    buf = gpu.allocate_memory(1024)
    saxpy, fill = kernels["saxpy"], kernels["fill_index"]
    with pytest.raises(InvalidArgument, match="takes 4"):
        gpu.execute_kernel(saxpy, 1, 1, [F32(1), buf, buf])
    with pytest.raises(ArgumentTypeError) as bare:
        gpu.execute_kernel(saxpy, 1, 1, [2, buf, buf, np.uint32(1)])
    assert isinstance(bare.value, TypeError)
    with pytest.raises(ArgumentTypeError, match=r"arg 0.*4-byte floating-point.*float64"):
        gpu.execute_kernel(saxpy, 1, 1, [np.float64(2), buf, buf, np.uint32(1)])
    with pytest.raises(ArgumentTypeError, match="arg 0"):
        gpu.execute_kernel(saxpy, 1, 1, [np.int32(2), buf, buf, np.uint32(1)])
    with pytest.raises(ArgumentTypeError, match="arg 3"):
        gpu.execute_kernel(saxpy, 1, 1, [F32(2), buf, buf, np.uint64(1)])
    with pytest.raises(ArgumentTypeError, match="expected a Buffer"):
        gpu.execute_kernel(fill, 1, 1, [np.uint64(0), np.uint32(1)])
    with pytest.raises(ArgumentTypeError, match="arg 0"):
        gpu.execute_kernel(saxpy, 1, 1, [buf, buf, buf, np.uint32(1)])
    with pytest.raises(ArgumentTypeError, match="real"):
        gpu.execute_kernel(kernels["takes_typedef"], 1, 1, [buf, F32(1)])
    with pytest.raises(InvalidArgument, match="shared_mem"):
        gpu.execute_kernel(kernels["block_sum"], 1, 64, [buf, buf, np.uint32(64)])
    with pytest.raises(InvalidArgument, match="__local"):
        gpu.execute_kernel(fill, 1, 1, [buf, np.uint32(1)], shared_mem=64)
    with pytest.raises(InvalidArgument, match="local memory"):
        gpu.execute_kernel(kernels["block_sum"], 1, 64, [buf, buf, np.uint32(64)], shared_mem=1 << 40)


def test_launch_shape_errors(gpu: OpenCLBackend, kernels: dict[str, Kernel]) -> None:
    buf = gpu.allocate_memory(16)
    fill = kernels["fill_index"]
    info = gpu.device_info()
    args = [buf, np.uint32(0)]
    for grid, block in (
        (0, 1),
        (1, 0),
        ((1, 0), 1),
        (1, info.max_threads_per_block + 1),
        (1, (1, 1, info.max_block_dims[2] + 1)),
        (2**31, 1),
    ):
        with pytest.raises(InvalidArgument):
            gpu.execute_kernel(fill, grid, block, args)
    with pytest.raises(InvalidArgument):
        gpu.execute_kernel(fill, 1, 1, args, shared_mem=-1)
    fixed = gpu.compile_kernel(
        "__kernel __attribute__((reqd_work_group_size(4, 1, 1))) void r(__global int* a) {}", "r"
    )
    with pytest.raises(InvalidArgument, match="reqd_work_group_size"):
        gpu.execute_kernel(fixed, 1, 8, [buf])


def test_cl_errors_are_translated() -> None:
    def err(cls: type[cl.Error], code: int) -> cl.Error:
        return cls(cl._cl._ErrorRecord(msg="boom", code=code, routine="clSomething"))

    assert isinstance(translate_cl_error(err(cl.MemoryError, -4), "x"), ResourceExhausted)
    assert isinstance(translate_cl_error(err(cl.RuntimeError, -5), "x"), ResourceExhausted)
    assert isinstance(translate_cl_error(err(cl.LogicError, -30), "x"), InvalidArgument)
    assert isinstance(translate_cl_error(err(cl.RuntimeError, -9999), "x"), Internal)


# -- device time -------------------------------------------------------------------------------

SPIN = """
__kernel void spin(__global float* out, uint iters) {
    size_t i = get_global_id(0);
    float x = (float)i;
    for (uint k = 0; k < iters; ++k) x = x * 0.999999f + 1.0f;  /* a dependent chain: cannot be skipped */
    out[i] = x;
}
"""
SPIN_ITEMS = 256
SPIN_ITERS = 40_000  # ~10-20 ms of PoCL CPU time for 256 work-items


@pytest.fixture(scope="module")
def spin(gpu: OpenCLBackend) -> Kernel:
    return gpu.compile_kernel(SPIN, "spin")


def run_spin(gpu: OpenCLBackend, spin: Kernel, out: Buffer, iters: int, stream: Stream | None = None) -> None:
    gpu.execute_kernel(spin, SPIN_ITEMS // 64, 64, [out, np.uint32(iters)], stream=stream)


def test_device_time_is_zero_when_nothing_ran() -> None:
    backend = OpenCLBackend(0)
    assert backend.take_device_time() == 0.0  # before initialize: nothing to charge, nothing raised
    with backend:
        assert backend.take_device_time() == 0.0
        assert backend.take_device_time() == 0.0


def test_device_time_scales_with_kernel_work(gpu: OpenCLBackend, spin: Kernel) -> None:
    out = gpu.allocate_memory(SPIN_ITEMS * 4)
    run_spin(gpu, spin, out, 100)  # warm-up: the first launch builds PoCL's work-group function
    gpu.take_device_time()
    run_spin(gpu, spin, out, SPIN_ITERS)
    one = gpu.take_device_time()
    assert gpu.take_device_time() < 1e-3  # the tally was reset and nothing ran since
    run_spin(gpu, spin, out, 4 * SPIN_ITERS)
    four = gpu.take_device_time()
    assert one > 0
    assert four > 1.5 * one, (one, four)
    # Two launches are charged together, and nothing is left for the next take.
    run_spin(gpu, spin, out, SPIN_ITERS)
    run_spin(gpu, spin, out, SPIN_ITERS)
    two = gpu.take_device_time()
    assert two > 0 and gpu.take_device_time() == 0.0
    gpu.free_memory(out)


def test_device_time_waits_for_queued_work(gpu: OpenCLBackend, spin: Kernel) -> None:
    """take_device_time needs no synchronize first: it waits itself, on every stream."""
    out1, out2 = gpu.allocate_memory(SPIN_ITEMS * 4), gpu.allocate_memory(SPIN_ITEMS * 4)
    stream = gpu.create_stream()
    gpu.take_device_time()
    run_spin(gpu, spin, out1, SPIN_ITERS)
    run_spin(gpu, spin, out2, SPIN_ITERS, stream=stream)
    assert gpu.take_device_time() > 0
    host = np.empty(SPIN_ITEMS, F32)
    gpu.copy_d2h(out2, host, stream=stream)  # the stream's result is there: its work had finished
    assert np.isfinite(host).all() and host[1] > 1.0
    gpu.take_device_time()
    # Work on a stream destroyed before the take is still charged.
    run_spin(gpu, spin, out2, SPIN_ITERS, stream=stream)
    gpu.destroy_stream(stream)
    assert gpu.take_device_time() > 0


def test_device_time_counts_copies_and_memsets(gpu: OpenCLBackend) -> None:
    n = 16 << 20
    host = np.full(n, 7, np.uint8)
    a, b = gpu.allocate_memory(n), gpu.allocate_memory(n)
    gpu.take_device_time()
    gpu.copy_h2d(host, a)
    assert gpu.take_device_time() > 0
    gpu.copy_d2h(a, host)
    assert gpu.take_device_time() > 0
    gpu.copy_d2d(a, b, n)
    assert gpu.take_device_time() > 0
    gpu.memset(b, 1)
    assert gpu.take_device_time() > 0
    assert gpu.take_device_time() == 0.0
    # Zero-byte commands reach no queue, so they charge nothing.
    gpu.copy_h2d(b"", a)
    gpu.copy_d2h(a, bytearray())
    gpu.copy_d2d(a, b, 0)
    gpu.memset(a, 0, size=0)
    assert gpu.take_device_time() == 0.0
    gpu.free_memory(a)
    gpu.free_memory(b)


def test_kept_copy_events_do_not_pin_host_buffers(gpu: OpenCLBackend) -> None:
    """A blocking copy's event is kept until the take; it must not keep the caller's buffer exported."""
    buf = gpu.allocate_memory(64)
    src, dst = bytearray(b"x" * 64), bytearray(64)
    gpu.copy_h2d(src, buf)
    gpu.copy_d2h(buf, dst)
    src.extend(b"more")  # raises BufferError while an export of the bytearray is alive
    dst.extend(b"more")
    assert bytes(dst[:64]) == b"x" * 64
    gpu.free_memory(buf)


def test_device_time_events_stay_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_opencl, "_FOLD_EVENTS", 64)
    with OpenCLBackend(0) as backend:
        buf = backend.allocate_memory(64 << 10)
        longest = 0
        for i in range(1, 20 * 64 + 1):
            backend.memset(buf, 3)
            longest = max(longest, len(backend._events))
            if i % 64 == 0:
                backend.synchronize()
        # Without folding the list would hold all 1280 events; with it, completed ones leave once 64 pile up.
        assert longest <= 2 * 64 + 1, longest
        total = backend.take_device_time()
        assert total > 0
        assert backend._events == [] and backend.take_device_time() == 0.0


def test_device_time_survives_close() -> None:
    with OpenCLBackend(0) as backend:
        buf = backend.allocate_memory(1 << 20)
        backend.memset(buf, 1)
    assert backend.take_device_time() > 0  # close waited for the memset; its time is still charged
    assert backend.take_device_time() == 0.0


# -- events ----------------------------------------------------------------------------------------
# Each work-item spins before it writes i + 1: slow enough that a read on another stream which did not wait for
# the event would see the memset's zeros.
SLOW_FILL = """
__kernel void slow_fill(__global int* out, uint n, uint spin) {
    size_t i = get_global_id(0);
    uint acc = (uint)i;
    for (uint k = 0; k < spin; ++k) acc = acc * 1664525u + 1013904223u;
    if (i < n) out[i] = acc == 0xdeadbeefu && spin == 3u ? -1 : (int)i + 1;
}
"""


def test_a_stream_waits_on_the_device_for_another_streams_event(gpu: OpenCLBackend) -> None:
    slow = gpu.compile_kernel(SLOW_FILL, "slow_fill")
    n = 1024
    a, b = gpu.create_stream(), gpu.create_stream()
    buf = gpu.allocate_memory(n * 4)
    ev = gpu.create_event()
    try:
        gpu.memset(buf, 0)
        gpu.synchronize()
        gpu.execute_kernel(slow, n // 64, 64, [buf, np.uint32(n), np.uint32(200_000)], stream=a)
        gpu.record_event(ev, a)
        gpu.wait_event(ev, b)  # returns at once: the barrier is the device's to honour
        host = np.empty(n, dtype=np.int32)
        gpu.copy_d2h(buf, host, stream=b)
        np.testing.assert_array_equal(host, np.arange(1, n + 1, dtype=np.int32))
        gpu.synchronize_event(ev)
    finally:
        gpu.destroy_event(ev)
        gpu.free_memory(buf)
        gpu.destroy_stream(a)
        gpu.destroy_stream(b)
    with pytest.raises(NotFound, match="event"):
        gpu.synchronize_event(ev)
    with pytest.raises(NotFound, match="event"):
        gpu.record_event(ev)


def test_an_event_never_recorded_is_complete(gpu: OpenCLBackend) -> None:
    ev = gpu.create_event()
    s = gpu.create_stream()
    try:
        gpu.wait_event(ev, s)
        gpu.wait_event(ev)
        gpu.synchronize_event(ev)
        gpu.synchronize(s)
    finally:
        gpu.destroy_event(ev)
        gpu.destroy_stream(s)
    with pytest.raises(InvalidArgument, match="Event"):
        gpu.wait_event("e-1")  # type: ignore[arg-type]
