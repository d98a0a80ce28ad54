"""The kernels of the backend contract tests, as data: each one in CUDA C and in OpenCL C, with the same parameters.

A test launches a kernel the same way on either backend (same grid, block, arguments and ``shared_mem``), so its
host code is written once (tests/broker/backends/test_backend_contract.py). The one difference in a signature is
dynamic shared memory: CUDA's ``extern __shared__`` array, OpenCL's trailing ``__local`` parameter, which the
backend fills from ``shared_mem`` (the caller never passes it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Protocol

from gpubroker.client import GpuCompute, ModuleFormat

__all__ = ["FORMAT", "KERNELS", "MODULE_KERNELS", "Backend", "OpenDevice", "module_source", "source", "unopened"]


@dataclass(frozen=True)
class Dialects:
    """One kernel in each backend's dialect."""

    cuda: str
    opencl: str

    def of(self, backend: str) -> str:
        return self.cuda if backend == "cuda" else self.opencl


# The format each backend compiles its source from.
FORMAT = {"cuda": ModuleFormat.CUDA_C, "opencl": ModuleFormat.OPENCL_C}

KERNELS: dict[str, Dialects] = {
    "vadd": Dialects(
        cuda=r"""
extern "C" __global__ void vadd(const float* a, const float* b, float* c, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) c[i] = a[i] + b[i];
}""",
        opencl=r"""
__kernel void vadd(__global const float* a, __global const float* b, __global float* c, int n) {
    int i = get_global_id(0);
    if (i < n) c[i] = a[i] + b[i];
}"""),
    "saxpy": Dialects(
        cuda=r"""
extern "C" __global__ void saxpy(float alpha, const float* x, float* y, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = alpha * x[i] + y[i];
}""",
        opencl=r"""
__kernel void saxpy(float alpha, __global const float* x, __global float* y, int n) {
    int i = get_global_id(0);
    if (i < n) y[i] = alpha * x[i] + y[i];
}"""),
    # The sum of each block's elements, in block-sized scratch space (shared_mem = 4 * block bytes).
    "block_sum": Dialects(
        cuda=r"""
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
}""",
        opencl=r"""
__kernel void block_sum(__global const float* x, __global float* out, int n, __local float* scratch) {
    int t = get_local_id(0);
    int i = get_global_id(0);
    scratch[t] = i < n ? x[i] : 0.0f;
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int k = get_local_size(0) / 2; k > 0; k >>= 1) {
        if (t < k) scratch[t] += scratch[t + k];
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    if (t == 0) out[get_group_id(0)] = scratch[0];
}"""),
    "fill2d": Dialects(
        cuda=r"""
extern "C" __global__ void fill2d(int* out, int w, int h) {
    int x = blockIdx.x * blockDim.x + threadIdx.x;
    int y = blockIdx.y * blockDim.y + threadIdx.y;
    if (x < w && y < h) out[y * w + x] = y * 10000 + x;
}""",
        opencl=r"""
__kernel void fill2d(__global int* out, int w, int h) {
    int x = get_global_id(0);
    int y = get_global_id(1);
    if (x < w && y < h) out[y * w + x] = y * 10000 + x;
}"""),
    "transpose": Dialects(
        cuda=r"""
extern "C" __global__ void transpose(const float* in, float* out, int rows, int cols) {
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    int r = blockIdx.y * blockDim.y + threadIdx.y;
    if (r < rows && c < cols) out[c * rows + r] = in[r * cols + c];
}""",
        opencl=r"""
__kernel void transpose(__global const float* in, __global float* out, int rows, int cols) {
    int c = get_global_id(0);
    int r = get_global_id(1);
    if (r < rows && c < cols) out[c * rows + r] = in[r * cols + c];
}"""),
    "fill_index": Dialects(
        cuda=r"""
extern "C" __global__ void fill_index(int* out, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = i;
}""",
        opencl=r"""
__kernel void fill_index(__global int* out, int n) {
    int i = get_global_id(0);
    if (i < n) out[i] = i;
}"""),
    # out[i] = a dependent chain of iters multiply-adds from i (it cannot be skipped): run time grows linearly with
    # iters, and every result is > 0, so a read that did not wait for it sees a buffer's zeros.
    "spin": Dialects(
        cuda=r"""
extern "C" __global__ void spin(float* out, int iters) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    float x = (float)i;
    for (int k = 0; k < iters; ++k) x = x * 0.999999f + 1.0f;
    out[i] = x;
}""",
        opencl=r"""
__kernel void spin(__global float* out, int iters) {
    int i = get_global_id(0);
    float x = (float)i;
    for (int k = 0; k < iters; ++k) x = x * 0.999999f + 1.0f;
    out[i] = x;
}"""),
    # Does not compile: the log names the undeclared identifier.
    "broken": Dialects(
        cuda=r"""extern "C" __global__ void broken(int* p) { p[0] = undeclared_name; }""",
        opencl=r"""__kernel void broken(__global int* p) { p[0] = undeclared_name; }"""),
}

# What the contract's one module per backend holds (one compile: PoCL's are slow).
MODULE_KERNELS = ("vadd", "saxpy", "block_sum", "fill2d", "transpose", "fill_index", "spin")


def source(backend: str, *names: str) -> str:
    """The kernels ``names`` in the dialect of ``backend`` ("cuda" or "opencl"), as one source."""
    return "\n".join(KERNELS[name].of(backend) for name in names) + "\n"


def module_source(backend: str) -> str:
    """The contract's module: the tests that compile a whole source compile this one, which PoCL's kernel cache
    then holds (a build of it costs a loaded 2-core host half a second; a cache hit, nothing)."""
    return source(backend, *MODULE_KERNELS)


class Backend(GpuCompute, Protocol):
    """What both in-process backends add to GpuCompute and the tests use."""

    def take_device_time(self) -> float: ...

    def __enter__(self) -> Backend: ...

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None: ...


# The session's shared device of a kind (the ``open_device`` fixture, tests/broker/backends/conftest.py).
OpenDevice = Callable[[str], Backend]


def unopened(backend: str, device: object = 0) -> Backend:
    """A backend of kind ``backend`` on ``device``, constructed but not initialized."""
    if backend == "cuda":
        from gpubroker.broker.backends._cuda import CudaBackend  # CuPy: imported only on a GPU machine

        cuda: Backend = CudaBackend(device)  # type: ignore[arg-type]
        return cuda
    from gpubroker.broker.backends._opencl import OpenCLBackend

    opencl: Backend = OpenCLBackend(device)  # type: ignore[arg-type]
    return opencl
