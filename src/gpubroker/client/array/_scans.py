"""Cumulative sums and products (the standard's 2024.12 ``cumulative_sum`` and ``cumulative_prod``): library
operations in the worker, with the standard's dtype rules (small integers accumulate in the default integer)."""

from __future__ import annotations

from typing import Any

import numpy as np

from gpubroker.client.array._array import Array
from gpubroker.client.array._dtypes import ALL_DTYPES
from gpubroker.client.array._library_calls import call, context_of, normalize_axis

__all__ = ["cumulative_prod", "cumulative_sum"]


def _scan(op: str, x: Array, axis: int | None, dtype: np.dtype[Any] | None, include_initial: bool) -> Array:
    context_of(x)
    if x.dtype.kind == "b":
        raise TypeError(f"{op} takes numeric arrays, got {x.dtype}")
    if dtype is not None and (not isinstance(dtype, np.dtype) or dtype not in ALL_DTYPES):
        raise TypeError(f"{op}: dtype must be one of the standard's dtypes, got {dtype!r}")
    if x.ndim == 0:
        raise ValueError(f"{op} needs an array of at least 1 dimension")
    if axis is None:
        if x.ndim > 1:
            raise ValueError(f"{op}: axis is required for an array of {x.ndim} dimensions")
        axis = 0
    axis = normalize_axis(axis, x.ndim)
    (out,) = call(op, [x], {"axis": axis, "include_initial": bool(include_initial),
                            "dtype": None if dtype is None else dtype.name})
    return out


def cumulative_sum(x: Array, /, *, axis: int | None = None, dtype: np.dtype[Any] | None = None,
                   include_initial: bool = False) -> Array:
    """The running sums of ``x`` along ``axis`` (optional for 1-d ``x``), starting with 0 if
    ``include_initial``."""
    return _scan("cumulative_sum", x, axis, dtype, include_initial)


def cumulative_prod(x: Array, /, *, axis: int | None = None, dtype: np.dtype[Any] | None = None,
                    include_initial: bool = False) -> Array:
    """The running products of ``x`` along ``axis`` (optional for 1-d ``x``), starting with 1 if
    ``include_initial``."""
    return _scan("cumulative_prod", x, axis, dtype, include_initial)
