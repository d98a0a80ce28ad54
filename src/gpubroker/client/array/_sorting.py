"""Sorting functions: ``sort`` and ``argsort``, library operations in the worker (CuPy's sorts on CUDA, NumPy's
on PoCL; stable by default, and a stable descending sort keeps equal elements in their original order)."""

from __future__ import annotations

from gpubroker.client.array._array import Array
from gpubroker.client.array._library_calls import call, context_of, normalize_axis

__all__ = ["argsort", "sort"]


def _sorted(op: str, x: Array, axis: int, descending: bool, stable: bool) -> Array:
    context_of(x)
    if x.dtype.kind == "c":
        raise TypeError(f"{op} takes real-valued arrays, got {x.dtype}")
    axis = normalize_axis(axis, x.ndim)
    (out,) = call(op, [x], {"axis": axis, "descending": bool(descending), "stable": bool(stable)})
    return out


def sort(x: Array, /, *, axis: int = -1, descending: bool = False, stable: bool = True) -> Array:
    """A sorted copy of ``x`` along ``axis`` (NaNs last when ascending)."""
    return _sorted("sort", x, axis, descending, stable)


def argsort(x: Array, /, *, axis: int = -1, descending: bool = False, stable: bool = True) -> Array:
    """The indices (int64) that sort ``x`` along ``axis``."""
    return _sorted("argsort", x, axis, descending, stable)
