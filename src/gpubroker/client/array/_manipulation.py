"""Manipulation functions: shape, axis order and layout changes, joining, splitting and repetition.

Whatever a strided view can express is a view sharing the input's storage (no device work): ``permute_dims``,
``moveaxis``, ``expand_dims``, ``squeeze``, ``flip``, ``broadcast_to``, ``unstack`` and ``reshape`` where the
layout allows. The rest writes fresh arrays with the strided gather/copy kernel.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from gpubroker.client.array._array import Array, copy_into, copy_view, empty_array, to_host, wrap
from gpubroker.client.array._creation import upload
from gpubroker.client.array._dtypes import result_type_of
from gpubroker.client.array._gather import gather
from gpubroker.client.array._indexing import take
from gpubroker.client.array._views import (
    AxisError,
    View,
    broadcast_shapes,
    broadcast_view,
    contiguous_strides,
    normalize_axes,
    normalize_axis,
)

__all__ = ["broadcast_arrays", "broadcast_to", "concat", "expand_dims", "flip", "moveaxis", "permute_dims", "repeat",
           "reshape", "roll", "squeeze", "stack", "tile", "unstack"]


def _check(x: object) -> Array:
    if not isinstance(x, Array):
        raise TypeError(f"expected an array, got {type(x).__name__}")
    return x


def _view(x: Array, shape: Sequence[int], strides: Sequence[int], offset: int | None = None) -> Array:
    v = x._view
    return wrap(x._ctx, x._storage, View(v.buffer, v.dtype, tuple(shape), tuple(strides),
                                         v.offset if offset is None else offset))


# -- views --------------------------------------------------------------------------------------------
def permute_dims(x: Array, /, axes: tuple[int, ...]) -> Array:
    """The axes reordered (a view): result axis ``i`` is ``x``'s axis ``axes[i]``."""
    x = _check(x)
    perm = tuple(normalize_axis(a, x.ndim) for a in axes)
    if sorted(perm) != list(range(x.ndim)):
        raise ValueError(f"axes {axes!r} are not a permutation of {x.ndim} axes")
    v = x._view
    return _view(x, [v.shape[a] for a in perm], [v.strides[a] for a in perm])


def moveaxis(x: Array, source: int | tuple[int, ...], destination: int | tuple[int, ...], /) -> Array:
    """Axes moved to new positions, the others keeping their order (a view)."""
    x = _check(x)
    src = normalize_axes(source, x.ndim)
    dst = normalize_axes(destination, x.ndim)
    if len(src) != len(dst):
        raise ValueError("source and destination must name as many axes")
    order = [a for a in range(x.ndim) if a not in src]
    for d, s in sorted(zip(dst, src, strict=True)):
        order.insert(d, s)
    return permute_dims(x, tuple(order))


def expand_dims(x: Array, /, axis: int = 0) -> Array:
    """A new axis of extent 1 at ``axis`` (in the result's axes; negative counts from its end). A view."""
    x = _check(x)
    if not -x.ndim - 1 <= axis <= x.ndim:
        raise IndexError(f"axis {axis} is out of range for a result of {x.ndim + 1} dimensions")
    axis %= x.ndim + 1
    v = x._view
    return _view(x, (*v.shape[:axis], 1, *v.shape[axis:]), (*v.strides[:axis], 0, *v.strides[axis:]))


def squeeze(x: Array, /, axis: int | tuple[int, ...]) -> Array:
    """Axes of extent 1 removed (a view); ValueError for an axis of another extent."""
    x = _check(x)
    axes = normalize_axes(axis, x.ndim)
    for a in axes:
        if x.shape[a] != 1:
            raise ValueError(f"cannot squeeze axis {a}: its extent is {x.shape[a]}, not 1")
    v = x._view
    keep = [d for d in range(x.ndim) if d not in axes]
    return _view(x, [v.shape[d] for d in keep], [v.strides[d] for d in keep])


def flip(x: Array, /, *, axis: int | tuple[int, ...] | None = None) -> Array:
    """The elements reversed along ``axis`` (all axes for None): a view with negative strides."""
    x = _check(x)
    axes = normalize_axes(axis, x.ndim)
    v = x._view
    offset = v.offset
    strides = list(v.strides)
    for a in axes:
        if v.shape[a] > 0:
            offset += (v.shape[a] - 1) * v.strides[a]
        strides[a] = -strides[a]
    return _view(x, v.shape, strides, offset)


def broadcast_to(x: Array, /, shape: tuple[int, ...]) -> Array:
    """``x`` broadcast to ``shape`` (a view; stride 0 where it repeats)."""
    x = _check(x)
    return wrap(x._ctx, x._storage, broadcast_view(x._view, tuple(int(s) for s in shape)))


def broadcast_arrays(*arrays: Array) -> list[Array]:
    """The arrays broadcast to their common shape (views)."""
    shape = broadcast_shapes(*(_check(a).shape for a in arrays))
    return [broadcast_to(a, shape) for a in arrays]


def unstack(x: Array, /, *, axis: int = 0) -> tuple[Array, ...]:
    """The views along ``axis``."""
    x = _check(x)
    axis = normalize_axis(axis, x.ndim)
    key: list[Any] = [slice(None)] * axis
    return tuple(x[(*key, i)] for i in range(x.shape[axis]))


# -- reshape --------------------------------------------------------------------------------------------
def _resolve_shape(shape: Sequence[int], size: int) -> tuple[int, ...]:
    dims = [int(s) for s in shape]
    unknown = [i for i, d in enumerate(dims) if d == -1]
    if len(unknown) > 1:
        raise ValueError("only one dimension of a shape may be -1")
    if any(d < -1 for d in dims):
        raise ValueError(f"invalid shape {tuple(dims)}")
    known = 1
    for d in dims:
        if d != -1:
            known *= d
    if unknown:
        if known == 0 or size % known:
            raise ValueError(f"cannot reshape an array of size {size} into shape {tuple(shape)}")
        dims[unknown[0]] = size // known
    elif known != size:
        raise ValueError(f"cannot reshape an array of size {size} into shape {tuple(shape)}")
    return tuple(dims)


def _reshape_strides(shape: tuple[int, ...], strides: tuple[int, ...],
                     new_shape: tuple[int, ...]) -> tuple[int, ...] | None:
    """Strides that walk ``shape``/``strides``'s elements in row-major order as ``new_shape``, or None where
    no view can (numpy's attempt at a copy-free reshape)."""
    old = [(s, st) for s, st in zip(shape, strides, strict=True) if s != 1]
    old_shape = [s for s, _ in old]
    old_strides = [st for _, st in old]
    new_strides = [0] * len(new_shape)
    oi, oj, ni, nj = 0, 1, 0, 1
    while ni < len(new_shape) and oi < len(old_shape):
        np_ = new_shape[ni]
        op = old_shape[oi]
        while np_ != op:
            if np_ < op:
                np_ *= new_shape[nj]
                nj += 1
            else:
                op *= old_shape[oj]
                oj += 1
        for ok in range(oi, oj - 1):
            if old_strides[ok] != old_shape[ok + 1] * old_strides[ok + 1]:
                return None
        new_strides[nj - 1] = old_strides[oj - 1]
        for nk in range(nj - 1, ni, -1):
            new_strides[nk - 1] = new_strides[nk] * new_shape[nk]
        ni, nj = nj, nj + 1
        oi, oj = oj, oj + 1
    return tuple(new_strides)


def reshape(x: Array, /, shape: tuple[int, ...], *, copy: bool | None = None) -> Array:
    """``x``'s elements (row-major) in ``shape`` (one -1 is inferred): a view where the layout allows and
    ``copy`` is not True; a fresh array otherwise (``copy=False`` then is a ValueError)."""
    x = _check(x)
    new_shape = _resolve_shape((shape,) if isinstance(shape, (int, np.integer)) else shape, x.size)
    v = x._view
    if not copy:
        if x.size == 0:
            return _view(x, new_shape, contiguous_strides(new_shape))
        strides = _reshape_strides(v.shape, v.strides, new_shape)
        if strides is not None:
            return _view(x, new_shape, strides)
        if copy is False:
            raise ValueError(f"reshape(copy=False): a {v.shape} array with strides {v.strides} cannot be viewed "
                             f"as {new_shape}")
    fresh = copy_view(x)
    return _view(fresh, new_shape, contiguous_strides(new_shape))


# -- joining --------------------------------------------------------------------------------------------
def concat(arrays: tuple[Array, ...] | list[Array], /, *, axis: int | None = 0) -> Array:
    """The arrays joined along ``axis`` (flattened first for None), in their promoted dtype."""
    arrays = [_check(a) for a in arrays]
    if not arrays:
        raise ValueError("concat needs at least one array")
    ctx = arrays[0]._ctx
    if any(a._ctx is not ctx for a in arrays):
        raise ValueError("concat's arrays live on different devices")
    dtype = result_type_of(*arrays)
    if axis is None:
        arrays = [reshape(a, (-1,)) for a in arrays]
        axis = 0
    ndim = arrays[0].ndim
    if ndim == 0:
        raise ValueError("zero-dimensional arrays cannot be concatenated")
    if any(a.ndim != ndim for a in arrays):
        raise ValueError(f"concat's arrays must have one rank, got shapes {[a.shape for a in arrays]}")
    axis = normalize_axis(axis, ndim)
    base = arrays[0].shape
    for a in arrays:
        if any(a.shape[d] != base[d] for d in range(ndim) if d != axis):
            raise ValueError(f"shapes {[a.shape for a in arrays]} differ off the concatenation axis {axis}")
    out_shape = (*base[:axis], sum(a.shape[axis] for a in arrays), *base[axis + 1:])
    out = empty_array(ctx, out_shape, dtype)
    start = 0
    lead: list[Any] = [slice(None)] * axis
    for a in arrays:
        extent = a.shape[axis]
        if extent and a.size:
            copy_into(out[(*lead, slice(start, start + extent))], a._view)
        start += extent
    return out


def stack(arrays: tuple[Array, ...] | list[Array], /, *, axis: int = 0) -> Array:
    """The arrays (of one shape) joined along a new axis."""
    arrays = [_check(a) for a in arrays]
    if not arrays:
        raise ValueError("stack needs at least one array")
    shape = arrays[0].shape
    if any(a.shape != shape for a in arrays):
        raise ValueError(f"stack's arrays must have one shape, got {[a.shape for a in arrays]}")
    ndim = len(shape) + 1
    if not -ndim <= axis < ndim:
        raise AxisError(f"axis {axis} is out of range for a result of {ndim} dimensions")
    axis %= ndim
    return concat([expand_dims(a, axis=axis) for a in arrays], axis=axis)


# -- repetition -----------------------------------------------------------------------------------------
def _materialize(x: Array, shape: Sequence[int], strides: Sequence[int]) -> Array:
    """A fresh contiguous array of the strided view ``shape``/``strides`` of ``x``."""
    out = empty_array(x._ctx, tuple(shape), x.dtype)
    gather(x._ctx, out._view, View(x._view.buffer, x.dtype, tuple(shape), tuple(strides), x._view.offset))
    return out


def repeat(x: Array, repeats: int | Array, /, *, axis: int | None = None) -> Array:
    """Each element (or sub-array along ``axis``; of the flattened array for None) repeated ``repeats``
    times (an int, or an array of one count per element: a data-dependent shape, read on the host)."""
    x = _check(x)
    if axis is None:
        x = reshape(x, (-1,))
        axis = 0
    axis = normalize_axis(axis, x.ndim)
    if isinstance(repeats, Array):
        if repeats.dtype.kind not in "iu":
            raise TypeError(f"repeats must have an integer dtype, got {repeats.dtype}")
        counts = to_host(repeats)
        if counts.ndim > 1:
            raise ValueError("repeats must be 0-d or 1-d")
        if (counts < 0).any():
            raise ValueError("repeats must be non-negative")
        counts = np.broadcast_to(counts, (x.shape[axis],))
        positions = np.repeat(np.arange(x.shape[axis], dtype=np.int64), counts)
        return take(x, upload(x._ctx, positions), axis=axis)
    if isinstance(repeats, bool) or not isinstance(repeats, (int, np.integer)):
        raise TypeError(f"repeats must be an int or an integer array, got {type(repeats).__name__}")
    count = int(repeats)
    if count < 0:
        raise ValueError("repeats must be non-negative")
    v = x._view
    shape = (*v.shape[:axis + 1], count, *v.shape[axis + 1:])
    strides = (*v.strides[:axis + 1], 0, *v.strides[axis + 1:])
    fresh = _materialize(x, shape, strides)
    out_shape = (*v.shape[:axis], v.shape[axis] * count, *v.shape[axis + 1:])
    return _view(fresh, out_shape, contiguous_strides(out_shape))


def tile(x: Array, repetitions: tuple[int, ...], /) -> Array:
    """``x`` repeated ``repetitions[i]`` times along axis ``i`` (shapes aligned at their ends)."""
    x = _check(x)
    reps = tuple(int(r) for r in repetitions)
    if any(r < 0 for r in reps):
        raise ValueError("repetitions must be non-negative")
    ndim = max(x.ndim, len(reps))
    reps = (1,) * (ndim - len(reps)) + reps
    shape = (1,) * (ndim - x.ndim) + x.shape
    strides = (0,) * (ndim - x.ndim) + x._view.strides
    big_shape: list[int] = []
    big_strides: list[int] = []
    for r, s, st in zip(reps, shape, strides, strict=True):
        big_shape += [r, s]
        big_strides += [0, st]
    fresh = _materialize(x, big_shape, big_strides)
    out_shape = tuple(r * s for r, s in zip(reps, shape, strict=True))
    return _view(fresh, out_shape, contiguous_strides(out_shape))


def roll(x: Array, /, shift: int | tuple[int, ...], *, axis: int | tuple[int, ...] | None = None) -> Array:
    """Elements shifted along ``axis`` (of the flattened array for None), wrapping around."""
    x = _check(x)
    if axis is None:
        if not isinstance(shift, (int, np.integer)):
            raise TypeError("with axis=None, shift must be an int")
        return reshape(roll(reshape(x, (-1,)), int(shift), axis=0), x.shape)
    axes = (axis,) if isinstance(axis, (int, np.integer)) else tuple(axis)
    shifts = (shift,) * len(axes) if isinstance(shift, (int, np.integer)) else tuple(shift)
    if len(shifts) != len(axes):
        raise ValueError("shift and axis must have as many entries")
    total: dict[int, int] = {}
    for s, a in zip(shifts, axes, strict=True):
        a = normalize_axis(a, x.ndim)
        total[a] = total.get(a, 0) + int(s)
    result = x
    for a, s in total.items():
        n = x.shape[a]
        if n == 0 or s % n == 0:
            continue
        s %= n
        out = empty_array(x._ctx, result.shape, result.dtype)
        lead: list[Any] = [slice(None)] * a
        copy_into(out[(*lead, slice(s, None))], result[(*lead, slice(None, n - s))]._view)
        copy_into(out[(*lead, slice(None, s))], result[(*lead, slice(n - s, None))]._view)
        result = out
    return copy_view(result) if result is x else result
