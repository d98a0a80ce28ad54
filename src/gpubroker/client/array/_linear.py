"""Linear algebra functions of the core: matmul, tensordot, vecdot, matrix_transpose.

``matmul`` and ``tensordot`` run as the worker's "matmul" library operation (cuBLAS through CuPy on CUDA); the
standard's 1-d rules and tensordot's axes are shapes arranged here (views, and a copy where a permutation leaves an
operand non-contiguous) around one batched matrix product. ``vecdot`` is a product and a sum (two kernels, no copy
of the broadcast operands).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from gpubroker.client.array import _elementwise, _statistical
from gpubroker.client.array._array import Array, empty_array
from gpubroker.client.array._dtypes import promote
from gpubroker.client.array._library_calls import call, cast, context_of, normalize_axis
from gpubroker.client.array._manipulation import permute_dims, reshape
from gpubroker.client.array._views import broadcast_shapes

__all__ = ["matmul", "matrix_transpose", "tensordot", "vecdot"]


def _numeric_dtype(name: str, x1: Array, x2: Array) -> np.dtype[Any]:
    """The promoted dtype of two numeric operands (TypeError for bool, as array-api-strict)."""
    context_of(x1, x2)
    if x1.dtype.kind == "b" or x2.dtype.kind == "b":
        raise TypeError(f"{name} takes numeric arrays, got {x1.dtype} and {x2.dtype}")
    return promote(x1.dtype, x2.dtype)


def _zeros(x: Array) -> Array:
    if x.size:
        x._ctx.kernels.fill(x._view, 0)
    return x


def batched_matmul(a: Array, b: Array, dtype: np.dtype[Any]) -> Array:
    """``a @ b`` for operands of at least 2 dimensions whose batch dimensions broadcast, in ``dtype``."""
    m, k = a.shape[-2:]
    k2, n = b.shape[-2:]
    if k != k2:
        raise ValueError(f"matmul: shapes {a.shape} and {b.shape} do not align ({k} != {k2})")
    batch = broadcast_shapes(a.shape[:-2], b.shape[:-2])
    shape = (*batch, m, n)
    if k == 0 or 0 in shape:
        # nothing to multiply: the library has no use for an empty operand (and a sum over nothing is zero)
        return _zeros(empty_array(a._ctx, shape, dtype))
    (out,) = call("matmul", [cast(a, dtype), cast(b, dtype)])
    return out


def matmul(x1: Array, x2: Array, /) -> Array:
    """The matrix product (the standard's ``matmul``): a 1-d ``x1`` is a row vector and a 1-d ``x2`` a column
    vector, their added dimension removed from the result; batch dimensions broadcast."""
    dtype = _numeric_dtype("matmul", x1, x2)
    if x1.ndim == 0 or x2.ndim == 0:
        raise ValueError("matmul does not take 0-d arrays")
    a = reshape(x1, (1, x1.shape[0])) if x1.ndim == 1 else x1
    b = reshape(x2, (x2.shape[0], 1)) if x2.ndim == 1 else x2
    out = batched_matmul(a, b, dtype)
    shape = out.shape
    if x2.ndim == 1:
        shape = shape[:-1]
    if x1.ndim == 1:
        shape = (*shape[:-2], shape[-1]) if x2.ndim != 1 else shape[:-1]
    return reshape(out, shape) if shape != out.shape else out


def matrix_transpose(x: Array, /) -> Array:
    """The last two axes of ``x`` swapped: a view (ValueError below 2 dimensions)."""
    context_of(x)
    if x.ndim < 2:
        raise ValueError(f"matrix_transpose needs at least 2 dimensions, got shape {x.shape}")
    return permute_dims(x, (*range(x.ndim - 2), x.ndim - 1, x.ndim - 2))


def _tensordot_axes(x1: Array, x2: Array, axes: Any) -> tuple[list[int], list[int]]:
    if isinstance(axes, (int, np.integer)) and not isinstance(axes, bool):
        count = int(axes)
        if count < 0:
            raise ValueError(f"tensordot: axes must be nonnegative, got {count}")
        if count > x1.ndim or count > x2.ndim:
            raise ValueError(f"tensordot: cannot contract {count} axes of shapes {x1.shape} and {x2.shape}")
        return list(range(x1.ndim - count, x1.ndim)), list(range(count))
    try:
        first, second = axes
    except (TypeError, ValueError):
        raise TypeError("tensordot: axes must be an int or a pair of sequences of ints") from None
    seq1: list[Any] = [first] if isinstance(first, (int, np.integer)) else list(first)
    seq2: list[Any] = [second] if isinstance(second, (int, np.integer)) else list(second)
    if len(seq1) != len(seq2):
        raise ValueError(f"tensordot: axes {seq1} and {seq2} differ in length")
    ax1 = [normalize_axis(a, x1.ndim, "tensordot axis") for a in seq1]
    ax2 = [normalize_axis(a, x2.ndim, "tensordot axis") for a in seq2]
    if len(set(ax1)) != len(ax1) or len(set(ax2)) != len(ax2):
        raise ValueError(f"tensordot: repeated axes in {seq1}, {seq2}")
    return ax1, ax2


def tensordot(x1: Array, x2: Array, /, *, axes: int | tuple[Sequence[int], Sequence[int]] = 2) -> Array:
    """The tensor contraction of ``x1`` and ``x2`` over ``axes``: both operands permuted and reshaped into one
    matrix product (contracted axes must match exactly: they do not broadcast)."""
    dtype = _numeric_dtype("tensordot", x1, x2)
    ax1, ax2 = _tensordot_axes(x1, x2, axes)
    for i1, i2 in zip(ax1, ax2, strict=True):
        if x1.shape[i1] != x2.shape[i2]:
            raise ValueError(f"tensordot: axis {i1} of shape {x1.shape} and axis {i2} of shape {x2.shape} differ")
    free1 = [i for i in range(x1.ndim) if i not in ax1]
    free2 = [i for i in range(x2.ndim) if i not in ax2]
    k = math.prod(x1.shape[i] for i in ax1)
    m = math.prod(x1.shape[i] for i in free1)
    n = math.prod(x2.shape[i] for i in free2)
    a = reshape(permute_dims(x1, (*free1, *ax1)), (m, k))
    b = reshape(permute_dims(x2, (*ax2, *free2)), (k, n))
    out = batched_matmul(a, b, dtype)
    return reshape(out, tuple(x1.shape[i] for i in free1) + tuple(x2.shape[i] for i in free2))


def vecdot(x1: Array, x2: Array, /, *, axis: int = -1) -> Array:
    """The dot product of vectors along ``axis`` (negative, counted from the end; conjugating ``x1`` if complex);
    the other dimensions broadcast, the contracted one must match."""
    dtype = _numeric_dtype("vecdot", x1, x2)
    if not isinstance(axis, (int, np.integer)) or isinstance(axis, bool):
        raise TypeError(f"vecdot: axis must be an integer, got {type(axis).__name__}")
    if axis >= 0:
        raise ValueError("vecdot: axis must be negative (counted from the last dimension)")
    if axis < min(-1, -x1.ndim, -x2.ndim):
        raise ValueError(f"vecdot: axis {axis} is out of bounds for shapes {x1.shape} and {x2.shape}")
    if x1.shape[axis] != x2.shape[axis]:
        raise ValueError(f"vecdot: shapes {x1.shape} and {x2.shape} differ on axis {axis}")
    left = _elementwise.conj(x1) if x1.dtype.kind == "c" else x1
    product = _elementwise.multiply(left, x2)
    return _statistical.sum(product, axis=axis, dtype=dtype)

