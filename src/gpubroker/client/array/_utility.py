"""Utility functions: ``all``, ``any`` (reductions by the generated kernels) and ``diff``."""

from __future__ import annotations

from typing import Final

import numpy as np

from gpubroker.client.array._array import Array, wrap
from gpubroker.client.array._elementwise import not_equal, positive, subtract
from gpubroker.client.array._manipulation import concat
from gpubroker.client.array._statistical import reduce_into
from gpubroker.client.array._views import View, normalize_axes, normalize_axis

__all__ = ["all", "any", "diff"]

_BOOL: Final = np.dtype(np.bool_)


def _check(fn: str, x: object) -> Array:
    if not isinstance(x, Array):
        raise TypeError(f"{fn} takes an array, got {type(x).__name__}")
    return x


def all(x: Array, /, *, axis: int | tuple[int, ...] | None = None, keepdims: bool = False) -> Array:
    """Whether every element over ``axis`` is nonzero (True over an empty axis)."""
    x = _check("all", x)
    return reduce_into("all", x, normalize_axes(axis, x.ndim), keepdims, _BOOL)


def any(x: Array, /, *, axis: int | tuple[int, ...] | None = None, keepdims: bool = False) -> Array:
    """Whether some element over ``axis`` is nonzero (False over an empty axis)."""
    x = _check("any", x)
    return reduce_into("any", x, normalize_axes(axis, x.ndim), keepdims, _BOOL)


def _shifted(x: Array, axis: int, start: int, extent: int) -> Array:
    """The view of ``x`` taking ``extent`` elements along ``axis`` from ``start``."""
    v = x._view
    shape = (*v.shape[:axis], extent, *v.shape[axis + 1:])
    return wrap(x._ctx, x._storage, View(v.buffer, v.dtype, shape, v.strides, v.offset + start * v.strides[axis]))


def diff(x: Array, /, *, axis: int = -1, n: int = 1, prepend: Array | None = None,
         append: Array | None = None) -> Array:
    """The ``n``-th forward difference along ``axis`` (``x[i+1] - x[i]``; for booleans ``x[i+1] != x[i]``),
    after joining ``prepend`` and ``append`` to ``x`` along it."""
    x = _check("diff", x)
    if x.ndim == 0:
        raise ValueError("diff needs an array of at least one dimension")
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"diff's n must be a non-negative int, got {n!r}")
    axis = normalize_axis(axis, x.ndim)
    if prepend is not None or append is not None:
        parts = [p for p in (prepend, x, append) if p is not None]
        x = concat(parts, axis=axis)
    if n == 0:
        return positive(x) if x.dtype.kind != "b" else not_equal(x, False)
    for _ in range(n):
        extent = x.shape[axis]
        if extent == 0:
            return _shifted(x, axis, 0, 0)
        later, earlier = _shifted(x, axis, 1, extent - 1), _shifted(x, axis, 0, extent - 1)
        x = not_equal(later, earlier) if x.dtype.kind == "b" else subtract(later, earlier)
    return x
