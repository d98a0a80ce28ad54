"""Sample kernels in both dialects, for the demo, the benchmark and the tests.

Every kernel has the same parameters and the same grid/block meaning in CUDA C and OpenCL C, so the
same host code drives either backend. ``reduce_sum`` takes its scratch space as dynamic shared memory
(``shared_mem`` bytes): CUDA's ``extern __shared__``, OpenCL's trailing ``__local`` parameter.
"""

from __future__ import annotations

__all__ = ["KERNELS", "source"]

_CUDA = r"""
extern "C" __global__ void vector_add(const float* a, const float* b, float* c, const int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) c[i] = a[i] + b[i];
}

extern "C" __global__ void saxpy(const float a, const float* x, float* y, const int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = a * x[i] + y[i];
}

extern "C" __global__ void reduce_sum(const float* x, float* partial, const int n) {
    extern __shared__ float scratch[];
    unsigned int tid = threadIdx.x;
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    scratch[tid] = i < n ? x[i] : 0.0f;
    __syncthreads();
    for (unsigned int s = blockDim.x / 2; s > 0; s >>= 1) {
        if (tid < s) scratch[tid] += scratch[tid + s];
        __syncthreads();
    }
    if (tid == 0) partial[blockIdx.x] = scratch[0];
}

extern "C" __global__ void matmul(const float* a, const float* b, float* c, const int m, const int k, const int n) {
    int row = blockIdx.y * blockDim.y + threadIdx.y;
    int col = blockIdx.x * blockDim.x + threadIdx.x;
    if (row < m && col < n) {
        float acc = 0.0f;
        for (int i = 0; i < k; ++i) acc += a[row * k + i] * b[i * n + col];
        c[row * n + col] = acc;
    }
}

extern "C" __global__ void scale_inplace(float* x, const float factor, const int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = x[i] * factor + 1.0f;
}

extern "C" __global__ void empty_kernel() {}

extern "C" __global__ void spin(float* x, const long long iters) {
    // A dependent chain of multiply-adds: run time grows linearly with iters (for fairness benchmarks).
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    float v = x[i];
    for (long long k = 0; k < iters; ++k) v = v * 0.999999f + 0.5f;
    x[i] = v;
}

extern "C" __global__ void write_far(float* x, const long long stride) {
    // Deliberately writes far outside its buffer: used to prove a faulting tenant harms nobody else.
    for (long long i = 0; i < 64; ++i) x[(i + 1) * stride] = 1.0f;
}
"""

_OPENCL = r"""
__kernel void vector_add(__global const float* a, __global const float* b, __global float* c, const int n) {
    int i = get_global_id(0);
    if (i < n) c[i] = a[i] + b[i];
}

__kernel void saxpy(const float a, __global const float* x, __global float* y, const int n) {
    int i = get_global_id(0);
    if (i < n) y[i] = a * x[i] + y[i];
}

__kernel void reduce_sum(__global const float* x, __global float* partial, const int n, __local float* scratch) {
    unsigned int tid = get_local_id(0);
    unsigned int i = get_global_id(0);
    scratch[tid] = i < n ? x[i] : 0.0f;
    barrier(CLK_LOCAL_MEM_FENCE);
    for (unsigned int s = get_local_size(0) / 2; s > 0; s >>= 1) {
        if (tid < s) scratch[tid] += scratch[tid + s];
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    if (tid == 0) partial[get_group_id(0)] = scratch[0];
}

__kernel void matmul(__global const float* a, __global const float* b, __global float* c,
                     const int m, const int k, const int n) {
    int row = get_global_id(1);
    int col = get_global_id(0);
    if (row < m && col < n) {
        float acc = 0.0f;
        for (int i = 0; i < k; ++i) acc += a[row * k + i] * b[i * n + col];
        c[row * n + col] = acc;
    }
}

__kernel void scale_inplace(__global float* x, const float factor, const int n) {
    int i = get_global_id(0);
    if (i < n) x[i] = x[i] * factor + 1.0f;
}

__kernel void empty_kernel() {}

__kernel void spin(__global float* x, const long iters) {
    // A dependent chain of multiply-adds: run time grows linearly with iters (for fairness benchmarks).
    int i = get_global_id(0);
    float v = x[i];
    for (long k = 0; k < iters; ++k) v = v * 0.999999f + 0.5f;
    x[i] = v;
}

__kernel void write_far(__global float* x, const long stride) {
    // Deliberately writes far outside its buffer: used to prove a faulting tenant harms nobody else.
    for (long i = 0; i < 64; ++i) x[(i + 1) * stride] = 1.0f;
}
"""

KERNELS = ("vector_add", "saxpy", "reduce_sum", "matmul", "scale_inplace", "empty_kernel", "spin", "write_far")


def source(backend: str) -> str:
    """All sample kernels in the dialect of ``backend`` ("cuda" or "opencl")."""
    return _CUDA if backend == "cuda" else _OPENCL
