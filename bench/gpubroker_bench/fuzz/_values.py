"""Hypothesis strategies for the values a hostile or buggy client puts in requests: edges, junk, near misses."""

from __future__ import annotations

from collections.abc import Sequence

from hypothesis import strategies as st

__all__ = ["FUZZ_KERNELS", "block_dims", "dtypes", "fuzz_source", "grid_dims", "int64s", "junk_strings",
           "module_images", "uint32s", "uint64s"]

INT64 = (-(2**63), 2**63 - 1)
UINT64 = (0, 2**64 - 1)
UINT32 = (0, 2**32 - 1)
_EDGES = [0, 1, -1, 2, 3, 7, 8, 127, 128, 255, 256, 4095, 4096, 4097, 65536, 2**31 - 1, 2**31, 2**32 - 1, 2**32,
          2**53 + 1, 2**62, 2**63 - 1, -(2**31), -(2**63), 2**64 - 1]

# Kernels with no side effects: a launch may take any arguments the broker accepts without making a buffer's
# bytes unpredictable (the model checks every byte it knows).
_OPENCL = r"""
__kernel void fz_noop(void) {}
__kernel void fz_args(__global const uchar* x, const int a, const float b, const long c) {}
__kernel void fz_local(__global const uchar* x, __local uchar* scratch) { barrier(CLK_LOCAL_MEM_FENCE); }
"""
_CUDA = r"""
extern "C" __global__ void fz_noop() {}
extern "C" __global__ void fz_args(const unsigned char* x, const int a, const float b, const long long c) {}
extern "C" __global__ void fz_local(const unsigned char* x) { extern __shared__ unsigned char s[]; __syncthreads(); }
"""
FUZZ_KERNELS = ("fz_noop", "fz_args", "fz_local")


def fuzz_source(backend: str) -> str:
    return _CUDA if backend == "cuda" else _OPENCL


def _ints(lo: int, hi: int, near: Sequence[int]) -> st.SearchStrategy[int]:
    """Half the time a value near the ones given (the caller's idea of what is valid), else edges and noise."""
    edges = sorted({v for v in _EDGES if lo <= v <= hi})
    close = sorted({v for v in near if lo <= v <= hi})
    parts = [st.sampled_from(edges), st.integers(max(lo, -16), min(hi, 70_000))]
    if close:
        plausible = st.integers(max(lo, 0), max(max(lo, 0), min(hi, close[-1])))
        parts += [st.sampled_from(close), st.sampled_from(close), plausible]
    return st.one_of(*parts)


def int64s(near: Sequence[int] = ()) -> st.SearchStrategy[int]:
    return _ints(*INT64, near)


def uint64s(near: Sequence[int] = ()) -> st.SearchStrategy[int]:
    return _ints(*UINT64, near)


def uint32s(near: Sequence[int] = ()) -> st.SearchStrategy[int]:
    return _ints(*UINT32, near)


def junk_strings() -> st.SearchStrategy[str]:
    """Handle-like and not: empty, random text, prefixes of real handle kinds, very long."""
    return st.one_of(st.just(""), st.text(max_size=24),
                     st.sampled_from(["buf_", "mod_", "krn_", "str_", "seg_", "ses_", "buf-1", "seg1", "0", "\x00",
                                      "x" * 4096]))


def grid_dims(max_grid: int) -> st.SearchStrategy[list[int]]:
    """Mostly small, valid extents (a fuzzed launch must not occupy the device for long), plus invalid ones."""
    extent = st.one_of(st.integers(1, 4), st.sampled_from([0, max_grid + 1, 2**32, 2**64 - 1]))
    return st.lists(extent, min_size=0, max_size=4)


def block_dims(max_block: int) -> st.SearchStrategy[list[int]]:
    extent = st.one_of(st.sampled_from([1, 2, 16, 64, 256]), st.sampled_from([0, max_block + 1, 2**32, 2**64 - 1]))
    return st.lists(extent, min_size=0, max_size=4)


def dtypes() -> st.SearchStrategy[str]:
    """numpy dtype strings: the accepted ones, and ones numpy refuses or parses into something else entirely."""
    return st.one_of(
        st.sampled_from(["<i4", "<f4", "<i8", "<u4", "<f8", "<u1", "<i2", "<f2", ">i4", "=u8", "|u1"]),
        st.sampled_from(["", "O", "V8", "c8", "f16", "?", "M8", "U", "S4", "(2,3)f4", "i4,i4", "2i4", "T", ",", "(",
                         "i4 (2,)", "99999999999999999999i4", "(1000000000,1000000000)i4", "i0", "float128",
                         "a", "<f4 ", "f4\x00"]),
        st.text(max_size=12))


def module_images(source: str, max_module_bytes: int) -> st.SearchStrategy[bytes]:
    return st.one_of(
        st.just(source.encode()),
        st.binary(max_size=64),
        st.just(b"\xff\xfe not utf-8 \xc3\x28"),
        st.just(b""),
        st.just(b"__kernel void broken( {"),
        st.just(b"x" * (max_module_bytes + 1)),
        st.text(max_size=64).map(str.encode))
