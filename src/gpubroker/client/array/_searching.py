"""Searching functions run as library operations: ``nonzero`` (a data-dependent shape: count, read, then fill)
and ``searchsorted``. (argmax, argmin and count_nonzero are reductions, ``where`` is elementwise: their modules
own them.)"""

from __future__ import annotations

from typing import Literal

from gpubroker.client.array import _indexing, _statistical
from gpubroker.client.array._array import Array, wrap
from gpubroker.client.array._dtypes import promote
from gpubroker.client.array._library_calls import call, cast, context_of, read_count
from gpubroker.client.array._views import View

__all__ = ["nonzero", "searchsorted"]


def nonzero(x: Array, /) -> tuple[Array, ...]:
    """The indices of the non-zero elements of ``x``: one 1-d int64 array per dimension, in row-major order."""
    context_of(x)
    if x.ndim == 0:
        raise ValueError("nonzero does not take 0-d arrays")
    count = read_count(_statistical.count_nonzero(x)) if x.size else 0
    (indices,) = call("nonzero", [x], {"count": count})  # (ndim, count), C-contiguous
    v = indices._view
    return tuple(wrap(x._ctx, indices._storage, View(v.buffer, v.dtype, (count,), (1,), v.offset + row * count))
                 for row in range(x.ndim))


def searchsorted(x1: Array, x2: Array, /, *, side: Literal["left", "right"] = "left",
                 sorter: Array | None = None) -> Array:
    """Where each element of ``x2`` would be inserted into the sorted 1-d ``x1`` (or ``x1`` taken in the order
    ``sorter``) to keep it sorted: int64 indices of ``x2``'s shape."""
    context_of(x1, x2)
    if x1.dtype.kind in "bc" or x2.dtype.kind in "bc":
        raise TypeError(f"searchsorted takes real numeric arrays, got {x1.dtype} and {x2.dtype}")
    if x1.ndim != 1:
        raise ValueError(f"searchsorted: x1 must be 1-d, got shape {x1.shape}")
    if side not in ("left", "right"):
        raise ValueError(f"searchsorted: side must be 'left' or 'right', got {side!r}")
    if sorter is not None:
        context_of(x1, sorter)
        if sorter.dtype.kind not in "iu":
            raise TypeError(f"searchsorted: sorter must have an integer dtype, got {sorter.dtype}")
        if sorter.shape != x1.shape:
            raise ValueError(f"searchsorted: sorter's shape {sorter.shape} is not x1's {x1.shape}")
        x1 = _indexing.take(x1, sorter)
    dtype = promote(x1.dtype, x2.dtype)
    (out,) = call("searchsorted", [cast(x1, dtype), cast(x2, dtype)], {"side": side})
    return out
