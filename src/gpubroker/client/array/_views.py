"""Strided views, and the arithmetic of shapes, strides and axes that every module of the namespace shares.

A ``View`` is what kernels and library operations take: a window of ``shape`` on one allocation, element
``(i0, i1, ...)`` at ``offset + i0 * strides[0] + ...``. Views are plain values: making one does no device work.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from gpubroker.client import Buffer

__all__ = ["AxisError", "View", "broadcast_shapes", "broadcast_view", "contiguous_strides", "normalize_axes",
           "normalize_axis"]


@dataclass(frozen=True, slots=True)
class View:
    """A strided window on one allocation, as kernels and library operations take it.

    ``offset`` and ``strides`` count elements of ``dtype`` (a stride is 0 on a broadcast dimension, negative on a
    flipped one); element ``(i0, i1, ...)`` is at ``offset + i0 * strides[0] + i1 * strides[1] + ...``.
    """

    buffer: Buffer  # the whole allocation (offset 0)
    dtype: np.dtype[Any]
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    offset: int = 0

    @property
    def size(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def contiguous(self) -> bool:
        """C-contiguous: the elements are ``size`` consecutive ones from ``offset`` in row-major order."""
        expected = 1
        for extent, stride in zip(reversed(self.shape), reversed(self.strides), strict=True):
            if extent != 1 and stride != expected:
                return False
            expected *= extent
        return True


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides = []
    step = 1
    for extent in reversed(shape):
        strides.append(step)
        step *= max(extent, 1)
    return tuple(reversed(strides))


def broadcast_shapes(*shapes: tuple[int, ...]) -> tuple[int, ...]:
    """The standard's broadcasting of shapes; ValueError naming them where they do not broadcast."""
    ndim = max((len(s) for s in shapes), default=0)
    out = [1] * ndim
    for shape in shapes:
        for i, extent in enumerate(shape, ndim - len(shape)):
            if extent == out[i] or extent == 1:
                continue
            if out[i] != 1:
                raise ValueError(f"shapes {', '.join(map(str, shapes))} do not broadcast")
            out[i] = extent
    return tuple(out)


def broadcast_view(view: View, shape: tuple[int, ...]) -> View:
    """``view`` broadcast to ``shape`` (stride 0 on the dimensions it repeats); ValueError if it cannot be."""
    lead = len(shape) - len(view.shape)
    if lead < 0:
        raise ValueError(f"cannot broadcast shape {view.shape} to {shape}")
    strides = [0] * lead
    for extent, have, stride in zip(shape[lead:], view.shape, view.strides, strict=True):
        if have == extent:
            strides.append(stride)
        elif have == 1:
            strides.append(0)
        else:
            raise ValueError(f"cannot broadcast shape {view.shape} to {shape}")
    return View(view.buffer, view.dtype, tuple(shape), tuple(strides), view.offset)


class AxisError(ValueError, IndexError):
    """An axis out of range: a ValueError and an IndexError (numpy's AxisError is both; the standard asks
    for one or the other depending on the function)."""


def normalize_axis(axis: int, ndim: int) -> int:
    """``axis`` in ``[0, ndim)`` (negative counts from the end); AxisError outside."""
    if isinstance(axis, bool) or not isinstance(axis, (int, np.integer)):
        raise TypeError(f"an axis is an int, got {axis!r}")
    if not -ndim <= axis < ndim:
        raise AxisError(f"axis {axis} is out of range for an array of {ndim} dimensions")
    return int(axis) % ndim


def normalize_axes(axis: int | Sequence[int] | None, ndim: int) -> tuple[int, ...]:
    """Axes as a tuple of distinct non-negative ints (None: all of them); AxisError for a repeated one."""
    if axis is None:
        return tuple(range(ndim))
    axes = (axis,) if isinstance(axis, (int, np.integer)) else tuple(axis)
    out = tuple(normalize_axis(a, ndim) for a in axes)
    if len(set(out)) != len(out):
        raise AxisError(f"repeated axis in {axis!r}")
    return out
