"""One strided gather kernel, generated for CUDA C and OpenCL C: the copies and index lookups of the array object.

``out[c] = x[x_offset + sum(c[d] * x_strides[d]) + sum(idx_k[c] * x_axis_stride_k)]`` for every coordinate ``c`` of
``out``'s shape: with no index arrays it is a strided copy (making a view contiguous, broadcasting, writing into a
slice); with index arrays it is ``take``, ``take_along_axis`` and integer-array indexing. Elements move as
machine words of the dtype's size, so one kernel serves every dtype of that size. Index values wrap once
(negative counts from the end) and are then clamped to the axis: an index out of range never reads outside ``x``.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from gpubroker.client import Kernel
from gpubroker.client.array._context import Context
from gpubroker.client.array._views import View

__all__ = ["IndexOperand", "MAX_DIMS", "gather"]

MAX_DIMS = 32  # coordinates are decomposed in generated straight-line code: any rank works, this bounds the source
_RANKS = (0, 1, 2, 4, 8, 16, MAX_DIMS)
_BLOCK = 256
_MAX_GRID = 1 << 16  # the loop strides over the grid, so big arrays need no bigger grid

# Words that move an element of each size (16: complex128, two 8-byte words in one aligned load).
_WORD = {"opencl": {1: "uchar", 2: "ushort", 4: "uint", 8: "ulong", 16: "ulong2"},
         "cuda": {1: "unsigned char", 2: "unsigned short", 4: "unsigned int", 8: "unsigned long long",
                  16: "ulonglong2"}}
_INDEX_C = {"opencl": {"int8": "char", "int16": "short", "int32": "int", "int64": "long", "uint8": "uchar",
                       "uint16": "ushort", "uint32": "uint", "uint64": "ulong"},
            "cuda": {"int8": "signed char", "int16": "short", "int32": "int", "int64": "long long",
                     "uint8": "unsigned char", "uint16": "unsigned short", "uint32": "unsigned int",
                     "uint64": "unsigned long long"}}

_kernel_cache: weakref.WeakKeyDictionary[Context, dict[str, Kernel]] = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class IndexOperand:
    """An index array read at each output coordinate: ``view`` is already broadcast to the output's rank (its
    ``strides`` per output dimension, 0 where it repeats); its value selects along an axis of ``x`` whose
    stride is ``axis_stride`` and extent ``extent``."""

    view: View
    axis_stride: int
    extent: int


def _coalesce(shape: Sequence[int], strides: Sequence[Sequence[int]]) -> tuple[list[int], list[list[int]]]:
    """Drop extent-1 dimensions and merge neighbours that every operand walks as one (fewer divisions)."""
    dims = [d for d, extent in enumerate(shape) if extent != 1]
    out_shape: list[int] = []
    out_strides: list[list[int]] = [[] for _ in strides]
    for d in dims:
        if out_shape and all(s[-1] == st[d] * shape[d] for s, st in zip(out_strides, strides, strict=True)):
            out_shape[-1] *= shape[d]
            for s, st in zip(out_strides, strides, strict=True):
                s[-1] = st[d]
            continue
        out_shape.append(shape[d])
        for s, st in zip(out_strides, strides, strict=True):
            s.append(st[d])
    return out_shape, out_strides


def _source(backend: str, name: str, word: str, ndim: int, index_types: Sequence[str]) -> str:
    cuda = backend == "cuda"
    long_t = "long long" if cuda else "long"
    glob = "" if cuda else "__global "
    params = [f"{glob}{word}* out", f"{glob}const {word}* x"]
    params += [f"{glob}const {t}* idx{k}" for k, t in enumerate(index_types)]
    params += [f"{long_t} n", f"{long_t} out_off", f"{long_t} x_off"]
    for d in range(ndim):
        params += [f"{long_t} s{d}", f"{long_t} os{d}", f"{long_t} xs{d}"]
        params += [f"{long_t} is{k}_{d}" for k in range(len(index_types))]
    for k in range(len(index_types)):
        params += [f"{long_t} io{k}", f"{long_t} xa{k}", f"{long_t} na{k}"]
    body = [f"{long_t} r = t;", f"{long_t} o = out_off;", f"{long_t} a = x_off;"]
    body += [f"{long_t} i{k} = io{k};" for k in range(len(index_types))]
    for d in reversed(range(ndim)):
        body.append(f"{{ {long_t} c = r % s{d}; r /= s{d}; o += c * os{d}; a += c * xs{d};"
                    + "".join(f" i{k} += c * is{k}_{d};" for k in range(len(index_types))) + " }")
    for k in range(len(index_types)):
        body.append(f"{{ {long_t} v = ({long_t})idx{k}[i{k}]; if (v < 0) v += na{k};"
                    f" v = v < 0 ? 0 : (v >= na{k} ? na{k} - 1 : v); a += v * xa{k}; }}")
    body.append("out[o] = x[a];")
    if cuda:
        head = f'extern "C" __global__ void {name}({", ".join(params)})'
        loop = (f"for ({long_t} t = ({long_t})blockIdx.x * blockDim.x + threadIdx.x; t < n;"
                f" t += ({long_t})gridDim.x * blockDim.x)")
    else:
        head = f"__kernel void {name}({', '.join(params)})"
        loop = f"for ({long_t} t = get_global_id(0); t < n; t += get_global_size(0))"
    inner = "\n        ".join(body)
    return f"{head}\n{{\n    {loop} {{\n        {inner}\n    }}\n}}\n"


def _kernel(ctx: Context, itemsize: int, ndim: int, index_dtypes: Sequence[np.dtype[Any]]) -> Kernel:
    backend = "cuda" if ctx.backend == "cuda" else "opencl"
    index_types = [_INDEX_C[backend][dt.name] for dt in index_dtypes]
    name = f"gb_gather_w{itemsize}_d{ndim}_" + "_".join(dt.name for dt in index_dtypes)
    cache = _kernel_cache.setdefault(ctx, {})
    kernel = cache.get(name)
    if kernel is None:
        kernel = ctx.gpu.compile_kernel(_source(backend, name, _WORD[backend][itemsize], ndim, index_types), name)
        cache[name] = kernel
    return kernel


def gather(ctx: Context, out: View, x: View, indices: Sequence[IndexOperand] = ()) -> None:
    """Queue ``out[c] = x[c with indexed axes looked up]`` (see the module's docstring); ``out.dtype`` and
    ``x.dtype`` have one size. ``x`` is given in ``out``'s rank: its ``strides`` per output dimension (0 where
    it repeats or where an index array supplies the position)."""
    if out.dtype.itemsize != x.dtype.itemsize:
        raise ValueError(f"gather moves {out.dtype} from {x.dtype}: the sizes differ")
    n = out.size
    if n == 0:
        return
    if len(x.strides) != len(out.shape):
        raise ValueError(f"x's strides {x.strides} do not match the output's rank {len(out.shape)}")
    strides = [out.strides, x.strides, *(op.view.strides for op in indices)]
    shape, walked = _coalesce(out.shape, strides)
    if len(shape) > MAX_DIMS:
        raise ValueError(f"at most {MAX_DIMS} dimensions are supported, got {len(shape)}")
    # Ranks come in a few sizes (outer dimensions of extent 1 pad the rest): fewer kernels to compile, and
    # every compile costs a fraction of a second (NVRTC, PoCL's clang).
    rank = next(r for r in _RANKS if r >= len(shape))
    pad = rank - len(shape)
    shape = [1] * pad + shape
    walked = [[0] * pad + w for w in walked]
    kernel = _kernel(ctx, out.dtype.itemsize, len(shape), [op.view.dtype for op in indices])
    i64 = np.int64
    args: list[object] = [out.buffer, x.buffer, *(op.view.buffer for op in indices),
                          i64(n), i64(out.offset), i64(x.offset)]
    for d, extent in enumerate(shape):
        args += [i64(extent), i64(walked[0][d]), i64(walked[1][d])]
        args += [i64(walked[2 + k][d]) for k in range(len(indices))]
    for op in indices:
        args += [i64(op.view.offset), i64(op.axis_stride), i64(op.extent)]
    grid = min(-(-n // _BLOCK), _MAX_GRID)
    ctx.gpu.execute_kernel(kernel, grid, _BLOCK, args)
