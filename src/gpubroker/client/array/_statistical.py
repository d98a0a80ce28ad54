"""Statistical functions (max, mean, min, prod, std, sum, var) and argmax, argmin, count_nonzero: reductions by
the generated kernels (``Kernels.reduce``: one work-group per output element, a shared-memory tree).

``mean`` is a sum then a division; ``var`` two passes (the mean, then the sum of squared deviations from it), which
keeps float32 data accurate where one pass of sums of squares would cancel.
"""

from __future__ import annotations

from typing import Any, Final

import numpy as np

from gpubroker.client.array._array import Array, empty_array, wrap
from gpubroker.client.array._context import Context
from gpubroker.client.array._creation import require_dtype
from gpubroker.client.array._elementwise import divide, sqrt
from gpubroker.client.array._views import View, contiguous_strides, normalize_axes, normalize_axis

__all__ = ["argmax", "argmin", "count_nonzero", "max", "mean", "min", "prod", "std", "sum", "var"]

_I64: Final = np.dtype(np.int64)
_U64: Final = np.dtype(np.uint64)
_BOOL: Final = np.dtype(np.bool_)


def _check(fn: str, x: object, kinds: str) -> Array:
    if not isinstance(x, Array):
        raise TypeError(f"{fn} takes an array, got {type(x).__name__}")
    if x.dtype.kind not in kinds:
        raise TypeError(f"{fn} is not defined for {x.dtype}")
    return x


def reduce_into(fn: str, x: Array, axes: tuple[int, ...], keepdims: bool, out_dtype: np.dtype[Any],
                center: Array | None = None) -> Array:
    """A fresh array of ``fn`` over ``axes`` of ``x`` (``keepdims``: the reduced axes stay, of extent 1)."""
    ctx: Context = x._ctx
    kept = tuple(s for k, s in enumerate(x.shape) if k not in axes)
    shape = tuple(1 if k in axes else s for k, s in enumerate(x.shape)) if keepdims else kept
    out = empty_array(ctx, shape, out_dtype)
    view = out._view if not keepdims else View(out._view.buffer, out_dtype, kept, contiguous_strides(kept),
                                               out._view.offset)
    cview = None
    if center is not None:
        cview = center._view
        if cview.shape != kept:  # a keepdims center: the same memory without its extent-1 axes
            cview = View(cview.buffer, cview.dtype, kept, contiguous_strides(kept), cview.offset)
    ctx.kernels.reduce(fn, view, x._view, axes, cview)
    return out


def _nonempty(fn: str, x: Array, axes: tuple[int, ...]) -> None:
    if any(x.shape[k] == 0 for k in axes) or (not axes and x.size == 0):
        raise ValueError(f"{fn} of an empty array (axes {axes} of shape {x.shape}) has no identity")


def max(x: Array, /, *, axis: int | tuple[int, ...] | None = None, keepdims: bool = False) -> Array:
    """The largest element over ``axis`` (NaN if any is NaN); ValueError over an empty axis."""
    x = _check("max", x, "iuf")
    axes = normalize_axes(axis, x.ndim)
    _nonempty("max", x, axes)
    return reduce_into("max", x, axes, keepdims, x.dtype)


def min(x: Array, /, *, axis: int | tuple[int, ...] | None = None, keepdims: bool = False) -> Array:
    """The smallest element over ``axis`` (NaN if any is NaN); ValueError over an empty axis."""
    x = _check("min", x, "iuf")
    axes = normalize_axes(axis, x.ndim)
    _nonempty("min", x, axes)
    return reduce_into("min", x, axes, keepdims, x.dtype)


def _sum_dtype(fn: str, x: Array, dtype: Any) -> np.dtype[Any]:
    if dtype is not None:
        return require_dtype(x._ctx, dtype)
    if x.dtype.kind in "bi":
        return _I64  # the standard: small integers sum in the default integer dtype
    if x.dtype.kind == "u":
        return _U64
    return x.dtype


def sum(x: Array, /, *, axis: int | tuple[int, ...] | None = None, dtype: Any = None,
        keepdims: bool = False) -> Array:
    """The sum over ``axis``, accumulated in ``dtype`` (default: int64 / uint64 for integers, else ``x``'s);
    pairwise within each work-group's tree."""
    x = _check("sum", x, "biufc")
    return reduce_into("sum", x, normalize_axes(axis, x.ndim), keepdims, _sum_dtype("sum", x, dtype))


def prod(x: Array, /, *, axis: int | tuple[int, ...] | None = None, dtype: Any = None,
         keepdims: bool = False) -> Array:
    """The product over ``axis`` in ``dtype`` (default as for ``sum``)."""
    x = _check("prod", x, "biufc")
    return reduce_into("prod", x, normalize_axes(axis, x.ndim), keepdims, _sum_dtype("prod", x, dtype))


def _count(x: Array, axes: tuple[int, ...]) -> int:
    n = 1
    for k in axes:
        n *= x.shape[k]
    return n


def mean(x: Array, /, *, axis: int | tuple[int, ...] | None = None, keepdims: bool = False) -> Array:
    """The arithmetic mean over ``axis`` (NaN over an empty axis)."""
    x = _check("mean", x, "fc")
    axes = normalize_axes(axis, x.ndim)
    total = reduce_into("sum", x, axes, keepdims, x.dtype)
    return divide(total, float(_count(x, axes)))


def var(x: Array, /, *, axis: int | tuple[int, ...] | None = None, correction: int | float = 0.0,
        keepdims: bool = False) -> Array:
    """The variance over ``axis``: the sum of squared deviations from the mean over ``N - correction`` (NaN
    where that is not positive)."""
    x = _check("var", x, "f")
    axes = normalize_axes(axis, x.ndim)
    n = _count(x, axes)
    center = mean(x, axis=axes, keepdims=False)
    squares = reduce_into("sumsq", x, axes, keepdims, x.dtype, center)
    dof = n - correction
    return divide(squares, float(dof) if dof > 0 else float("nan"))


def std(x: Array, /, *, axis: int | tuple[int, ...] | None = None, correction: int | float = 0.0,
        keepdims: bool = False) -> Array:
    """The standard deviation: ``sqrt(var(...))``."""
    x = _check("std", x, "f")
    return sqrt(var(x, axis=axis, correction=correction, keepdims=keepdims))


def _arg(fn: str, x: Array, axis: int | None, keepdims: bool) -> Array:
    x = _check(fn, x, "iuf")
    if axis is None:
        axes = tuple(range(x.ndim))
        _nonempty(fn, x, axes)
        out = reduce_into(fn, x, axes, False, _I64)
        if keepdims:
            shape = (1,) * x.ndim
            out = wrap(out._ctx, out._storage, View(out._view.buffer, _I64, shape, (1,) * x.ndim, out._view.offset))
        return out
    axes = (normalize_axis(axis, x.ndim),)
    _nonempty(fn, x, axes)
    return reduce_into(fn, x, axes, keepdims, _I64)


def argmax(x: Array, /, *, axis: int | None = None, keepdims: bool = False) -> Array:
    """The index of the first largest element along ``axis`` (of the flattened array for None); NaN counts as
    the largest."""
    return _arg("argmax", x, axis, keepdims)


def argmin(x: Array, /, *, axis: int | None = None, keepdims: bool = False) -> Array:
    """The index of the first smallest element along ``axis`` (of the flattened array for None); NaN counts as
    the smallest."""
    return _arg("argmin", x, axis, keepdims)


def count_nonzero(x: Array, /, *, axis: int | tuple[int, ...] | None = None, keepdims: bool = False) -> Array:
    """How many elements over ``axis`` are not zero (int64)."""
    x = _check("count_nonzero", x, "biufc")
    return reduce_into("count", x, normalize_axes(axis, x.ndim), keepdims, _I64)
