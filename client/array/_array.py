"""The array object: a strided view on device memory, with the standard's attributes and operators.

An Array is immutable in its metadata (shape, dtype, strides); in-place operators and ``__setitem__`` write into
its memory. Operators delegate to the namespace's functions (one implementation each); conversions to the host
(``__array__``, ``__dlpack__``, ``__bool__``, ``__float__``, ...) are the only calls that wait for the device.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from ._context import Context, Storage, View

if TYPE_CHECKING:
    from ._context import Device

__all__ = ["Array", "empty_array", "wrap"]


class Array:
    """An n-dimensional array on a gpubroker device (``gpubroker.client.array.namespace(gpu)`` makes them)."""

    __slots__ = ("__weakref__", "_ctx", "_storage", "_view")
    __array_priority__ = 100  # numpy defers to our operators: ``np_array + x`` is x.__radd__

    def __init__(self, ctx: Context, storage: Storage, view: View) -> None:
        self._ctx = ctx
        self._storage = storage  # keeps the memory alive while this array (or any view of it) is
        self._view = view

    # -- attributes --------------------------------------------------------------------------------
    @property
    def dtype(self) -> np.dtype[Any]:
        return self._view.dtype

    @property
    def shape(self) -> tuple[int, ...]:
        return self._view.shape

    @property
    def ndim(self) -> int:
        return len(self._view.shape)

    @property
    def size(self) -> int:
        return self._view.size

    @property
    def device(self) -> Device:
        return self._ctx.device

    def __array_namespace__(self, /, *, api_version: str | None = None) -> Any:
        from ._namespace import namespace_of

        return namespace_of(self._ctx, api_version)

    def __repr__(self) -> str:
        return f"Array({np.asarray(self)!r}, device={self._ctx.device!r})"


def empty_array(ctx: Context, shape: tuple[int, ...], dtype: np.dtype[Any]) -> Array:
    """A fresh contiguous array (contents undefined): what every operation writes its result into."""
    storage, view = ctx.empty(tuple(shape), dtype)
    return Array(ctx, storage, view)


def wrap(ctx: Context, storage: Storage, view: View) -> Array:
    """An array over ``view`` of ``storage`` (a view of another array shares its storage)."""
    return Array(ctx, storage, view)
