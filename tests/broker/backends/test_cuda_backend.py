"""CudaBackend against a real NVIDIA GPU (run with -m cuda): results checked with numpy."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")

from gpubroker.broker import samples  # noqa: E402
from gpubroker.broker.backends import _cuda_timing  # noqa: E402
from gpubroker.broker.backends._cuda import CudaBackend, list_cuda_devices  # noqa: E402
from gpubroker.broker.worker._executor import Executor  # noqa: E402
from gpubroker.broker.worker._handles import HandleTables  # noqa: E402
from gpubroker.broker.worker._segments import SegmentTable  # noqa: E402
from gpubroker.client import (  # noqa: E402
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
from gpubroker.wire.commands import (  # noqa: E402
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

pytestmark = pytest.mark.cuda

SOURCE = r"""
extern "C" __global__ void vadd(const float* a, const float* b, float* c, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) c[i] = a[i] + b[i];
}

extern "C" __global__ void saxpy(float alpha, const float* x, float* y, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = alpha * x[i] + y[i];
}

extern "C" __global__ void block_sum(const float* x, float* out, int n) {
    extern __shared__ float scratch[];
    int t = threadIdx.x;
    int i = blockIdx.x * blockDim.x + t;
    scratch[t] = i < n ? x[i] : 0.0f;
    __syncthreads();
    for (int k = blockDim.x / 2; k > 0; k >>= 1) {
        if (t < k) scratch[t] += scratch[t + k];
        __syncthreads();
    }
    if (t == 0) out[blockIdx.x] = scratch[0];
}

extern "C" __global__ void fill2d(int* out, int w, int h) {
    int x = blockIdx.x * blockDim.x + threadIdx.x;
    int y = blockIdx.y * blockDim.y + threadIdx.y;
    if (x < w && y < h) out[y * w + x] = y * 10000 + x;
}

extern "C" __global__ void fill_index(int* out, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = i;
}
"""

F32 = np.float32


@pytest.fixture
def gpu() -> Iterator[CudaBackend]:
    with CudaBackend(0) as backend:
        yield backend


@pytest.fixture
def module(gpu: CudaBackend) -> Module:
    return gpu.load_module(SOURCE, ModuleFormat.CUDA_C)


def upload(gpu: CudaBackend, arr: np.ndarray) -> Buffer:
    buf = gpu.allocate_memory(arr.nbytes)
    gpu.copy_h2d(arr, buf)
    return buf


def download(gpu: CudaBackend, buf: Buffer, dtype: type, count: int, offset: int = 0) -> np.ndarray:
    out = np.empty(count, dtype=dtype)
    gpu.copy_d2h(buf, out, offset)
    return out


def blocks(n: int, block: int) -> int:
    return (n + block - 1) // block


def nvrtc_compile(source: str, option: str) -> tuple[bytes, bytes]:
    """(ptx, cubin-or-empty) straight from NVRTC, bypassing the backend."""
    from cupy.cuda import nvrtc

    prog = nvrtc.createProgram(source, "test.cu", (), ())
    try:
        nvrtc.compileProgram(prog, (option,))
        return nvrtc.getPTX(prog), (nvrtc.getCUBIN(prog) if "sm_" in option else b"")
    finally:
        nvrtc.destroyProgram(prog)


# -- device ----------------------------------------------------------------------------------------

def test_device_info_is_real(gpu: CudaBackend) -> None:
    info = gpu.device_info()
    assert isinstance(gpu, GpuCompute)
    assert info.vendor == "NVIDIA" and info.backend == "cuda" and info.name
    assert info.total_memory > info.free_memory > 0
    assert info.multiprocessor_count > 0 and info.clock_mhz > 0 and info.l2_cache_bytes > 0
    assert info.max_threads_per_block >= 1024 and info.max_block_dims[0] >= 1024
    assert info.max_grid_dims[0] >= 2**31 - 1
    assert info.compute_capability is not None and info.compute_capability >= (7, 0)
    major, minor = info.driver_version.split(".")
    assert int(major) >= 12 and minor.isdigit()
    listed = list_cuda_devices()
    assert listed[0].name == info.name and listed[0].total_memory == info.total_memory
    print("DEVICE", info)


LIST_SCRIPT = r"""
import json
from gpubroker.broker.backends._cuda import list_cuda_devices
from gpubroker.broker.backends._cuda_driver import driver_extras
devices = list_cuda_devices()
print("RESULT" + json.dumps({"count": len(devices), "free": devices[0].free_memory, "total": devices[0].total_memory,
                             "active_after": driver_extras().primary_context_active(0)}))
"""


def test_listing_devices_leaves_no_context() -> None:
    # A fresh process: listing must not keep a ~500 MiB context on every GPU it looked at.
    proc = subprocess.run([sys.executable, "-c", LIST_SCRIPT], capture_output=True, text=True, timeout=120)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT")), None)
    assert line is not None, proc.stdout + proc.stderr
    result = json.loads(line[len("RESULT"):])
    assert result["count"] >= 1 and 0 < result["free"] <= result["total"]
    assert result["active_after"] is False


def test_usable_from_another_thread(gpu: CudaBackend, module: Module) -> None:
    n = 1000
    buf = gpu.allocate_memory(4 * n)
    kern = gpu.get_kernel(module, "fill_index")

    def work() -> np.ndarray:
        gpu.execute_kernel(kern, blocks(n, 128), 128, [buf, np.int32(n)])
        return download(gpu, buf, np.int32, n)

    with ThreadPoolExecutor(1) as pool:
        np.testing.assert_array_equal(pool.submit(work).result(), np.arange(n))


def test_bad_device_index() -> None:
    backend = CudaBackend(99)
    with pytest.raises(NotFound):
        backend.initialize()
    with pytest.raises(InvalidArgument):
        CudaBackend("0")  # type: ignore[arg-type]


def test_close_is_idempotent_and_final() -> None:
    backend = CudaBackend(0)
    with pytest.raises(FailedPrecondition):
        backend.allocate_memory(16)  # not initialized yet
    backend.initialize()
    backend.initialize()
    buf = backend.allocate_memory(1 << 20)
    backend.close()
    backend.close()
    for call in (lambda: backend.allocate_memory(16), lambda: backend.free_memory(buf), backend.device_info,
                 backend.initialize, backend.synchronize):
        with pytest.raises(FailedPrecondition):
            call()


# -- kernels ---------------------------------------------------------------------------------------

def test_vector_add(gpu: CudaBackend, module: Module) -> None:
    n = 1_000_003
    a, b = np.arange(n, dtype=F32), np.arange(n, dtype=F32) * 2
    da, db, dc = upload(gpu, a), upload(gpu, b), gpu.allocate_memory(a.nbytes)
    vadd = gpu.get_kernel(module, "vadd")
    gpu.execute_kernel(vadd, blocks(n, 256), 256, [da, db, dc, np.int32(n)])
    gpu.synchronize()
    np.testing.assert_array_equal(download(gpu, dc, F32, n), a + b)


def test_saxpy_with_compile_kernel(gpu: CudaBackend) -> None:
    n = 4099
    x, y = np.linspace(0, 1, n, dtype=F32), np.linspace(3, 4, n, dtype=F32)
    dx, dy = upload(gpu, x), upload(gpu, y)
    saxpy = gpu.compile_kernel(SOURCE, "saxpy")
    gpu.execute_kernel(saxpy, [blocks(n, 128)], [128], [F32(2.5), dx, dy, np.int32(n)])
    np.testing.assert_allclose(download(gpu, dy, F32, n), F32(2.5) * x + y, rtol=1e-6)


def test_shared_memory_reduction(gpu: CudaBackend, module: Module) -> None:
    n, block = 100_003, 256
    x = (np.arange(n) % 7).astype(F32)
    dx, dout = upload(gpu, x), gpu.allocate_memory(blocks(n, block) * 4)
    kern = gpu.get_kernel(module, "block_sum")
    gpu.execute_kernel(kern, blocks(n, block), block, [dx, dout, np.int32(n)], shared_mem=block * 4)
    padded = np.zeros(blocks(n, block) * block, dtype=F32)
    padded[:n] = x
    expected = padded.reshape(-1, block).sum(axis=1)
    np.testing.assert_array_equal(download(gpu, dout, F32, blocks(n, block)), expected)
    # More than 48 KiB of dynamic shared memory needs the per-function opt-in.
    gpu.execute_kernel(kern, blocks(n, block), block, [dx, dout, np.int32(n)], shared_mem=100 * 1024)
    np.testing.assert_array_equal(download(gpu, dout, F32, blocks(n, block)), expected)
    with pytest.raises(InvalidArgument):
        gpu.execute_kernel(kern, 1, block, [dx, dout, np.int32(n)], shared_mem=10 << 20)


def test_2d_kernel(gpu: CudaBackend, module: Module) -> None:
    w, h = 1000, 517
    out = gpu.allocate_memory(w * h * 4)
    kern = gpu.get_kernel(module, "fill2d")
    gpu.execute_kernel(kern, (blocks(w, 16), blocks(h, 16)), (16, 16), [out, np.int32(w), np.int32(h)])
    ys, xs = np.mgrid[0:h, 0:w]
    np.testing.assert_array_equal(download(gpu, out, np.int32, w * h).reshape(h, w), ys * 10000 + xs)


def test_view_as_kernel_arg(gpu: CudaBackend, module: Module) -> None:
    n = 1000
    buf = gpu.allocate_memory(4 * n)
    gpu.memset(buf, 0xFF)
    kern = gpu.get_kernel(module, "fill_index")
    gpu.execute_kernel(kern, 1, 256, [buf.at(400), np.int32(100)])
    got = download(gpu, buf, np.int32, n)
    assert (got[:100] == -1).all() and (got[200:] == -1).all()
    np.testing.assert_array_equal(got[100:200], np.arange(100))


def test_load_module_lists_kernels_and_caches(gpu: CudaBackend, module: Module) -> None:
    print("KERNEL_NAMES", module.kernel_names)
    assert set(module.kernel_names) >= {"vadd", "saxpy", "block_sum", "fill2d"} or module.kernel_names == ()
    assert gpu.get_kernel(module, "vadd") == gpu.get_kernel(module, "vadd")


def check_image(gpu: CudaBackend, image: str | bytes, fmt: ModuleFormat) -> None:
    n = 777
    mod = gpu.load_module(image, fmt)
    out = gpu.allocate_memory(4 * n)
    kern = gpu.get_kernel(mod, "fill_index")
    gpu.execute_kernel(kern, blocks(n, 128), 128, [out, np.int32(n)])
    np.testing.assert_array_equal(download(gpu, out, np.int32, n), np.arange(n))
    gpu.unload_module(mod)
    with pytest.raises(NotFound):
        gpu.execute_kernel(kern, 1, 1, [out, np.int32(1)])
    with pytest.raises(NotFound):
        gpu.get_kernel(mod, "fill_index")


def arch(gpu: CudaBackend) -> str:
    return "".join(map(str, gpu.device_info().compute_capability or (0, 0)))


def test_load_ptx(gpu: CudaBackend) -> None:
    ptx, _ = nvrtc_compile(SOURCE, f"-arch=compute_{arch(gpu)}")
    try:
        check_image(gpu, ptx, ModuleFormat.PTX)
    except CompileError as exc:
        if exc.details.get("cuda_error") == 222:  # NVRTC's PTX ISA is newer than the driver's JIT
            pytest.skip(f"driver cannot JIT this NVRTC's PTX: {exc}")
        raise
    check_image(gpu, ptx.rstrip(b"\0").decode(), ModuleFormat.PTX)


def test_load_cubin(gpu: CudaBackend) -> None:
    _, cubin = nvrtc_compile(SOURCE, f"-arch=sm_{arch(gpu)}")
    check_image(gpu, cubin, ModuleFormat.CUBIN)


def test_load_fatbin_with_nvcc(gpu: CudaBackend) -> None:
    nvcc = shutil.which("nvcc") or next((p for p in ("/usr/local/cuda/bin/nvcc",) if os.path.exists(p)), None)
    if nvcc is None:
        pytest.skip("nvcc not available")
    major, minor = gpu.device_info().compute_capability or (0, 0)
    with tempfile.TemporaryDirectory() as tmp:
        src, out = os.path.join(tmp, "k.cu"), os.path.join(tmp, "k.fatbin")
        with open(src, "w") as f:
            f.write(SOURCE)
        subprocess.run([nvcc, "-fatbin", f"-arch=sm_{major}{minor}", src, "-o", out], check=True)
        with open(out, "rb") as f:
            image = f.read()
    mod = gpu.load_module(image, ModuleFormat.FATBIN)
    n = 300
    buf = gpu.allocate_memory(4 * n)
    gpu.execute_kernel(gpu.get_kernel(mod, "fill_index"), 3, 128, [buf, np.int32(n)])
    np.testing.assert_array_equal(download(gpu, buf, np.int32, n), np.arange(n))


def test_bad_modules(gpu: CudaBackend) -> None:
    with pytest.raises(InvalidArgument):
        gpu.load_module("__kernel void k() {}", ModuleFormat.OPENCL_C)
    with pytest.raises(InvalidArgument):
        gpu.load_module(b"not an elf", ModuleFormat.CUBIN)
    with pytest.raises(InvalidArgument):  # CompileError is an InvalidArgument
        gpu.load_module("this is not ptx", ModuleFormat.PTX)
    with pytest.raises(InvalidArgument):
        gpu.load_module(b"garbage\xff\xfe", ModuleFormat.FATBIN)
    with pytest.raises(InvalidArgument):
        gpu.load_module(b"", ModuleFormat.PTX)
    with pytest.raises(NotFound):
        gpu.get_kernel(Module("module-999"), "vadd")
    with pytest.raises(NotFound):
        gpu.unload_module(Module("module-999"))


def test_compile_error_has_log(gpu: CudaBackend) -> None:
    with pytest.raises(CompileError) as err:
        gpu.compile_kernel('extern "C" __global__ void broken(int* p) { p[0] = undefined_name; }', "broken")
    assert "undefined_name" in err.value.log and "error" in err.value.log
    assert isinstance(err.value, InvalidArgument)


def test_unknown_kernel_name(gpu: CudaBackend, module: Module) -> None:
    with pytest.raises(NotFound):
        gpu.compile_kernel(SOURCE, "no_such_kernel")
    with pytest.raises(NotFound):
        gpu.get_kernel(module, "no_such_kernel")
    with pytest.raises(NotFound):
        gpu.execute_kernel(Kernel("kernel-999", "x"), 1, 1, [])


def test_argument_checks(gpu: CudaBackend, module: Module) -> None:
    vadd = gpu.get_kernel(module, "vadd")
    saxpy = gpu.get_kernel(module, "saxpy")
    a = gpu.allocate_memory(1024)
    with pytest.raises(InvalidArgument) as wrong_count:
        gpu.execute_kernel(vadd, 1, 32, [a, a, a])
    assert not isinstance(wrong_count.value, ArgumentTypeError)
    with pytest.raises(ArgumentTypeError):
        gpu.execute_kernel(vadd, 1, 32, [a, a, a, 5])  # bare Python int
    with pytest.raises(ArgumentTypeError) as wide:
        gpu.execute_kernel(saxpy, 1, 32, [np.float64(1.0), a, a, np.int32(8)])  # float64 for a float
    assert wide.value.details["index"] == 0
    with pytest.raises(ArgumentTypeError):
        gpu.execute_kernel(saxpy, 1, 32, [F32(1), a, a, a])  # a pointer for an int
    with pytest.raises(ArgumentTypeError) as not_pointer:
        gpu.execute_kernel(saxpy, 1, 32, [F32(1), np.int64(0), a, np.int32(8)])  # 8 bytes, but not a Buffer
    assert not_pointer.value.details["index"] == 1
    with pytest.raises(ArgumentTypeError):
        gpu.execute_kernel(saxpy, 1, 32, [np.int32(1), a, a, np.int32(8)])  # int where the kernel takes float
    with pytest.raises(ArgumentTypeError):
        gpu.execute_kernel(saxpy, 1, 32, [F32(1), a, a, F32(8)])  # float where the kernel takes int
    gpu.execute_kernel(vadd, 1, 32, [a, a, a, np.int32(8)])  # the right shape still launches
    gpu.execute_kernel(vadd, 1, 32, [a, a, a, np.uint32(8)])  # signedness is not checked
    gpu.synchronize()


def test_signature_parsing() -> None:
    from gpubroker.broker.backends._cuda_sig import param_kinds

    src = r"""
    typedef float real;
    // __global__ void commented(int* x)
    extern "C" __global__ void __launch_bounds__(256, 2)
    lb(const float* __restrict__ a, unsigned long long n, real r, int32_t k, float v[], __half h) {}
    extern "C" __global__ void noargs(void) {}
    extern "C" __global__ void decl(int* p, double d);
    extern "C" __global__ void decl(int* p, double d) { }
    #if 1
    extern "C" __global__ void twice(int* p) {}
    #else
    extern "C" __global__ void twice(float p) {}
    #endif
    """
    kinds = param_kinds(src, "lb", 6)
    assert kinds is not None
    assert [(k.kind, k.is_float) for k in kinds] == [
        ("pointer", False), ("scalar", False), ("unknown", False), ("scalar", False), ("pointer", False),
        ("scalar", True)]
    assert param_kinds(src, "lb", 5) is None  # disagrees with the driver's count: not trusted
    assert param_kinds(src, "noargs", 0) == []
    assert [k.kind for k in param_kinds(src, "decl", 2) or []] == ["pointer", "scalar"]
    assert param_kinds(src, "twice", 1) is None
    assert param_kinds(src, "commented", 1) is None


def test_launch_shape_checks(gpu: CudaBackend, module: Module) -> None:
    vadd = gpu.get_kernel(module, "vadd")
    a = gpu.allocate_memory(1024)
    args = [a, a, a, np.int32(0)]
    info = gpu.device_info()
    for grid, block in [(0, 32), (1, 0), ((1, 0), 32), (1, info.max_threads_per_block * 2), (1, (1, 1, 128)),
                        ((1, info.max_grid_dims[1] + 1), 32), (1, (32, 32, 2))]:
        with pytest.raises(InvalidArgument):
            gpu.execute_kernel(vadd, grid, block, args)
    with pytest.raises(InvalidArgument):
        gpu.execute_kernel(vadd, 1, 32, args, shared_mem=-1)
    gpu.synchronize()


# -- memory ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("size", [0, 1, 4097, 64 << 20])
def test_copy_round_trip(gpu: CudaBackend, size: int) -> None:
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
    buf = gpu.allocate_memory(max(size, 1))
    gpu.copy_h2d(data, buf)
    out = np.zeros(size, dtype=np.uint8)
    gpu.copy_d2h(buf, out)
    np.testing.assert_array_equal(out, data)
    if size:
        gpu.copy_h2d(bytes(data[:size // 2 + 1]), buf)  # bytes and bytearray work too
        back = bytearray(size // 2 + 1)
        gpu.copy_d2h(buf, back)
        assert bytes(back) == bytes(data[:size // 2 + 1])


def test_views_and_offsets(gpu: CudaBackend) -> None:
    buf = gpu.allocate_memory(1000)
    gpu.memset(buf, 0)
    gpu.copy_h2d(b"\x07" * 10, buf.at(100), offset=5)  # lands at 105
    view = buf.at(100).at(5)
    assert view.offset == 105 and view.nbytes == 895
    got = download(gpu, buf, np.uint8, 1000)
    assert (got[105:115] == 7).all() and got[:105].sum() == 0 and got[115:].sum() == 0
    part = np.zeros(10, dtype=np.uint8)
    gpu.copy_d2h(view, part)
    assert (part == 7).all()
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


def test_memset(gpu: CudaBackend) -> None:
    buf = gpu.allocate_memory(256)
    gpu.memset(buf, 0xAB)
    gpu.memset(buf, 0x01, size=16, offset=8)
    gpu.memset(buf.at(200), 0x02)  # to the end of the view
    gpu.memset(buf, 0x03, size=0, offset=256)
    got = download(gpu, buf, np.uint8, 256)
    assert (got[:8] == 0xAB).all() and (got[8:24] == 1).all() and (got[24:200] == 0xAB).all()
    assert (got[200:] == 2).all()
    for bad in (256, -1, 1.5, True):
        with pytest.raises(InvalidArgument):
            gpu.memset(buf, bad)  # type: ignore[arg-type]
    with pytest.raises(OutOfRange):
        gpu.memset(buf, 0, size=10, offset=250)


def test_copy_d2d(gpu: CudaBackend) -> None:
    src = upload(gpu, np.arange(256, dtype=np.uint8))
    dst = gpu.allocate_memory(256)
    gpu.memset(dst, 0)
    gpu.copy_d2d(src, dst, 100, src_offset=10, dst_offset=50)
    gpu.copy_d2d(src.at(200), src, 50)  # same buffer, disjoint ranges
    gpu.copy_d2d(src, dst, 0, 256, 256)
    got, again = download(gpu, dst, np.uint8, 256), download(gpu, src, np.uint8, 256)
    np.testing.assert_array_equal(got[50:150], np.arange(10, 110))
    assert got[:50].sum() == 0 and got[150:].sum() == 0
    np.testing.assert_array_equal(again[:50], np.arange(200, 250))
    with pytest.raises(InvalidArgument):
        gpu.copy_d2d(src, src, 100, 0, 50)  # overlap
    with pytest.raises(OutOfRange):
        gpu.copy_d2d(src, dst, 100, src_offset=200)
    with pytest.raises(InvalidArgument):
        gpu.copy_d2d(src, dst, 10, src_offset=-1)


def test_allocation_accounting_and_limits(gpu: CudaBackend) -> None:
    for bad in (0, -1, 1.0):
        with pytest.raises(InvalidArgument):
            gpu.allocate_memory(bad)  # type: ignore[arg-type]
    info = gpu.device_info()
    with pytest.raises(ResourceExhausted):
        gpu.allocate_memory(info.total_memory + 1)
    before = gpu.device_info().free_memory
    buf = gpu.allocate_memory(1 << 30)
    assert gpu.allocated_bytes == 1 << 30
    assert gpu.device_info().free_memory <= before - (1 << 30) + (64 << 20)
    gpu.free_memory(buf)
    assert gpu.allocated_bytes == 0
    assert gpu.device_info().free_memory >= before - (64 << 20)  # really freed, no pool keeps it
    with pytest.raises(NotFound):
        gpu.free_memory(buf)
    with pytest.raises(NotFound):
        gpu.copy_h2d(b"x", buf)
    with pytest.raises(NotFound):
        gpu.free_memory(Buffer("buf-999", 10))
    # Two allocations that cannot both fit: the second fails cleanly in cudaMalloc.
    big = int(gpu.device_info().free_memory * 0.7)
    first = gpu.allocate_memory(big)
    with pytest.raises(ResourceExhausted):
        gpu.allocate_memory(big)
    gpu.free_memory(Buffer(first.handle, 0))  # the worker frees with size 0: only the handle counts
    gpu.allocate_memory(16)


# -- streams ---------------------------------------------------------------------------------------

def test_streams(gpu: CudaBackend, module: Module) -> None:
    n = 1 << 20
    kern = gpu.get_kernel(module, "fill_index")
    s1, s2 = gpu.create_stream(), gpu.create_stream()
    b1, b2 = gpu.allocate_memory(4 * n), gpu.allocate_memory(4 * n)
    gpu.memset(b1, 0, stream=s1)
    gpu.execute_kernel(kern, blocks(n, 256), 256, [b1, np.int32(n)], stream=s1)
    gpu.execute_kernel(kern, blocks(n, 256), 256, [b2, np.int32(n // 2)], stream=s2)
    gpu.synchronize(s1)
    gpu.synchronize(s2)
    np.testing.assert_array_equal(download(gpu, b1, np.int32, n, 0), np.arange(n))
    out = np.empty(n // 2, dtype=np.int32)
    gpu.copy_d2h(b2, out, stream=s2)
    np.testing.assert_array_equal(out, np.arange(n // 2))
    gpu.copy_d2d(b1, b2, 4 * n, stream=s2)
    gpu.destroy_stream(s2)  # waits for the copy first
    np.testing.assert_array_equal(download(gpu, b2, np.int32, n), np.arange(n))
    with pytest.raises(NotFound):
        gpu.destroy_stream(s2)
    with pytest.raises(NotFound):
        gpu.synchronize(Stream("stream-999"))
    with pytest.raises(NotFound):
        gpu.copy_h2d(b"x", b1, stream=s2)
    with pytest.raises(InvalidArgument):
        gpu.destroy_stream(None)  # type: ignore[arg-type]
    gpu.destroy_stream(s1)


# -- fatal errors ----------------------------------------------------------------------------------

FATAL_SCRIPT = r"""
import json, sys, numpy as np
from gpubroker.broker.backends._cuda import CudaBackend
from gpubroker.client import Aborted
result = {}
gpu = CudaBackend(0)
gpu.initialize()
k = gpu.compile_kernel('extern "C" __global__ void poke(unsigned long long a) { *(int*)a = 1; }', "poke")
gpu.execute_kernel(k, 1, 1, [np.uint64(8)])  # writes to address 8
if sys.argv[1:] == ["take"]:
    result["take_first"] = gpu.take_device_time()  # the scheduler's wait is the first to meet the fault
try:
    gpu.synchronize()
except Aborted as exc:
    result["sync"] = [type(exc).__name__, exc.details.get("fatal"), exc.message]
try:
    gpu.allocate_memory(16)
except Aborted as exc:
    result["after"] = [type(exc).__name__, exc.details.get("fatal")]
result["take"] = gpu.take_device_time()
gpu.close()
result["closed"] = True
result["take_closed"] = gpu.take_device_time()
print("RESULT" + json.dumps(result))
"""


@pytest.mark.parametrize("first", ["sync", "take"])
def test_illegal_address_is_fatal(first: str) -> None:
    # In a child process: the error poisons the CUDA context for the whole process.
    proc = subprocess.run([sys.executable, "-c", FATAL_SCRIPT, first], capture_output=True, text=True,
                          timeout=120)
    print("FATAL_STDERR", proc.stderr[-2000:])
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT")), None)
    assert line is not None, proc.stdout + proc.stderr
    result = json.loads(line[len("RESULT"):])
    assert result["sync"][:2] == ["Aborted", True]
    assert "cudaErrorIllegalAddress" in result["sync"][2] or "ILLEGAL_ADDRESS" in result["sync"][2]
    assert result["after"] == ["Aborted", True]
    assert result["closed"]
    # take_device_time never raises: after a fatal error there is nothing it can measure.
    assert result["take"] == 0.0 and result["take_closed"] == 0.0
    if first == "take":
        assert result["take_first"] == 0.0


# -- device time -----------------------------------------------------------------------------------

SPIN_SOURCE = r"""
extern "C" __global__ void spin(long long cycles) {
    long long start = clock64();
    while (clock64() - start < cycles) { }
}
"""


def spin_cycles(gpu: CudaBackend, seconds: float) -> np.int64:
    """SM clock cycles for about ``seconds`` at the device's reported clock."""
    return np.int64(seconds * gpu.device_info().clock_mhz * 1e6)


def test_device_time_is_zero_when_nothing_ran() -> None:
    backend = CudaBackend(0)
    assert backend.take_device_time() == 0.0  # before initialize
    with backend:
        assert backend.take_device_time() == 0.0  # right after initialize
        assert backend.take_device_time() == 0.0


def test_device_time_measures_kernels(gpu: CudaBackend) -> None:
    spin = gpu.compile_kernel(SPIN_SOURCE, "spin")
    cycles = spin_cycles(gpu, 2e-3)
    gpu.execute_kernel(spin, 1, 1, [np.int64(1000)])  # warm-up: module load, clocks up
    gpu.take_device_time()
    gpu.execute_kernel(spin, 1, 1, [cycles])
    gpu.execute_kernel(spin, 1, 1, [cycles])
    took = gpu.take_device_time()  # no synchronize first: the take waits itself
    print("DEVICE_TIME 2 x 2 ms spin:", took)
    assert 3e-3 < took < 8e-3, took
    assert gpu.take_device_time() < 1e-3
    # The same work split over the default stream and a created one: each launch counts in full.
    stream = gpu.create_stream()
    gpu.execute_kernel(spin, 1, 1, [cycles])
    gpu.execute_kernel(spin, 1, 1, [cycles], stream=stream)
    took = gpu.take_device_time()
    assert 3e-3 < took < 8e-3, took
    gpu.destroy_stream(stream)
    assert gpu.take_device_time() == 0.0


def test_device_time_counts_copies_and_memsets(gpu: CudaBackend) -> None:
    n = 64 << 20
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


def test_device_time_pairs_stay_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_cuda_timing, "FOLD_PAIRS", 64)
    with CudaBackend(0) as backend:
        buf = backend.allocate_memory(64 << 10)
        longest = 0
        for _ in range(100):  # commands alone record no pairs: one open segment per stream
            backend.memset(buf, 3)
        assert backend._timer._pairs == [] and len(backend._timer._open) == 1
        for i in range(1, 20 * 64 + 1):
            backend.memset(buf, 3)
            backend.flush_device_time()  # a batch end: closes the segment, one pair each
            longest = max(longest, len(backend._timer._pairs))
            if i % 64 == 0:
                backend.synchronize()
        # Without folding the list would hold all 1280 pairs; with it, completed ones leave once 64 pile up.
        assert longest <= 2 * 64 + 1, longest
        assert backend.take_device_time() > 0
        assert backend._timer._pairs == [] and backend.take_device_time() == 0.0
        assert backend._timer._pool  # read events are kept for reuse


def test_device_time_survives_close() -> None:
    with CudaBackend(0) as backend:
        spin = backend.compile_kernel(SPIN_SOURCE, "spin")
        backend.execute_kernel(spin, 1, 1, [spin_cycles(backend, 2e-3)])
    took = backend.take_device_time()  # close waited for the launch; its time is still charged
    assert 1e-3 < took < 8e-3, took
    assert backend.take_device_time() == 0.0


# -- the worker's launch path: prepared launches, device-time segments across batches ---------------------------
def _executor(gpu: CudaBackend) -> Executor:
    executor = Executor(gpu, HandleTables(), SegmentTable(gpu))
    ack = executor.run("s", Batch(1, 0, [LoadModule("m", "cuda_c", (SOURCE + SPIN_SOURCE).encode(), []),
                                         GetKernel("saxpy", "m", "saxpy"), GetKernel("spin", "m", "spin")]))
    assert ack.error is None, ack.error
    return executor


def _scalar_arg(value: np.generic) -> ScalarArg:
    return ScalarArg(value.dtype.str, value.tobytes())


def test_worker_launches_pack_views_and_scalars_and_recheck_each_shape(gpu: CudaBackend) -> None:
    executor = _executor(gpu)
    n = 256
    x, y = np.arange(n, dtype=np.float32), np.ones(n, dtype=np.float32)
    launch = Launch("saxpy", (2,), (64,), [_scalar_arg(np.float32(2.0)), BufferArg("x", 0), BufferArg("y", 256),
                                           _scalar_arg(np.int32(128))])
    ack = executor.run("s", Batch(2, 0, [Allocate("x", 4 * n), Allocate("y", 4 * n), Write(("x", 0), 0, x.tobytes()),
                                         Write(("y", 0), 0, y.tobytes()), launch, launch,
                                         Read(("y", 0), 0, 4 * n)]))
    assert ack.error is None, ack.error
    got = np.frombuffer(ack.result, dtype=np.float32)
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
                                       _scalar_arg(np.int32(1))])
    ack = executor.run("s", Batch(5, 30, [bad]))
    assert ack.error is not None and ack.error.type == "ArgumentTypeError", ack.error


def test_worker_segment_spans_batches_and_ends_when_the_worker_goes_idle(gpu: CudaBackend) -> None:
    executor = _executor(gpu)
    spin = Launch("spin", (1,), (1,), [_scalar_arg(spin_cycles(gpu, 1e-3))])
    gpu.take_device_time()
    for i in range(3):  # back-to-back batches: one segment, no timing event between their kernels
        assert executor.run("s", Batch(10 + i, 0, [spin])).error is None
        assert executor.issuing()
    assert gpu._timer._pairs == []
    executor.idle()  # what the serve loop does before it waits for input
    assert not executor.issuing()
    time.sleep(0.05)  # host idle time: not the device's, so not charged
    took = gpu.take_device_time()
    assert 2e-3 < took < 20e-3, took


# -- events ------------------------------------------------------------------------------------------
def test_a_stream_waits_on_the_gpu_for_another_streams_event(gpu: CudaBackend) -> None:
    spin = gpu.compile_kernel(samples.source("cuda"), "spin")
    n, iters = 256, np.int64(2_000_000)  # milliseconds: a read that did not wait would see the zeros
    ref = upload(gpu, np.zeros(n, dtype=np.float32))
    gpu.execute_kernel(spin, n // 64, 64, [ref, iters])
    expected = download(gpu, ref, np.float32, n)
    assert np.all(expected > 0)
    a, b = gpu.create_stream(), gpu.create_stream()
    buf = upload(gpu, np.zeros(n, dtype=np.float32))
    gpu.synchronize()
    ev = gpu.create_event()
    gpu.execute_kernel(spin, n // 64, 64, [buf, iters], stream=a)
    gpu.record_event(ev, a)
    gpu.wait_event(ev, b)  # the host goes on: stream b waits on the GPU
    got = np.empty(n, dtype=np.float32)
    gpu.copy_d2h(buf, got, stream=b)
    np.testing.assert_array_equal(got, expected)
    gpu.synchronize_event(ev)
    gpu.destroy_event(ev)
    with pytest.raises(NotFound, match="event"):
        gpu.synchronize_event(ev)
    never = gpu.create_event()
    gpu.wait_event(never, b)  # never recorded: complete (CUDA's rule)
    gpu.synchronize_event(never)
    gpu.destroy_event(never)
    gpu.destroy_stream(a)
    gpu.destroy_stream(b)


def test_events_as_commands_through_the_executor(gpu: CudaBackend) -> None:
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
