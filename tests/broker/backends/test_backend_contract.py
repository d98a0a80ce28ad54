"""The in-process backends' contract: CudaBackend and OpenCLBackend against numpy, through the same calls.

Every test here runs on each backend (``backend`` from tests/conftest.py: OpenCL on PoCL by default, CUDA with
``-m cuda`` on a GPU host), with the kernels of tests/backend_kernels.py in that backend's dialect. What only one
backend has (CUDA's binary images, signature parsing and fatal errors; OpenCL's alignment, ``__local`` and
work-group rules; each one's device-time internals) is tested in test_cuda_backend.py and test_opencl_backend.py.
Where the backends differ on purpose, the difference is stated once, as data, below the imports.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest

from gpubroker.broker.backends import list_devices
from gpubroker.broker.worker._executor import Executor
from gpubroker.broker.worker._handles import HandleTables
from gpubroker.broker.worker._segments import SegmentTable
from gpubroker.client import (
    ArgumentTypeError,
    Buffer,
    CompileError,
    FailedPrecondition,
    GpuCompute,
    InvalidArgument,
    Kernel,
    Module,
    ModuleFormat,
    NotFound,
    OutOfRange,
    ResourceExhausted,
    Stream,
)
from gpubroker.wire.commands import (
    Allocate,
    Batch,
    BufferArg,
    CreateEvent,
    CreateStream,
    DestroyEvent,
    Free,
    GetKernel,
    Launch,
    LoadModule,
    Read,
    RecordEvent,
    ScalarArg,
    SynchronizeEvent,
    WaitEvent,
    Write,
    new_handle,
)
from tests.backend_kernels import FORMAT, MODULE_KERNELS, Backend, OpenDevice, module_source, source, unopened

F32 = np.float32
I32 = np.int32
Arr = np.ndarray[Any, Any]

# get_kernel twice on one module: CUDA hands back the same kernel (a CUfunction is stateless), OpenCL a new one each
# time (a cl_kernel holds its arguments, so two launchers must not share one).
NEW_KERNEL_PER_GET = {"cuda": False, "opencl": True}
# Iterations of `spin` that take milliseconds: long enough that a read which did not wait for it sees zeros.
SLOW_SPIN = {"cuda": 2_000_000, "opencl": 100_000}
# A large copy: CUDA's driver copies pageable host memory through its pinned staging buffers, 64 MiB through many;
# PoCL's device is the host, where a copy is a memcpy at any size (and 64 MiB costs a loaded 2-core host a second).
LARGE_COPY = {"cuda": 64 << 20, "opencl": 4 << 20}


@pytest.fixture(scope="module", autouse=True)
def _cuda_needs_cupy(backend: str) -> None:
    """Every test here runs on each backend; the CUDA ones skip where CuPy is missing, as test_cuda_backend does."""
    if backend == "cuda":
        pytest.importorskip("cupy")


@pytest.fixture(scope="module")
def gpu(backend: str, open_device: OpenDevice) -> Backend:
    return open_device(backend)


@pytest.fixture(scope="module")
def module(gpu: Backend, backend: str) -> Module:
    return gpu.load_module(module_source(backend), FORMAT[backend])


@pytest.fixture(scope="module")
def kernels(gpu: Backend, module: Module) -> dict[str, Kernel]:
    return {name: gpu.get_kernel(module, name) for name in MODULE_KERNELS}


def upload(gpu: GpuCompute, arr: Arr) -> Buffer:
    buf = gpu.allocate_memory(max(arr.nbytes, 1))
    gpu.copy_h2d(arr, buf)
    return buf


def download(gpu: GpuCompute, buf: Buffer, dtype: Any, count: int, offset: int = 0) -> Arr:
    out = np.empty(count, dtype=dtype)
    gpu.copy_d2h(buf, out, offset)
    return out


def blocks(n: int, block: int) -> int:
    return (n + block - 1) // block


# -- devices and lifecycle -----------------------------------------------------------------------------------------

def test_device_info(gpu: Backend, backend: str) -> None:
    info = gpu.device_info()
    assert isinstance(gpu, GpuCompute)
    assert (info.id, info.backend) == (0, backend) and info.name
    assert info.total_memory >= info.free_memory > 0
    assert info.multiprocessor_count > 0 and info.clock_mhz > 0 and info.l2_cache_bytes > 0
    assert info.max_threads_per_block > 0 and min(info.max_block_dims) > 0
    assert info.max_grid_dims[0] >= 2**31 - 1


def test_listing_numbers_the_devices(gpu: Backend, backend: str) -> None:
    devices = list_devices(backend)
    assert [d.id for d in devices] == list(range(len(devices)))
    assert all(d.backend == backend for d in devices)
    info = gpu.device_info()
    assert devices[0].name == info.name and devices[0].total_memory == info.total_memory


def test_usable_from_another_thread(gpu: Backend, kernels: dict[str, Kernel]) -> None:
    n = 1000
    buf = gpu.allocate_memory(4 * n)

    def work() -> Arr:
        assert threading.current_thread() is not threading.main_thread()
        gpu.execute_kernel(kernels["fill_index"], blocks(n, 256), 256, [buf, I32(n)])
        return download(gpu, buf, I32, n)

    with ThreadPoolExecutor(1) as pool:
        np.testing.assert_array_equal(pool.submit(work).result(), np.arange(n))
    gpu.free_memory(buf)


def test_bad_device_index(backend: str) -> None:
    for index in (99, len(list_devices(backend)), -1):
        with pytest.raises(NotFound):
            unopened(backend, index).initialize()
    with pytest.raises(InvalidArgument):
        unopened(backend, "0")


def test_close_is_idempotent_and_final(backend: str) -> None:
    device = unopened(backend)
    with pytest.raises(FailedPrecondition):
        device.allocate_memory(16)  # not initialized yet
    device.initialize()
    device.initialize()  # idempotent
    buf = device.allocate_memory(1 << 20)
    stream = device.create_stream()
    device.memset(buf, 1, stream=stream)  # close waits for queued work, on every stream
    device.close()
    device.close()  # idempotent
    for call in (lambda: device.allocate_memory(16), lambda: device.free_memory(buf), device.device_info,
                 device.initialize, device.synchronize):
        with pytest.raises(FailedPrecondition):
            call()


# -- kernels, compared with numpy ----------------------------------------------------------------------------------

def test_vector_add(gpu: Backend, kernels: dict[str, Kernel]) -> None:
    n = 1_000_003
    a, b = np.arange(n, dtype=F32), np.arange(n, dtype=F32) * 2
    da, db, dc = upload(gpu, a), upload(gpu, b), gpu.allocate_memory(a.nbytes)
    gpu.execute_kernel(kernels["vadd"], blocks(n, 256), 256, [da, db, dc, I32(n)])
    gpu.synchronize()
    np.testing.assert_array_equal(download(gpu, dc, F32, n), a + b)
    for buf in (da, db, dc):
        gpu.free_memory(buf)


def test_saxpy_with_compile_kernel(gpu: Backend, backend: str) -> None:
    n = 4099
    x, y = np.linspace(0, 1, n, dtype=F32), np.linspace(3, 4, n, dtype=F32)
    dx, dy = upload(gpu, x), upload(gpu, y)
    saxpy = gpu.compile_kernel(module_source(backend), "saxpy")
    gpu.execute_kernel(saxpy, [blocks(n, 64)], (64,), [F32(2.5), dx, dy, I32(n)])  # dims as a list or a tuple
    np.testing.assert_allclose(download(gpu, dy, F32, n), F32(2.5) * x + y, rtol=1e-6)


def test_shared_memory_reduction(gpu: Backend, kernels: dict[str, Kernel]) -> None:
    n, block = 100_003, 256
    x = (np.arange(n) % 7).astype(F32)  # small integers: every partial sum is exact
    dx, dout = upload(gpu, x), gpu.allocate_memory(blocks(n, block) * 4)
    kern = kernels["block_sum"]
    gpu.execute_kernel(kern, blocks(n, block), block, [dx, dout, I32(n)], shared_mem=block * 4)
    padded = np.zeros(blocks(n, block) * block, dtype=F32)
    padded[:n] = x
    expected = padded.reshape(-1, block).sum(axis=1)
    np.testing.assert_array_equal(download(gpu, dout, F32, blocks(n, block)), expected)
    # More shared (local) memory than a block can have.
    with pytest.raises(InvalidArgument, match=r"(shared|local) memory"):
        gpu.execute_kernel(kern, 1, block, [dx, dout, I32(n)], shared_mem=10 << 20)


def test_2d_kernel(gpu: Backend, kernels: dict[str, Kernel]) -> None:
    w, h = 1000, 517
    out = gpu.allocate_memory(w * h * 4)
    gpu.execute_kernel(kernels["fill2d"], (blocks(w, 16), blocks(h, 16)), (16, 16), [out, I32(w), I32(h)])
    ys, xs = np.mgrid[0:h, 0:w]
    np.testing.assert_array_equal(download(gpu, out, I32, w * h).reshape(h, w), ys * 10000 + xs)
    gpu.free_memory(out)


def test_transpose_2d_grid(gpu: Backend, kernels: dict[str, Kernel]) -> None:
    rows, cols = 37, 53
    m = np.arange(rows * cols, dtype=F32).reshape(rows, cols)
    din, dout = upload(gpu, m), gpu.allocate_memory(m.nbytes)
    grid = (blocks(cols, 8), blocks(rows, 8))
    gpu.execute_kernel(kernels["transpose"], grid, (8, 8), [din, dout, I32(rows), I32(cols)])
    np.testing.assert_array_equal(download(gpu, dout, F32, rows * cols).reshape(cols, rows), m.T)


def test_view_as_kernel_arg(gpu: Backend, kernels: dict[str, Kernel]) -> None:
    # 512 bytes in: a multiple of OpenCL's sub-buffer alignment (PoCL's is 128; test_opencl_backend tests others).
    n, start = 1000, 128
    buf = gpu.allocate_memory(4 * n)
    gpu.memset(buf, 0xFF)
    gpu.execute_kernel(kernels["fill_index"], 1, 256, [buf.at(4 * start), I32(100)])
    got = download(gpu, buf, I32, n)
    assert (got[:start] == -1).all() and (got[start + 100:] == -1).all()  # nothing written outside the view
    np.testing.assert_array_equal(got[start:start + 100], np.arange(100))
    np.testing.assert_array_equal(download(gpu, buf.at(4 * start), I32, 100), np.arange(100))
    gpu.free_memory(buf)


# -- modules and kernels -------------------------------------------------------------------------------------------

def test_module_lists_its_kernels(gpu: Backend, module: Module, backend: str) -> None:
    # CUDA lists a module's kernels where its driver can (cuModuleEnumerateFunctions, 12.4 on); OpenCL always can.
    assert set(module.kernel_names) == set(MODULE_KERNELS) or (backend == "cuda" and module.kernel_names == ())
    first, again = gpu.get_kernel(module, "vadd"), gpu.get_kernel(module, "vadd")
    assert (first != again) is NEW_KERNEL_PER_GET[backend]
    assert first.name == again.name == "vadd"


def test_load_get_and_unload_module(gpu: Backend, backend: str) -> None:
    # Source as bytes, with compiler options.
    mod = gpu.load_module(source(backend, "fill_index").encode(), FORMAT[backend], ["-DX=1"])
    assert mod.kernel_names == ("fill_index",) or (backend == "cuda" and mod.kernel_names == ())
    k1, k2 = gpu.get_kernel(mod, "fill_index"), gpu.get_kernel(mod, "fill_index")
    with pytest.raises(NotFound):
        gpu.get_kernel(mod, "two")
    n = 777
    out = gpu.allocate_memory(4 * n)
    gpu.execute_kernel(k2, blocks(n, 256), 256, [out, I32(n)])
    gpu.unload_module(mod)  # a launch already queued still runs
    np.testing.assert_array_equal(download(gpu, out, I32, n), np.arange(n))
    for kernel in (k1, k2):
        with pytest.raises(NotFound):
            gpu.execute_kernel(kernel, 1, 1, [out, I32(1)])
    with pytest.raises(NotFound):
        gpu.get_kernel(mod, "fill_index")
    with pytest.raises(NotFound):
        gpu.unload_module(mod)
    gpu.free_memory(out)


def test_bad_modules(gpu: Backend, backend: str) -> None:
    other = "opencl" if backend == "cuda" else "cuda"
    for image, fmt in ((source(other, "fill_index"), FORMAT[other]), (b"not an elf", ModuleFormat.CUBIN),
                       ("this is not ptx", ModuleFormat.PTX), (b"garbage\xff\xfe", ModuleFormat.FATBIN),
                       (b"", ModuleFormat.PTX)):
        with pytest.raises(InvalidArgument):  # CompileError is an InvalidArgument
            gpu.load_module(image, fmt)
    # A NUL in source text: a compiler would read only up to it (the build "succeeded" with none of the kernels).
    cut = "// nothing here\n\0" + source(backend, "fill_index")
    for image in (cut, cut.encode()):
        with pytest.raises(InvalidArgument, match="NUL character at offset 16"):
            gpu.load_module(image, FORMAT[backend])
    with pytest.raises(NotFound):
        gpu.get_kernel(Module("module-999"), "vadd")
    with pytest.raises(NotFound):
        gpu.unload_module(Module("module-999"))


def test_compile_error_has_log(gpu: Backend, backend: str) -> None:
    with pytest.raises(CompileError) as err:
        gpu.compile_kernel(source(backend, "broken"), "broken")
    assert "undeclared_name" in err.value.log and "error" in err.value.log
    assert "undeclared_name" in str(err.value)  # the message carries the first error
    assert isinstance(err.value, InvalidArgument)


def test_unknown_kernel_name(gpu: Backend, module: Module, backend: str) -> None:
    with pytest.raises(NotFound):
        gpu.compile_kernel(module_source(backend), "no_such_kernel")
    with pytest.raises(NotFound):
        gpu.get_kernel(module, "no_such_kernel")
    with pytest.raises(NotFound):  # (a C string ends at its NUL: the driver alone would find "vadd")
        gpu.get_kernel(module, "vadd\x00")
    with pytest.raises(NotFound):
        gpu.execute_kernel(Kernel("kernel-999", "x"), 1, 1, [])


def test_unknown_handles(gpu: Backend, kernels: dict[str, Kernel]) -> None:
    ghost = Buffer("buf-999999", 16)
    for call in (
        lambda: gpu.copy_h2d(b"x", ghost),
        lambda: gpu.copy_d2h(ghost, bytearray(1)),
        lambda: gpu.memset(ghost, 0),
        lambda: gpu.free_memory(ghost),
        lambda: gpu.synchronize(Stream("stream-999999")),
        lambda: gpu.get_kernel(Module("mod-999999"), "vadd"),
        lambda: gpu.execute_kernel(Kernel("kern-999999", "vadd"), 1, 1, []),
        lambda: gpu.execute_kernel(kernels["fill_index"], 1, 1, [ghost, I32(1)]),
    ):
        with pytest.raises(NotFound):
            call()


def test_argument_checks(gpu: Backend, kernels: dict[str, Kernel]) -> None:
    vadd, saxpy = kernels["vadd"], kernels["saxpy"]
    a = gpu.allocate_memory(1024)
    with pytest.raises(InvalidArgument, match="takes 4") as wrong_count:
        gpu.execute_kernel(vadd, 1, 32, [a, a, a])
    assert not isinstance(wrong_count.value, ArgumentTypeError)
    with pytest.raises(ArgumentTypeError) as bare:
        gpu.execute_kernel(vadd, 1, 32, [a, a, a, 5])  # bare Python int
    assert isinstance(bare.value, TypeError)
    with pytest.raises(ArgumentTypeError, match="arg 0") as wide:
        gpu.execute_kernel(saxpy, 1, 32, [np.float64(1.0), a, a, I32(8)])  # float64 for a float
    assert wide.value.details["index"] == 0
    with pytest.raises(ArgumentTypeError, match="arg 3"):
        gpu.execute_kernel(saxpy, 1, 32, [F32(1), a, a, a])  # a pointer for an int
    with pytest.raises(ArgumentTypeError) as not_pointer:
        gpu.execute_kernel(saxpy, 1, 32, [F32(1), np.int64(0), a, I32(8)])  # 8 bytes, but not a Buffer
    assert not_pointer.value.details["index"] == 1
    with pytest.raises(ArgumentTypeError, match="arg 0"):
        gpu.execute_kernel(saxpy, 1, 32, [I32(1), a, a, I32(8)])  # int where the kernel takes float
    with pytest.raises(ArgumentTypeError, match="arg 0"):
        gpu.execute_kernel(saxpy, 1, 32, [a, a, a, I32(8)])  # a Buffer where the kernel takes float
    with pytest.raises(ArgumentTypeError, match="arg 3"):
        gpu.execute_kernel(saxpy, 1, 32, [F32(1), a, a, F32(8)])  # float where the kernel takes int
    with pytest.raises(ArgumentTypeError, match="arg 3"):
        gpu.execute_kernel(saxpy, 1, 32, [F32(1), a, a, np.uint64(8)])  # 8 bytes where the kernel takes 4
    gpu.execute_kernel(vadd, 1, 256, [a, a, a, I32(8)])  # the right shape still launches
    gpu.execute_kernel(vadd, 1, 256, [a, a, a, np.uint32(8)])  # signedness is not checked
    gpu.synchronize()
    gpu.free_memory(a)


def test_launch_shape_checks(gpu: Backend, kernels: dict[str, Kernel]) -> None:
    a = gpu.allocate_memory(1024)
    args = [a, I32(0)]
    info = gpu.device_info()
    dims, grid_dims, most = info.max_block_dims, info.max_grid_dims, info.max_threads_per_block
    for grid, block in [(0, 32), (1, 0), ((1, 0), 32), (1, most + 1), (1, most * 2), (1, (1, 1, dims[2] + 1)),
                        ((1, grid_dims[1] + 1), 32), (grid_dims[0] + 1, 1),
                        (1, (dims[0], 2, 1))]:  # each extent within its limit, but too many threads in all
        with pytest.raises(InvalidArgument):
            gpu.execute_kernel(kernels["fill_index"], grid, block, args)
    with pytest.raises(InvalidArgument):
        gpu.execute_kernel(kernels["fill_index"], 1, 32, args, shared_mem=-1)
    gpu.synchronize()
    gpu.free_memory(a)


# -- memory --------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("size", [0, 1, 1001, 4097, "large"])
def test_copy_round_trip(gpu: Backend, backend: str, size: int | str) -> None:
    size = LARGE_COPY[backend] if size == "large" else int(size)
    # No two 4-byte words alike (the index times an odd number): a copy that drops, repeats or shifts any byte comes
    # back different. As telling as random bytes, and cheaper to make at 64 MiB.
    data = (np.arange(size // 4 + 1, dtype="<u4") * 0x01000193 + size).view(np.uint8)[:size]
    buf = gpu.allocate_memory(max(size, 1))
    gpu.copy_h2d(data, buf)
    out = np.zeros(size, dtype=np.uint8)
    gpu.copy_d2h(buf, out)
    assert np.array_equal(out, data)  # not np.testing's: a second on 64 MiB
    half = size // 2 + 1 if size else 0
    gpu.copy_h2d(bytes(data[:half]), buf)  # bytes, bytearray and memoryview work too
    back = bytearray(half)
    gpu.copy_d2h(buf, back)
    assert back == data[:half].tobytes()
    view = memoryview(bytearray(size))
    gpu.copy_d2h(buf, view)
    assert np.array_equal(np.frombuffer(view, np.uint8), data)
    gpu.free_memory(buf)


def test_views_and_offsets(gpu: Backend) -> None:
    buf = gpu.allocate_memory(1000)
    gpu.memset(buf, 0)
    gpu.copy_h2d(b"\x07" * 10, buf.at(100), offset=5)  # lands at 105
    gpu.copy_h2d(b"abcd", buf.at(510), offset=5)  # lands at 515
    gpu.copy_h2d(b"", buf.at(1000))  # an empty copy at the very end is legal
    view = buf.at(100).at(5)
    assert view.offset == 105 and view.nbytes == 895
    expected = np.zeros(1000, dtype=np.uint8)
    expected[105:115] = 7
    expected[515:519] = list(b"abcd")
    np.testing.assert_array_equal(download(gpu, buf, np.uint8, 1000), expected)
    part = np.zeros(10, dtype=np.uint8)
    gpu.copy_d2h(view, part)
    assert (part == 7).all()
    assert download(gpu, buf, np.uint8, 4, offset=515).tobytes() == b"abcd"
    assert download(gpu, buf.at(515), np.uint8, 4).tobytes() == b"abcd"
    assert download(gpu, buf.at(507), np.uint8, 4, offset=8).tobytes() == b"abcd"
    with pytest.raises(OutOfRange):
        gpu.copy_d2h(buf.at(995), np.zeros(10, dtype=np.uint8))
    with pytest.raises(OutOfRange):
        gpu.copy_h2d(b"x" * 11, buf, offset=990)
    with pytest.raises(InvalidArgument):
        gpu.copy_h2d(b"x", buf, offset=-1)
    with pytest.raises(InvalidArgument):
        gpu.copy_d2h(buf, b"read-only")
    # A forged size cannot reach past the real allocation.
    with pytest.raises(OutOfRange):
        gpu.copy_d2h(Buffer(buf.handle, 1 << 30), np.zeros(2000, dtype=np.uint8))
    gpu.free_memory(buf)


def test_range_errors(gpu: Backend) -> None:
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
    gpu.free_memory(buf)


def test_memset(gpu: Backend) -> None:
    buf = gpu.allocate_memory(256)
    expected = np.empty(256, np.uint8)
    gpu.memset(buf, 0xAB)
    expected[:] = 0xAB
    gpu.memset(buf, 0x01, size=16, offset=8)
    expected[8:24] = 1
    gpu.memset(buf.at(40), 0xCD, size=16, offset=4)  # a view and an offset into it
    expected[44:60] = 0xCD
    gpu.memset(buf.at(200), 0x02)  # to the end of the view
    expected[200:] = 2
    gpu.memset(buf, 0x03, size=0, offset=256)
    np.testing.assert_array_equal(download(gpu, buf, np.uint8, 256), expected)
    for bad in (256, -1, 1.5, True):
        with pytest.raises(InvalidArgument):
            gpu.memset(buf, bad)  # type: ignore[arg-type]
    with pytest.raises(OutOfRange):
        gpu.memset(buf, 0, size=10, offset=250)
    with pytest.raises(OutOfRange):
        gpu.memset(buf.at(250), 0, size=7)
    gpu.free_memory(buf)


def test_copy_d2d(gpu: Backend) -> None:
    data = np.arange(256, dtype=np.uint8)
    src, dst = upload(gpu, data), gpu.allocate_memory(256)
    gpu.memset(dst, 0)
    want_src, want_dst = data.copy(), np.zeros(256, np.uint8)  # what the device should hold after the copies
    gpu.copy_d2d(src, dst, 100, src_offset=10, dst_offset=50)
    want_dst[50:150] = want_src[10:110]
    gpu.copy_d2d(src.at(16), dst.at(160), 50, src_offset=4, dst_offset=8)  # views and offsets
    want_dst[168:218] = want_src[20:70]
    gpu.copy_d2d(src, dst, 0, 256, 256)  # an empty copy at the very end is legal
    gpu.copy_d2d(src.at(200), src, 50)  # same buffer, disjoint ranges
    want_src[:50] = want_src[200:250]
    gpu.copy_d2d(src, src, 16, src_offset=0, dst_offset=128)
    want_src[128:144] = want_src[:16]
    np.testing.assert_array_equal(download(gpu, dst, np.uint8, 256), want_dst)
    np.testing.assert_array_equal(download(gpu, src, np.uint8, 256), want_src)
    for size, src_offset, dst_offset in ((100, 0, 50), (16, 0, 8)):
        with pytest.raises(InvalidArgument, match="overlap"):
            gpu.copy_d2d(src, src, size, src_offset, dst_offset)
    with pytest.raises(OutOfRange):
        gpu.copy_d2d(src, dst, 100, src_offset=200)
    with pytest.raises(OutOfRange):
        gpu.copy_d2d(src, dst.at(250), 7)
    with pytest.raises(OutOfRange):
        gpu.copy_d2d(src.at(250), dst, 7)
    with pytest.raises(InvalidArgument):
        gpu.copy_d2d(src, dst, 10, src_offset=-1)
    gpu.free_memory(src)
    gpu.free_memory(dst)


def test_allocation_limits_and_frees(gpu: Backend) -> None:
    for bad in (0, -1, -5, 1.0, 1.5):
        with pytest.raises(InvalidArgument):
            gpu.allocate_memory(bad)  # type: ignore[arg-type]
    with pytest.raises(ResourceExhausted):
        gpu.allocate_memory(gpu.device_info().total_memory + 1)
    buf = gpu.allocate_memory(8)
    gpu.free_memory(buf)
    with pytest.raises(NotFound):
        gpu.free_memory(buf)
    with pytest.raises(NotFound):
        gpu.copy_h2d(b"x", buf)
    with pytest.raises(NotFound):
        gpu.free_memory(Buffer("buf-999", 10))
    other = gpu.allocate_memory(16)
    gpu.free_memory(Buffer(other.handle, 0))  # the worker frees with size 0: only the handle counts
    with pytest.raises(NotFound):
        gpu.free_memory(other)


# -- streams and events --------------------------------------------------------------------------------------------

def test_streams(gpu: Backend, kernels: dict[str, Kernel]) -> None:
    n = 1 << 20
    fill = kernels["fill_index"]
    s1, s2 = gpu.create_stream(), gpu.create_stream()
    assert s1 != s2
    b1, b2 = gpu.allocate_memory(4 * n), gpu.allocate_memory(4 * n)
    gpu.memset(b1, 0, stream=s1)
    gpu.execute_kernel(fill, blocks(n, 256), 256, [b1, I32(n)], stream=s1)
    gpu.execute_kernel(fill, blocks(n, 256), 256, [b2, I32(n // 2)], stream=s2)
    gpu.synchronize(s1)
    gpu.synchronize(s2)
    np.testing.assert_array_equal(download(gpu, b1, I32, n), np.arange(n))
    out = np.empty(n // 2, dtype=I32)
    gpu.copy_d2h(b2, out, stream=s2)
    np.testing.assert_array_equal(out, np.arange(n // 2))
    # A copy on one stream, which the host waits for, is there for a read on the other.
    gpu.memset(b2, 0, stream=s2)
    gpu.synchronize(s2)
    gpu.copy_d2d(b1, b2, 4 * n, stream=s1)
    gpu.synchronize(s1)
    gpu.copy_d2h(b2, out, stream=s2)
    np.testing.assert_array_equal(out, np.arange(n // 2))
    gpu.memset(b2, 0, stream=s1)
    gpu.synchronize(s1)
    gpu.copy_d2d(b1, b2, 4 * n, stream=s2)
    gpu.destroy_stream(s2)  # waits for the copy first
    np.testing.assert_array_equal(download(gpu, b2, I32, n), np.arange(n))
    with pytest.raises(NotFound):
        gpu.destroy_stream(s2)
    with pytest.raises(NotFound):
        gpu.synchronize(s2)
    with pytest.raises(NotFound):
        gpu.synchronize(Stream("stream-999"))
    with pytest.raises(NotFound):
        gpu.copy_h2d(b"x", b1, stream=s2)
    with pytest.raises(InvalidArgument):
        gpu.destroy_stream(None)  # type: ignore[arg-type]
    gpu.synchronize()
    gpu.destroy_stream(s1)
    with pytest.raises(NotFound):
        gpu.destroy_stream(s1)
    gpu.free_memory(b1)
    gpu.free_memory(b2)


def test_a_stream_waits_on_the_device_for_another_streams_event(gpu: Backend, kernels: dict[str, Kernel],
                                                                 backend: str) -> None:
    spin, n, iters = kernels["spin"], 256, I32(SLOW_SPIN[backend])
    ref = upload(gpu, np.zeros(n, dtype=F32))
    gpu.execute_kernel(spin, n // 64, 64, [ref, iters])
    expected = download(gpu, ref, F32, n)
    assert np.all(expected > 0)
    a, b = gpu.create_stream(), gpu.create_stream()
    buf = upload(gpu, np.zeros(n, dtype=F32))
    gpu.synchronize()
    ev = gpu.create_event()
    gpu.execute_kernel(spin, n // 64, 64, [buf, iters], stream=a)
    gpu.record_event(ev, a)
    gpu.wait_event(ev, b)  # the host goes on: stream b waits on the device
    got = np.empty(n, dtype=F32)
    gpu.copy_d2h(buf, got, stream=b)
    np.testing.assert_array_equal(got, expected)
    gpu.synchronize_event(ev)
    gpu.destroy_event(ev)
    with pytest.raises(NotFound, match="event"):
        gpu.synchronize_event(ev)
    with pytest.raises(NotFound, match="event"):
        gpu.record_event(ev)
    never = gpu.create_event()
    gpu.wait_event(never, b)  # never recorded: complete (CUDA's rule, which OpenCL follows)
    gpu.wait_event(never)
    gpu.synchronize_event(never)
    gpu.synchronize(b)
    gpu.destroy_event(never)
    gpu.destroy_stream(a)
    gpu.destroy_stream(b)
    with pytest.raises(InvalidArgument, match="Event"):
        gpu.wait_event("e-1")  # type: ignore[arg-type]
    gpu.free_memory(ref)
    gpu.free_memory(buf)


# -- device time ---------------------------------------------------------------------------------------------------

SPIN_ITEMS = 256
SPIN_ITERS = 40_000  # ~10-20 ms of PoCL CPU time for 256 work-items; ~0.1 ms on a GPU


def run_spin(gpu: Backend, spin: Kernel, out: Buffer, iters: int, stream: Stream | None = None) -> None:
    gpu.execute_kernel(spin, SPIN_ITEMS // 64, 64, [out, I32(iters)], stream=stream)


def test_device_time_is_zero_when_nothing_ran(backend: str) -> None:
    device = unopened(backend)
    assert device.take_device_time() == 0.0  # before initialize: nothing to charge, nothing raised
    with device:
        assert device.take_device_time() == 0.0  # right after initialize
        assert device.take_device_time() == 0.0


def test_device_time_scales_with_kernel_work(gpu: Backend, kernels: dict[str, Kernel]) -> None:
    spin, out = kernels["spin"], gpu.allocate_memory(SPIN_ITEMS * 4)
    run_spin(gpu, spin, out, 100)  # warm-up: module load, clocks up (PoCL builds its work-group function)
    gpu.take_device_time()
    # The longer run first: clocks that are still rising can only widen the gap.
    run_spin(gpu, spin, out, 4 * SPIN_ITERS)
    four = gpu.take_device_time()  # no synchronize first: the take waits itself
    assert gpu.take_device_time() < 1e-3  # the tally was reset and nothing ran since
    run_spin(gpu, spin, out, SPIN_ITERS)
    one = gpu.take_device_time()
    assert one > 0
    assert four > 1.5 * one, (one, four)
    # Two launches are charged together, and nothing is left for the next take.
    run_spin(gpu, spin, out, SPIN_ITERS)
    run_spin(gpu, spin, out, SPIN_ITERS)
    two = gpu.take_device_time()
    assert two > 0 and gpu.take_device_time() == 0.0
    gpu.free_memory(out)


def test_device_time_waits_for_queued_work(gpu: Backend, kernels: dict[str, Kernel]) -> None:
    """take_device_time needs no synchronize first: it waits itself, on every stream."""
    spin = kernels["spin"]
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
    gpu.free_memory(out1)
    gpu.free_memory(out2)


def test_device_time_counts_copies_and_memsets(gpu: Backend, backend: str) -> None:
    n = LARGE_COPY[backend]
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


def test_kept_copy_events_do_not_pin_host_buffers(gpu: Backend) -> None:
    """What a copy keeps for the device-time take must not keep the caller's buffer exported."""
    buf = gpu.allocate_memory(64)
    src, dst = bytearray(b"x" * 64), bytearray(64)
    gpu.copy_h2d(src, buf)
    gpu.copy_d2h(buf, dst)
    src.extend(b"more")  # raises BufferError while an export of the bytearray is alive
    dst.extend(b"more")
    assert bytes(dst[:64]) == b"x" * 64
    gpu.free_memory(buf)


def test_device_time_survives_close(backend: str) -> None:
    with unopened(backend) as device:
        buf = device.allocate_memory(1 << 20)
        device.memset(buf, 1)
    assert device.take_device_time() > 0  # close waited for the memset; its time is still charged
    assert device.take_device_time() == 0.0


# -- the worker's executor on the backend --------------------------------------------------------------------------

def _scalar_arg(value: np.generic) -> ScalarArg:
    return ScalarArg(value.dtype.str, value.tobytes())


def test_worker_launches_pack_views_and_scalars_and_recheck_each_shape(gpu: Backend, backend: str) -> None:
    executor = Executor(gpu, HandleTables(), SegmentTable(gpu))
    ack = executor.run("s", Batch(1, 0, [LoadModule("m", FORMAT[backend].value, module_source(backend).encode(), []),
                                         GetKernel("saxpy", "m", "saxpy")]))
    assert ack.error is None, ack.error
    n = 256
    x, y = np.arange(n, dtype=F32), np.ones(n, dtype=F32)
    launch = Launch("saxpy", (2,), (64,), [_scalar_arg(F32(2.0)), BufferArg("x", 0), BufferArg("y", 256),
                                           _scalar_arg(I32(128))])
    ack = executor.run("s", Batch(2, 0, [Allocate("x", 4 * n), Allocate("y", 4 * n), Write(("x", 0), 0, x.tobytes()),
                                         Write(("y", 0), 0, y.tobytes()), launch, launch,
                                         Read(("y", 0), 0, 4 * n)]))
    assert ack.error is None, ack.error
    got = np.frombuffer(ack.result, dtype=F32)
    # y's view starts 64 floats in: 128 of them got 2 * x + y twice, the rest are untouched.
    assert np.array_equal(got[64:192], 1 + 4 * x[:128]) and np.all(got[:64] == 1) and np.all(got[192:] == 1)
    # The same arguments with a shape the device refuses: the shapes that passed before do not vouch for it.
    too_big = Launch("saxpy", (2,), (gpu.device_info().max_threads_per_block + 1,), launch.args)
    ack = executor.run("s", Batch(3, 10, [launch, too_big]))
    assert ack.done == 1 and ack.error is not None and ack.error.seq == 11 and ack.error.type == "InvalidArgument"
    # A freed buffer takes its prepared launches with it: the handle is unknown, not a dangling pointer.
    ack = executor.run("s", Batch(4, 20, [Free("y"), launch]))
    assert ack.done == 1 and ack.error is not None and ack.error.type == "NotFound", ack.error
    # A wrong scalar width is refused at the first launch, as by execute_kernel.
    bad = Launch("saxpy", (1,), (1,), [_scalar_arg(np.float64(2.0)), BufferArg("x", 0), BufferArg("x", 0),
                                       _scalar_arg(I32(1))])
    ack = executor.run("s", Batch(5, 30, [bad]))
    assert ack.error is not None and ack.error.type == "ArgumentTypeError", ack.error
    executor.run("s", Batch(6, 40, [Free("x")]))


def test_events_as_commands_through_the_executor(gpu: Backend) -> None:
    executor = Executor(gpu, HandleTables(), SegmentTable(gpu))
    s, e = new_handle("stream"), new_handle("event")
    ack = executor.run("s1", Batch(1, 0, [CreateStream(s), CreateEvent(e), RecordEvent(e, s), WaitEvent(e, ""),
                                          SynchronizeEvent(e), DestroyEvent(e)]))
    assert ack.error is None and ack.done == 6
    ack = executor.run("s1", Batch(2, 6, [SynchronizeEvent(e)]))
    assert ack.error is not None and ack.error.code == "NOT_FOUND" and ack.error.seq == 6
    executor.run("s2", Batch(3, 0, [CreateEvent(e)]))
    ack = executor.run("s1", Batch(4, 0, [WaitEvent(e, s)]))  # another session's event
    assert ack.error is not None and ack.error.message == f"no event {e!r} in this session"
