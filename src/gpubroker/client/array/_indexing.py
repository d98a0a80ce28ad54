"""Indexing: ``x[key]`` and ``x[key] = value`` (the array object's), ``take`` and ``take_along_axis``.

Basic indices (integers, slices with any step, ``...``, ``None``) make views: no device work. An integer array
index gathers (one generated kernel, ``_gather``); a boolean mask has a data-dependent shape, so it reads the
mask's count to the host and then gathers. Out-of-range integers are an IndexError, checked on the host; out-of-
range values inside an index array are clamped on the device (the standard leaves them unspecified).
"""

from __future__ import annotations

import math
import operator
from typing import Any

import numpy as np

from gpubroker.client.array._array import Array, copy_into, empty_array, to_host, wrap
from gpubroker.client.array._creation import asarray, fill
from gpubroker.client.array._elementwise import where
from gpubroker.client.array._gather import IndexOperand, gather
from gpubroker.client.array._library_calls import call
from gpubroker.client.array._statistical import count_nonzero
from gpubroker.client.array._views import View, broadcast_shapes, broadcast_view

__all__ = ["take", "take_along_axis"]


# -- keys ---------------------------------------------------------------------------------------------
def _normalize_axis(axis: int, ndim: int) -> int:
    if not -ndim <= axis < ndim:
        raise IndexError(f"axis {axis} is out of range for an array of {ndim} dimensions")
    return axis % ndim


def _as_key_tuple(key: Any) -> tuple[Any, ...]:
    return key if isinstance(key, tuple) else (key,)


def _is_int(item: Any) -> bool:
    if isinstance(item, (bool, np.bool_, Array)):
        return False
    return isinstance(item, (int, np.integer)) or (hasattr(item, "__index__") and not isinstance(item, slice))


def _basic(x: Array, key: tuple[Any, ...]) -> Array:
    """``x[key]`` for a key of integers, slices, ``...`` and ``None`` only: a view."""
    view = x._view
    n_ellipsis = sum(1 for item in key if item is Ellipsis)
    if n_ellipsis > 1:
        raise IndexError("an index can only have a single ellipsis ('...')")
    n_consuming = sum(1 for item in key if item is not None and item is not Ellipsis)
    if n_consuming > len(view.shape):
        raise IndexError(f"too many indices for an array of {len(view.shape)} dimensions: {n_consuming}")
    if n_ellipsis == 0:
        key = (*key, Ellipsis)
    shape: list[int] = []
    strides: list[int] = []
    offset = view.offset
    dim = 0
    for item in key:
        if item is Ellipsis:
            rest = len(view.shape) - n_consuming
            shape += view.shape[dim:dim + rest]
            strides += view.strides[dim:dim + rest]
            dim += rest
        elif item is None:
            shape.append(1)
            strides.append(0)
        elif isinstance(item, slice):
            extent = view.shape[dim]
            start, stop, step = item.indices(extent)
            length = len(range(start, stop, step))
            if length:
                offset += start * view.strides[dim]
            shape.append(length)
            strides.append(view.strides[dim] * step)
            dim += 1
        else:
            index = operator.index(item)
            extent = view.shape[dim]
            if not -extent <= index < extent:
                raise IndexError(f"index {index} is out of bounds for axis {dim} with size {extent}")
            offset += (index % extent) * view.strides[dim]
            dim += 1
    return wrap(x._ctx, x._storage, View(view.buffer, view.dtype, tuple(shape), tuple(strides), offset))


def _validate_item(item: Any) -> None:
    if item is None or item is Ellipsis or isinstance(item, (slice, Array)) or _is_int(item):
        return
    if isinstance(item, (bool, np.bool_)):
        return
    raise IndexError(f"{type(item).__name__} is not a valid index (integers, slices, ..., None and integer or "
                     "boolean arrays are)")


def getitem(x: Array, key: Any) -> Array:
    """``x[key]``: a view for basic keys, a gather for integer arrays, a compaction for a boolean mask."""
    items = _as_key_tuple(key)
    for item in items:
        _validate_item(item)
    if any(isinstance(item, (bool, np.bool_)) for item in items):
        if len(items) != 1:
            raise IndexError("a Python bool index must be the whole key")
        view = _basic(x, (None,))
        return view if items[0] else _basic(view, (slice(0, 0),))
    arrays = [i for i, item in enumerate(items) if isinstance(item, Array)]
    if not arrays:
        return _basic(x, items)
    if len(items) == 1 and items[0].dtype == np.dtype(bool):
        return _masked(x, items[0])
    if any(items[i].dtype == np.dtype(bool) for i in arrays):
        raise IndexError("a boolean array index must be the whole key")
    if any(items[i].dtype.kind not in "iu" for i in arrays):
        raise IndexError("an array index must have an integer or a boolean dtype")
    return _advanced(x, items)


def _advanced(x: Array, items: tuple[Any, ...]) -> Array:
    """Integer-array indexing (NumPy's rules): the index arrays (and integers beside them) broadcast together;
    their dimensions replace the indexed axes where those are adjacent, else they come first."""
    if sum(1 for item in items if item is Ellipsis) > 1:
        raise IndexError("an index can only have a single ellipsis ('...')")
    # Integers beside arrays index like 0-d arrays; turn them into 0-d host-known arrays by position.
    consuming = [i for i, item in enumerate(items) if item is not None and item is not Ellipsis]
    if len(consuming) > x.ndim:
        raise IndexError(f"too many indices for an array of {x.ndim} dimensions: {len(consuming)}")
    if not any(item is Ellipsis for item in items):
        items = (*items, Ellipsis)
    # Map each key item to the axis of x it consumes.
    axis_of: dict[int, int] = {}
    dim = 0
    for i, item in enumerate(items):
        if item is Ellipsis:
            dim += x.ndim - len(consuming)
        elif item is not None:
            axis_of[i] = dim
            dim += 1
    advanced = [i for i in axis_of if isinstance(items[i], Array) or _is_int(items[i])]
    ctx = x._ctx
    index_arrays: list[Array] = []
    for i in advanced:
        item = items[i]
        if isinstance(item, Array):
            index_arrays.append(item)
        else:
            index = operator.index(item)
            extent = x.shape[axis_of[i]]
            if not -extent <= index < extent:
                raise IndexError(f"index {index} is out of bounds for axis {axis_of[i]} with size {extent}")
            index_arrays.append(asarray(ctx, index, dtype=np.dtype("int64")))
    idx_shape = broadcast_shapes(*(a.shape for a in index_arrays))
    # The view of x with the advanced axes left whole (basic items applied elsewhere).
    partial = tuple(slice(None) if i in advanced else item for i, item in enumerate(items))
    base = getitem(x, partial)
    # Axes of ``base`` that the advanced items consume: a None adds an axis, every other item keeps one.
    base_axis: dict[int, int] = {}
    dim = 0
    for i, item in enumerate(items):
        if item is Ellipsis:
            dim += x.ndim - len(consuming)
        else:
            if i in advanced:
                base_axis[i] = dim
            dim += 1
    positions = sorted(base_axis[i] for i in advanced)
    adjacent = positions == list(range(positions[0], positions[0] + len(positions)))
    kept = [d for d in range(base.ndim) if d not in positions]
    insert_at = positions[0] if adjacent else 0
    kept_before = [d for d in kept if d < insert_at] if adjacent else []
    kept_after = [d for d in kept if d not in kept_before]
    out_shape = (*(base.shape[d] for d in kept_before), *idx_shape, *(base.shape[d] for d in kept_after))
    nb, ni = len(kept_before), len(idx_shape)
    x_strides = [*(base._view.strides[d] for d in kept_before), *([0] * ni),
                 *(base._view.strides[d] for d in kept_after)]
    operands = []
    for i, arr in zip(advanced, index_arrays, strict=True):
        b = broadcast_view(arr._view, idx_shape)
        strides = (*([0] * nb), *b.strides, *([0] * len(kept_after)))
        view = View(b.buffer, b.dtype, out_shape, strides, b.offset)
        axis = base_axis[i]
        operands.append(IndexOperand(view, base._view.strides[axis], base.shape[axis]))
    out = empty_array(ctx, out_shape, x.dtype)
    src = View(base._view.buffer, x.dtype, out_shape, tuple(x_strides), base._view.offset)
    if any(base.shape[base_axis[i]] == 0 for i in advanced) and out.size:
        raise IndexError("cannot index into an empty axis")
    gather(ctx, out._view, src, operands)
    return out


def _mask_positions(mask: Array) -> Array:
    """The flat positions (int64) of the True elements of ``mask``, counted on the host (a data-dependent
    shape must be known before its result is allocated)."""
    positions = np.flatnonzero(to_host(mask)).astype(np.int64)
    return asarray(mask._ctx, positions)


def _masked(x: Array, mask: Array) -> Array:
    """``x[mask]``: the elements (or sub-arrays) where a mask over ``x``'s leading axes is True, in order."""
    k = mask.ndim
    if k > x.ndim or any(m not in (n, 0) for m, n in zip(mask.shape, x.shape, strict=False)):
        raise IndexError(f"boolean index of shape {mask.shape} does not match the array's shape {x.shape}")
    if mask.size == 0:  # an empty mask selects nothing (numpy's and the standard's tests' reading)
        return empty_array(x._ctx, (0, *x.shape[k:]), x.dtype)
    if k == 0:  # x[True] / x[False] as arrays: a new axis of extent 1 or 0
        return _basic(_basic(x, (None,)), (slice(0, 1 if bool(mask) else 0),))
    count = int(count_nonzero(mask))  # the one wait: the result's size must be known to allocate it
    return call("compress", [x, mask], {"count": count})[0]


# -- setitem ------------------------------------------------------------------------------------------
def _check_value_dtype(x: Array, value: Any) -> None:
    kind = x.dtype.kind
    if isinstance(value, Array):
        if value.dtype.kind == "c" and kind != "c":
            raise TypeError(f"cannot assign {value.dtype} values into a {x.dtype} array")
        return
    if isinstance(value, (bool, np.bool_)):
        return
    if isinstance(value, (int, np.integer)):
        if kind == "b":
            raise TypeError(f"cannot assign an int into a {x.dtype} array")
        if kind in "iu":
            info = np.iinfo(x.dtype)
            if not info.min <= int(value) <= info.max:
                raise OverflowError(f"{value} is out of range for {x.dtype}")
        return
    if isinstance(value, (float, np.floating)):
        if kind in "biu":
            raise TypeError(f"cannot assign a float into a {x.dtype} array")
        return
    if isinstance(value, (complex, np.complexfloating)):
        if kind != "c":
            raise TypeError(f"cannot assign a complex into a {x.dtype} array")
        return
    raise TypeError(f"cannot assign {type(value).__name__} into an array (an array or a Python scalar is needed)")


def setitem(x: Array, key: Any, value: Any) -> None:
    """``x[key] = value``: a scalar or an array broadcast into the view ``x[key]``; with a boolean mask, the
    masked elements only."""
    if (not isinstance(value, Array) and hasattr(value, "__array__")) or isinstance(value, (list, tuple)):
        value = asarray(x._ctx, value)
    _check_value_dtype(x, value)
    items = _as_key_tuple(key)
    for item in items:
        _validate_item(item)
    if len(items) == 1 and isinstance(items[0], Array) and items[0].dtype == np.dtype(bool):
        _set_masked(x, items[0], value)
        return
    if any(isinstance(item, Array) for item in items):
        raise NotImplementedError("assignment through integer array indices is not supported (the standard "
                                  "leaves it optional); use a boolean mask or slices")
    target = getitem(x, key)
    if isinstance(value, Array):
        if value._ctx is not x._ctx:
            raise ValueError("the value lives on another device")
        copy_into(target, value._view)
    else:
        _fill(target, value)


def _fill(target: Array, value: bool | int | float | complex) -> None:
    fill(target, value)


def _set_masked(x: Array, mask: Array, value: Any) -> None:
    k = mask.ndim
    if k > x.ndim or any(m not in (n, 0) for m, n in zip(mask.shape, x.shape, strict=False)):
        raise IndexError(f"boolean index of shape {mask.shape} does not match the array's shape {x.shape}")
    if mask.size == 0:
        return
    full_mask = wrap(mask._ctx, mask._storage, View(mask._view.buffer, mask.dtype, x.shape,
                                                    (*mask._view.strides, *([0] * (x.ndim - k))),
                                                    mask._view.offset))
    if isinstance(value, Array) and value.ndim > 0 and value.shape != x.shape:
        # x[mask] = values-of-the-selected-elements: broadcast over the selection, written by position.
        positions = _mask_positions(mask)
        # broadcast_to's view (that module is above this one: its repeat takes)
        vals = wrap(value._ctx, value._storage, broadcast_view(value._view, (positions.shape[0], *x.shape[k:])))
        _scatter_rows(x, k, positions, vals)
        return
    result = where(full_mask, value, x)
    copy_into(x, result._view)


def _scatter_rows(x: Array, k: int, positions: Array, values: Array) -> None:
    """``x.reshape(-1, *x.shape[k:])[positions] = values`` done on the host (rare: a value per masked element)."""
    # The leading extent spelled out, not -1: numpy cannot infer it when another extent is 0 (x of shape (0,)
    # under a 0-d mask is one row of no elements).
    host = to_host(x).reshape((math.prod(x.shape[:k]), *x.shape[k:]))
    host[to_host(positions)] = to_host(values)
    copy_into(x, asarray(x._ctx, host.reshape(x.shape))._view)


# -- take -----------------------------------------------------------------------------------------------
def take(x: Array, indices: Array, /, *, axis: int | None = None) -> Array:
    """Elements of ``x`` at ``indices`` (1-d, integer) along ``axis`` (may be None only for a 1-d ``x``);
    negative indices count from the end."""
    if not isinstance(x, Array) or not isinstance(indices, Array):
        raise TypeError("take takes arrays")
    if indices.dtype.kind not in "iu":
        raise TypeError(f"indices must have an integer dtype, got {indices.dtype}")
    if indices.ndim != 1:
        raise ValueError(f"indices must be 1-d, got shape {indices.shape}")
    if axis is None:
        if x.ndim != 1:
            raise ValueError("axis may be None only for a 1-d array")
        axis = 0
    axis = _axis(axis, x.ndim)
    key = (*([slice(None)] * axis), indices)
    if x.shape[axis] == 0 and indices.shape[0]:
        raise IndexError("cannot take from an empty axis")
    return _advanced(x, key)


def _axis(axis: int, ndim: int) -> int:
    if not -ndim <= axis < ndim:
        raise ValueError(f"axis {axis} is out of range for an array of {ndim} dimensions")
    return axis % ndim


def take_along_axis(x: Array, indices: Array, /, *, axis: int = -1) -> Array:
    """``out[..., j, ...] = x[..., indices[..., j, ...], ...]`` along ``axis``; the other axes broadcast."""
    if not isinstance(x, Array) or not isinstance(indices, Array):
        raise TypeError("take_along_axis takes arrays")
    if indices.dtype.kind not in "iu":
        raise TypeError(f"indices must have an integer dtype, got {indices.dtype}")
    if indices.ndim != x.ndim:
        raise ValueError(f"indices ({indices.ndim}-d) must have x's number of dimensions ({x.ndim})")
    axis = _axis(axis, x.ndim)
    other = broadcast_shapes(tuple(1 if d == axis else s for d, s in enumerate(x.shape)),
                             tuple(1 if d == axis else s for d, s in enumerate(indices.shape)))
    out_shape = tuple(indices.shape[d] if d == axis else other[d] for d in range(x.ndim))
    ctx = x._ctx
    out = empty_array(ctx, out_shape, x.dtype)
    if out.size == 0:
        return out
    if x.shape[axis] == 0:
        raise IndexError("cannot take from an empty axis")
    xb = broadcast_view(x._view, tuple(x.shape[axis] if d == axis else s for d, s in enumerate(out_shape)))
    x_strides = tuple(0 if d == axis else s for d, s in enumerate(xb.strides))
    idx = broadcast_view(indices._view, out_shape)
    src = View(xb.buffer, x.dtype, out_shape, x_strides, xb.offset)
    gather(ctx, out._view, src, [IndexOperand(idx, x._view.strides[axis], x.shape[axis])])
    return out
