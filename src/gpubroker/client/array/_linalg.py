"""``xp.linalg``: the standard's linear algebra extension (2024.12).

Factorizations and solvers (cholesky, det, eigh, eigvalsh, inv, pinv, qr, slogdet, solve, svd, svdvals,
matrix_rank) are library operations in the worker (cuSOLVER through CuPy on CUDA, LAPACK through NumPy on PoCL).
What is a few elementwise kernels and reductions is composed here from the namespace's own functions (cross, outer,
trace, vector_norm, matrix_norm over singular values for "nuc" and 2), and diagonal is a strided view.
"""

from __future__ import annotations

import math
from typing import Any, Literal, NamedTuple

import numpy as np

from gpubroker.client.array import _elementwise, _statistical
from gpubroker.client.array._array import Array, copy_view, empty_array, wrap
from gpubroker.client.array._dtypes import promote
from gpubroker.client.array._library_calls import call, cast, context_of, read_scalar
from gpubroker.client.array._linear import matmul, matrix_transpose, tensordot, vecdot
from gpubroker.client.array._manipulation import reshape
from gpubroker.client.array._views import View, broadcast_shapes

__all__ = ["cholesky", "cross", "det", "diagonal", "eigh", "eigvalsh", "inv", "matmul", "matrix_norm",
           "matrix_power", "matrix_rank", "matrix_transpose", "outer", "pinv", "qr", "slogdet", "solve", "svd",
           "svdvals", "tensordot", "trace", "vecdot", "vector_norm"]


class EighResult(NamedTuple):
    eigenvalues: Array
    eigenvectors: Array


class QRResult(NamedTuple):
    Q: Array
    R: Array


class SlogdetResult(NamedTuple):
    sign: Array
    logabsdet: Array


class SVDResult(NamedTuple):
    U: Array
    S: Array
    Vh: Array


# -- checks ------------------------------------------------------------------------------------------
def _floating(name: str, x: Array) -> None:
    context_of(x)
    if x.dtype.kind not in "fc":
        raise TypeError(f"linalg.{name} takes floating-point arrays, got {x.dtype}")


def _numeric(name: str, x: Array) -> None:
    context_of(x)
    if x.dtype.kind == "b":
        raise TypeError(f"linalg.{name} takes numeric arrays, got {x.dtype}")


def _matrices(name: str, x: Array, square: bool = False) -> None:
    """ValueError unless ``x`` is a (stack of) matrices, square where ``square``."""
    if x.ndim < 2:
        raise ValueError(f"linalg.{name} needs an array of at least 2 dimensions, got shape {x.shape}")
    if square and x.shape[-1] != x.shape[-2]:
        raise ValueError(f"linalg.{name} needs square matrices, got shape {x.shape}")


def _float_matrices(name: str, x: Array, square: bool = False) -> None:
    """What every matrix routine of the library checks: floating (stacks of) matrices, square where ``square``."""
    _floating(name, x)
    _matrices(name, x, square)


def _real_dtype(dtype: np.dtype[Any]) -> np.dtype[Any]:
    return np.dtype(f"float{dtype.itemsize * 4}") if dtype.kind == "c" else dtype


# -- library operations --------------------------------------------------------------------------------
def cholesky(x: Array, /, *, upper: bool = False) -> Array:
    """The Cholesky factor of the Hermitian positive-definite (stack of) ``x``: lower (``L @ L^H``) or upper."""
    _float_matrices("cholesky", x, square=True)
    (out,) = call("linalg.cholesky", [x], {"upper": bool(upper)})
    return out


def det(x: Array, /) -> Array:
    """The determinant of each square matrix of ``x``."""
    _float_matrices("det", x, square=True)
    (out,) = call("linalg.det", [x])
    return out


def eigh(x: Array, /) -> EighResult:
    """Eigenvalues (ascending, real) and eigenvectors (columns) of the Hermitian (stack of) ``x``."""
    _float_matrices("eigh", x, square=True)
    values, vectors = call("linalg.eigh", [x])
    return EighResult(values, vectors)


def eigvalsh(x: Array, /) -> Array:
    """Eigenvalues (ascending, real) of the Hermitian (stack of) ``x``."""
    _float_matrices("eigvalsh", x, square=True)
    (out,) = call("linalg.eigvalsh", [x])
    return out


def inv(x: Array, /) -> Array:
    """The inverse of each square matrix of ``x``."""
    _float_matrices("inv", x, square=True)
    (out,) = call("linalg.inv", [x])
    return out


def _host_rtol(rtol: float | Array | None) -> float | Array | None:
    """``rtol`` as the library operation's float param where it is one number; an array of several stays one."""
    if rtol is None or (isinstance(rtol, Array) and rtol.ndim > 0):
        return rtol
    if isinstance(rtol, Array):
        return float(read_scalar(rtol))  # a 0-d array: one number (a host read, as a Python float's would be)
    return float(rtol)


def pinv(x: Array, /, *, rtol: float | Array | None = None) -> Array:
    """The Moore-Penrose pseudo-inverse of each matrix of ``x``; singular values at most ``rtol`` times the
    largest count as zero (default: ``max(M, N) * eps``)."""
    _float_matrices("pinv", x)
    tol = _host_rtol(rtol)
    if isinstance(tol, Array):
        return _pinv_stacked_rtol(x, tol)
    (out,) = call("linalg.pinv", [x], {"rtol": tol})
    return out


def _pinv_stacked_rtol(x: Array, rtol: Array) -> Array:
    """pinv with one rtol per matrix (an array ``rtol`` broadcast against the stack): ``V diag(1/S) U^H`` where S
    is above its matrix's cutoff, composed from svd."""
    u, s, vh = svd(x, full_matrices=False)
    cutoff = _elementwise.multiply(_statistical.max(s, axis=-1, keepdims=True), _expand_last(rtol))
    keep = _elementwise.greater(s, cutoff)
    safe = _elementwise.where(keep, s, 1)
    s_inv = _elementwise.where(keep, _elementwise.divide(1, safe), 0)
    v = _conj_transpose(vh)
    scaled = _elementwise.multiply(v, _expand_second_last(cast(s_inv, v.dtype)))
    return matmul(scaled, _conj_transpose(u))


def _conj_transpose(x: Array) -> Array:
    t = matrix_transpose(x)
    return _elementwise.conj(t) if x.dtype.kind == "c" else t


def _expand_last(x: Array) -> Array:
    return reshape(x, (*x.shape, 1))


def _expand_second_last(x: Array) -> Array:
    return reshape(x, (*x.shape[:-1], 1, x.shape[-1]))


def qr(x: Array, /, *, mode: Literal["reduced", "complete"] = "reduced") -> QRResult:
    """The QR factorization of each matrix of ``x`` (``mode`` "reduced" or "complete")."""
    _float_matrices("qr", x)
    if mode not in ("reduced", "complete"):
        raise ValueError(f"linalg.qr: mode must be 'reduced' or 'complete', got {mode!r}")
    q, r = call("linalg.qr", [x], {"mode": mode})
    return QRResult(q, r)


def slogdet(x: Array, /) -> SlogdetResult:
    """The sign (or phase, for complex) and the natural log of the absolute value of each determinant."""
    _float_matrices("slogdet", x, square=True)
    sign, logabsdet = call("linalg.slogdet", [x])
    return SlogdetResult(sign, logabsdet)


def solve(x1: Array, x2: Array, /) -> Array:
    """The solution of ``x1 @ x = x2`` for square ``x1``; ``x2`` is a vector only when it is 1-d, else a (stack
    of) matrices whose batch dimensions broadcast against ``x1``'s."""
    _floating("solve", x1)
    _floating("solve", x2)
    context_of(x1, x2)
    _matrices("solve", x1, square=True)
    dtype = promote(x1.dtype, x2.dtype)
    if x2.ndim == 0:
        raise ValueError("linalg.solve: x2 must have at least 1 dimension")
    rows = x2.shape[0] if x2.ndim == 1 else x2.shape[-2]
    if rows != x1.shape[-1]:
        raise ValueError(f"linalg.solve: shapes {x1.shape} and {x2.shape} do not align")
    if x2.ndim > 1:
        broadcast_shapes(x1.shape[:-2], x2.shape[:-2])  # ValueError where the stacks do not broadcast
    (out,) = call("linalg.solve", [cast(x1, dtype), cast(x2, dtype)])
    return out


def svd(x: Array, /, *, full_matrices: bool = True) -> SVDResult:
    """The singular value decomposition ``x = U @ diag(S) @ Vh`` of each matrix (S descending, real)."""
    _float_matrices("svd", x)
    u, s, vh = call("linalg.svd", [x], {"full_matrices": bool(full_matrices)})
    return SVDResult(u, s, vh)


def svdvals(x: Array, /) -> Array:
    """The singular values of each matrix of ``x`` (descending, real)."""
    _float_matrices("svdvals", x)
    (out,) = call("linalg.svdvals", [x])
    return out


def matrix_rank(x: Array, /, *, rtol: float | Array | None = None) -> Array:
    """The rank of each matrix of ``x``: its count of singular values above ``rtol`` times the largest
    (default ``rtol``: ``max(M, N) * eps``)."""
    _float_matrices("matrix_rank", x)
    tol = _host_rtol(rtol)
    if isinstance(tol, Array):
        s = svdvals(x)
        cutoff = _elementwise.multiply(_statistical.max(s, axis=-1, keepdims=True), _expand_last(tol))
        return _statistical.sum(_elementwise.greater(s, cutoff), axis=-1, dtype=np.dtype("int64"))
    (out,) = call("linalg.matrix_rank", [x], {"rtol": tol})
    return out


# -- composed ---------------------------------------------------------------------------------------------
def _component(x: Array, axis: int, index: int) -> Array:
    """The view of ``x`` at ``index`` along ``axis`` (that axis removed)."""
    v = x._view
    shape = v.shape[:axis] + v.shape[axis + 1:]
    strides = v.strides[:axis] + v.strides[axis + 1:]
    return wrap(x._ctx, x._storage, View(v.buffer, v.dtype, shape, strides, v.offset + index * v.strides[axis]))


def cross(x1: Array, x2: Array, /, *, axis: int = -1) -> Array:
    """The cross product of the 3-element vectors along ``axis`` (negative, counted from the last dimension);
    the other dimensions broadcast."""
    _numeric("cross", x1)
    _numeric("cross", x2)
    ctx = context_of(x1, x2)
    dtype = promote(x1.dtype, x2.dtype)
    if not isinstance(axis, (int, np.integer)) or isinstance(axis, bool):
        raise TypeError(f"linalg.cross: axis must be an integer, got {type(axis).__name__}")
    if x1.ndim == 0 or x2.ndim == 0:
        raise ValueError("linalg.cross needs arrays of at least 1 dimension")
    if axis >= 0:
        raise ValueError("linalg.cross: axis must be negative (counted from the last dimension)")
    if axis < -min(x1.ndim, x2.ndim):
        raise ValueError(f"linalg.cross: axis {axis} is out of bounds for shapes {x1.shape} and {x2.shape}")
    if x1.shape[axis] != 3 or x2.shape[axis] != 3:
        raise ValueError(f"linalg.cross: axis {axis} must have 3 elements in both, got {x1.shape} and {x2.shape}")
    a = [_component(x1, x1.ndim + axis, i) for i in range(3)]
    b = [_component(x2, x2.ndim + axis, i) for i in range(3)]
    rest = broadcast_shapes(a[0].shape, b[0].shape)
    position = len(rest) + 1 + axis
    out = empty_array(ctx, (*rest[:position], 3, *rest[position:]), dtype)
    mul, sub = _elementwise.multiply, _elementwise.subtract
    for i in range(3):
        j, k = (i + 1) % 3, (i + 2) % 3
        value = sub(mul(a[j], b[k]), mul(a[k], b[j]))
        if out.size:
            ctx.kernels.copy(_component(out, position, i)._view, value._view)
    return out


def diagonal(x: Array, /, *, offset: int = 0) -> Array:
    """The ``offset`` diagonal of each matrix of ``x`` (a view: one stride, the row's plus the column's)."""
    context_of(x)
    _matrices("diagonal", x)
    if not isinstance(offset, (int, np.integer)) or isinstance(offset, bool):
        raise TypeError(f"linalg.diagonal: offset must be an integer, got {type(offset).__name__}")
    offset = int(offset)
    v = x._view
    rows, cols = v.shape[-2:]
    row_stride, col_stride = v.strides[-2:]
    if offset >= 0:
        length = max(0, min(rows, cols - offset))
        start = v.offset + offset * col_stride if length else v.offset
    else:
        length = max(0, min(rows + offset, cols))
        start = v.offset - offset * row_stride if length else v.offset
    return wrap(x._ctx, x._storage, View(v.buffer, v.dtype, (*v.shape[:-2], length),
                                         (*v.strides[:-2], row_stride + col_stride), start))


def trace(x: Array, /, *, offset: int = 0, dtype: np.dtype[Any] | None = None) -> Array:
    """The sum of the ``offset`` diagonal of each matrix (``sum``'s dtype rules)."""
    _numeric("trace", x)
    return _statistical.sum(diagonal(x, offset=offset), axis=-1, dtype=dtype)


def outer(x1: Array, x2: Array, /) -> Array:
    """The outer product of two vectors: ``out[i, j] = x1[i] * x2[j]``."""
    _numeric("outer", x1)
    _numeric("outer", x2)
    context_of(x1, x2)
    if x1.ndim != 1 or x2.ndim != 1:
        raise ValueError(f"linalg.outer takes 1-d arrays, got shapes {x1.shape} and {x2.shape}")
    return _elementwise.multiply(reshape(x1, (x1.shape[0], 1)), reshape(x2, (1, x2.shape[0])))


def _norm_axes(axis: int | tuple[int, ...] | None, ndim: int) -> tuple[int, ...]:
    if axis is None:
        return tuple(range(ndim))
    axes = (axis,) if isinstance(axis, (int, np.integer)) else tuple(axis)
    out = []
    for a in axes:
        if not isinstance(a, (int, np.integer)) or isinstance(a, bool):
            raise TypeError(f"linalg.vector_norm: axis must be an int or a tuple of ints, got {axis!r}")
        if not -ndim <= a < ndim:
            raise IndexError(f"linalg.vector_norm: axis {a} is out of bounds for {ndim} dimensions")
        out.append(int(a) % ndim)
    if len(set(out)) != len(out):
        raise ValueError(f"linalg.vector_norm: repeated axes in {axis!r}")
    return tuple(out)


def vector_norm(x: Array, /, *, axis: int | tuple[int, ...] | None = None, keepdims: bool = False,
                ord: int | float = 2) -> Array:
    """The ``ord``-norm of ``x`` over ``axis`` (all axes by default): a real floating array."""
    _floating("vector_norm", x)
    axes = _norm_axes(axis, x.ndim)
    magnitude = _elementwise.abs(x)  # real, of x's precision

    def reduce_sum(y: Array) -> Array:
        return _statistical.sum(y, axis=axes, keepdims=keepdims)

    if ord == 2:
        return _elementwise.sqrt(reduce_sum(_elementwise.multiply(magnitude, magnitude)))
    if ord == 1:
        return reduce_sum(magnitude)
    if ord == math.inf:
        return _statistical.max(magnitude, axis=axes, keepdims=keepdims)
    if ord == -math.inf:
        return _statistical.min(magnitude, axis=axes, keepdims=keepdims)
    if ord == 0:
        return reduce_sum(cast(_elementwise.not_equal(magnitude, 0), magnitude.dtype))
    if not isinstance(ord, (int, float, np.integer, np.floating)) or isinstance(ord, bool):
        raise TypeError(f"linalg.vector_norm: ord must be a number, got {type(ord).__name__}")
    power = float(ord)
    return _elementwise.pow(reduce_sum(_elementwise.pow(magnitude, power)), 1.0 / power)


def matrix_norm(x: Array, /, *, keepdims: bool = False,
                ord: int | float | Literal["fro", "nuc"] | None = "fro") -> Array:
    """The ``ord``-norm of each matrix of ``x``: "fro" (default), "nuc", 1, -1, 2, -2, inf, -inf."""
    _float_matrices("matrix_norm", x)
    stack = x.shape[:-2]
    if ord is None or ord == "fro":
        magnitude = _elementwise.abs(x)
        result = _elementwise.sqrt(_statistical.sum(_elementwise.multiply(magnitude, magnitude), axis=(-2, -1)))
    elif ord in ("nuc", 2, -2):
        s = svdvals(x)
        if ord == "nuc":
            result = _statistical.sum(s, axis=-1)
        else:
            result = (_statistical.max if ord == 2 else _statistical.min)(s, axis=-1)
    elif ord in (1, -1, math.inf, -math.inf):
        # 1: the largest column sum of magnitudes; inf: the largest row sum (-1, -inf: the smallest)
        along = -2 if ord in (1, -1) else -1
        sums = _statistical.sum(_elementwise.abs(x), axis=along)
        result = (_statistical.max if ord in (1, math.inf) else _statistical.min)(sums, axis=-1)
    else:
        raise ValueError(f"linalg.matrix_norm: ord must be 'fro', 'nuc', 1, -1, 2, -2, inf or -inf, got {ord!r}")
    return reshape(result, (*stack, 1, 1)) if keepdims else result


def matrix_power(x: Array, n: int, /) -> Array:
    """``x`` multiplied by itself ``n`` times (the identity for 0, powers of the inverse for negative ``n``), by
    repeated squaring."""
    _float_matrices("matrix_power", x, square=True)
    if not isinstance(n, (int, np.integer)) or isinstance(n, bool):
        raise TypeError(f"linalg.matrix_power: n must be an integer, got {type(n).__name__}")
    n = int(n)
    if n == 0:
        out = empty_array(x._ctx, x.shape, x.dtype)
        if out.size:
            x._ctx.kernels.fill(out._view, 0)
            x._ctx.kernels.fill(diagonal(out)._view, 1)
        return out
    base = inv(x) if n < 0 else x
    n = abs(n)
    result: Array | None = None
    while True:
        if n & 1:
            result = base if result is None else matmul(result, base)
        n >>= 1
        if not n:
            break
        base = matmul(base, base)
    assert result is not None
    return copy_view(result) if result is x else result
