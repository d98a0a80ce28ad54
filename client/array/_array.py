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


def _ew() -> Any:
    """The elementwise module (imported late: it imports this one)."""
    from . import _elementwise

    return _elementwise


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


    # -- operators: each is the namespace function of the same meaning (one implementation) -------------
    def __add__(self, other: Array | complex, /) -> Array:
        return _ew().add(self, other)  # type: ignore[no-any-return]

    def __radd__(self, other: Array | complex, /) -> Array:
        return _ew().add(other, self)  # type: ignore[no-any-return]

    def __iadd__(self, other: Array | complex, /) -> Array:
        return _ew().inplace("add", self, other)  # type: ignore[no-any-return]

    def __sub__(self, other: Array | complex, /) -> Array:
        return _ew().subtract(self, other)  # type: ignore[no-any-return]

    def __rsub__(self, other: Array | complex, /) -> Array:
        return _ew().subtract(other, self)  # type: ignore[no-any-return]

    def __isub__(self, other: Array | complex, /) -> Array:
        return _ew().inplace("subtract", self, other)  # type: ignore[no-any-return]

    def __mul__(self, other: Array | complex, /) -> Array:
        return _ew().multiply(self, other)  # type: ignore[no-any-return]

    def __rmul__(self, other: Array | complex, /) -> Array:
        return _ew().multiply(other, self)  # type: ignore[no-any-return]

    def __imul__(self, other: Array | complex, /) -> Array:
        return _ew().inplace("multiply", self, other)  # type: ignore[no-any-return]

    def __truediv__(self, other: Array | complex, /) -> Array:
        return _ew().divide(self, other)  # type: ignore[no-any-return]

    def __rtruediv__(self, other: Array | complex, /) -> Array:
        return _ew().divide(other, self)  # type: ignore[no-any-return]

    def __itruediv__(self, other: Array | complex, /) -> Array:
        return _ew().inplace("divide", self, other)  # type: ignore[no-any-return]

    def __floordiv__(self, other: Array | complex, /) -> Array:
        return _ew().floor_divide(self, other)  # type: ignore[no-any-return]

    def __rfloordiv__(self, other: Array | complex, /) -> Array:
        return _ew().floor_divide(other, self)  # type: ignore[no-any-return]

    def __ifloordiv__(self, other: Array | complex, /) -> Array:
        return _ew().inplace("floor_divide", self, other)  # type: ignore[no-any-return]

    def __mod__(self, other: Array | complex, /) -> Array:
        return _ew().remainder(self, other)  # type: ignore[no-any-return]

    def __rmod__(self, other: Array | complex, /) -> Array:
        return _ew().remainder(other, self)  # type: ignore[no-any-return]

    def __imod__(self, other: Array | complex, /) -> Array:
        return _ew().inplace("remainder", self, other)  # type: ignore[no-any-return]

    def __pow__(self, other: Array | complex, /) -> Array:
        return _ew().pow(self, other)  # type: ignore[no-any-return]

    def __rpow__(self, other: Array | complex, /) -> Array:
        return _ew().pow(other, self)  # type: ignore[no-any-return]

    def __ipow__(self, other: Array | complex, /) -> Array:
        return _ew().inplace("pow", self, other)  # type: ignore[no-any-return]

    def __and__(self, other: Array | complex, /) -> Array:
        return _ew().bitwise_and(self, other)  # type: ignore[no-any-return]

    def __rand__(self, other: Array | complex, /) -> Array:
        return _ew().bitwise_and(other, self)  # type: ignore[no-any-return]

    def __iand__(self, other: Array | complex, /) -> Array:
        return _ew().inplace("bitwise_and", self, other)  # type: ignore[no-any-return]

    def __or__(self, other: Array | complex, /) -> Array:
        return _ew().bitwise_or(self, other)  # type: ignore[no-any-return]

    def __ror__(self, other: Array | complex, /) -> Array:
        return _ew().bitwise_or(other, self)  # type: ignore[no-any-return]

    def __ior__(self, other: Array | complex, /) -> Array:
        return _ew().inplace("bitwise_or", self, other)  # type: ignore[no-any-return]

    def __xor__(self, other: Array | complex, /) -> Array:
        return _ew().bitwise_xor(self, other)  # type: ignore[no-any-return]

    def __rxor__(self, other: Array | complex, /) -> Array:
        return _ew().bitwise_xor(other, self)  # type: ignore[no-any-return]

    def __ixor__(self, other: Array | complex, /) -> Array:
        return _ew().inplace("bitwise_xor", self, other)  # type: ignore[no-any-return]

    def __lshift__(self, other: Array | complex, /) -> Array:
        return _ew().bitwise_left_shift(self, other)  # type: ignore[no-any-return]

    def __rlshift__(self, other: Array | complex, /) -> Array:
        return _ew().bitwise_left_shift(other, self)  # type: ignore[no-any-return]

    def __ilshift__(self, other: Array | complex, /) -> Array:
        return _ew().inplace("bitwise_left_shift", self, other)  # type: ignore[no-any-return]

    def __rshift__(self, other: Array | complex, /) -> Array:
        return _ew().bitwise_right_shift(self, other)  # type: ignore[no-any-return]

    def __rrshift__(self, other: Array | complex, /) -> Array:
        return _ew().bitwise_right_shift(other, self)  # type: ignore[no-any-return]

    def __irshift__(self, other: Array | complex, /) -> Array:
        return _ew().inplace("bitwise_right_shift", self, other)  # type: ignore[no-any-return]

    def __lt__(self, other: Array | complex, /) -> Array:  # type: ignore[override]
        return _ew().less(self, other)  # type: ignore[no-any-return]

    def __le__(self, other: Array | complex, /) -> Array:  # type: ignore[override]
        return _ew().less_equal(self, other)  # type: ignore[no-any-return]

    def __gt__(self, other: Array | complex, /) -> Array:  # type: ignore[override]
        return _ew().greater(self, other)  # type: ignore[no-any-return]

    def __ge__(self, other: Array | complex, /) -> Array:  # type: ignore[override]
        return _ew().greater_equal(self, other)  # type: ignore[no-any-return]

    def __eq__(self, other: Array | complex, /) -> Array:  # type: ignore[override]
        return _ew().equal(self, other)  # type: ignore[no-any-return]

    def __ne__(self, other: Array | complex, /) -> Array:  # type: ignore[override]
        return _ew().not_equal(self, other)  # type: ignore[no-any-return]

    def __matmul__(self, other: Array, /) -> Array:
        from ._linear import matmul

        return matmul(self, other)

    def __rmatmul__(self, other: Array, /) -> Array:
        from ._linear import matmul

        return matmul(other, self)

    def __imatmul__(self, other: Array, /) -> Array:
        from ._linear import matmul

        return _ew().inplace_result(self, matmul(self, other))  # type: ignore[no-any-return]

    def __neg__(self, /) -> Array:
        return _ew().negative(self)  # type: ignore[no-any-return]

    def __pos__(self, /) -> Array:
        return _ew().positive(self)  # type: ignore[no-any-return]

    def __abs__(self, /) -> Array:
        return _ew().abs(self)  # type: ignore[no-any-return]

    def __invert__(self, /) -> Array:
        return _ew().bitwise_invert(self)  # type: ignore[no-any-return]

    __hash__ = None  # type: ignore[assignment]  (mutable, and == is elementwise)

    def __repr__(self) -> str:
        return f"Array({np.asarray(self)!r}, device={self._ctx.device!r})"


def empty_array(ctx: Context, shape: tuple[int, ...], dtype: np.dtype[Any]) -> Array:
    """A fresh contiguous array (contents undefined): what every operation writes its result into."""
    storage, view = ctx.empty(tuple(shape), dtype)
    return Array(ctx, storage, view)


def wrap(ctx: Context, storage: Storage, view: View) -> Array:
    """An array over ``view`` of ``storage`` (a view of another array shares its storage)."""
    return Array(ctx, storage, view)
