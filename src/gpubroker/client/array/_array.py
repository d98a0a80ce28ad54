"""The array object: a strided view on device memory, with the standard's attributes and operators.

An Array is immutable in its metadata (shape, dtype, strides); in-place operators and ``__setitem__`` write into
its memory. Operators delegate to the namespace's functions (one implementation each); conversions to the host
(``__array__``, ``__dlpack__``, ``__bool__``, ``__float__``, ...) are the only calls that wait for the device.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from gpubroker.client.array._context import Context, Device
from gpubroker.client.array._gather import gather
from gpubroker.client.array._memory import Storage
from gpubroker.client.array._views import View, broadcast_view

__all__ = ["Array", "Operators", "contiguous", "copy_into", "copy_view", "empty_array", "install_operators",
           "to_host", "wrap"]

_KDLCPU = 1  # DLPack's DLDeviceType for host memory


@dataclass(frozen=True, slots=True)
class Operators:
    """The functions that the array's operators, subscripts and ``__array_namespace__`` are: the namespace's own
    (one implementation of each meaning). The modules that implement them make arrays, so they sit above this one
    in the import order; ``_namespace``, which imports them all, installs them here once (``install_operators``)."""

    binary: Callable[[str, Array | complex, Array | complex], Array]
    """An elementwise function of two operands by its name: ``binary("add", x1, x2)`` is ``add(x1, x2)``."""
    inplace: Callable[[str, Array, Array | complex], Array]
    """``x <op>= other``: the named function computed into x's memory."""
    inplace_result: Callable[[Array, Array], Array]
    """``x @= y``: a result copied into x's memory."""
    negative: Callable[[Array], Array]
    positive: Callable[[Array], Array]
    abs: Callable[[Array], Array]
    bitwise_invert: Callable[[Array], Array]
    matmul: Callable[[Array, Array], Array]
    getitem: Callable[[Array, Any], Array]
    setitem: Callable[[Array, Any, Any], None]
    namespace: Callable[[Context, str | None], Any]
    """The namespace of a context's arrays (for the api_version asked)."""


_operators: Operators  # set by install_operators when the package is imported


def install_operators(operators: Operators) -> None:
    """Make ``operators`` what every array's operators call (``_namespace`` does, at import)."""
    global _operators
    _operators = operators


class Array:
    """An n-dimensional array on a gpubroker device (``gpubroker.client.array.namespace(gpu)`` makes them).

    Arrays are made by the namespace's functions (`xp.asarray(numpy_array)`, `xp.zeros(...)`, ...) and by
    operations on arrays; the constructor is not public. They have the standard's attributes and operators
    (arithmetic, comparison, bitwise, `@`, indexing with ints, slices, `None`, `...`, integer arrays and boolean
    masks, in-place operators and `x[key] = value`), and `__array_namespace__()` returns their namespace.

    Operations queue device work and return at once (with `async_commands`); the conversions to the host are
    the calls that wait for the device: `numpy.asarray(x)` (`__array__`), `x.__dlpack__()`, `bool(x)`,
    `int(x)`, `float(x)`, `complex(x)`, `operator.index(x)`, iterating. Errors follow the standard: `TypeError`,
    `ValueError` and `IndexError` for wrong dtypes, shapes and indices, raised on the client; device and broker
    errors are [GpuBrokerError][gpubroker.client.GpuBrokerError]s.

    The array keeps its device memory alive; when the last array on an allocation is gone, the memory goes back
    to the session's pool or is freed.
    """

    __slots__ = ("__weakref__", "_ctx", "_storage", "_view")
    __array_priority__ = 100  # numpy defers to our operators: ``np_array + x`` is x.__radd__

    def __init__(self, ctx: Context, storage: Storage, view: View) -> None:
        self._ctx = ctx
        self._storage = storage  # keeps the memory alive while this array (or any view of it) is
        self._view = view

    # -- attributes --------------------------------------------------------------------------------
    @property
    def dtype(self) -> np.dtype[Any]:
        """The element type: a NumPy dtype object (`xp.float32 is np.dtype("float32")`)."""
        return self._view.dtype

    @property
    def shape(self) -> tuple[int, ...]:
        """The extent of each dimension; `()` for a 0-d array. Always known (never None)."""
        return self._view.shape

    @property
    def ndim(self) -> int:
        """The number of dimensions."""
        return len(self._view.shape)

    @property
    def size(self) -> int:
        """The number of elements (the product of `shape`; 1 for a 0-d array)."""
        return self._view.size

    @property
    def device(self) -> Device:
        """The device the array lives on: its session's, the one device of its namespace."""
        return self._ctx.device

    def __array_namespace__(self, /, *, api_version: str | None = None) -> Any:
        return _operators.namespace(self._ctx, api_version)

    @property
    def T(self) -> Array:
        """The transpose of a 2-d array (a view); ValueError for any other rank (the standard's rule)."""
        if self.ndim != 2:
            raise ValueError(f"x.T needs a 2-d array, this one has {self.ndim} dimensions (use permute_dims or mT)")
        return self._permuted((1, 0))

    @property
    def mT(self) -> Array:
        """The last two axes swapped (a view); ValueError below 2 dimensions."""
        if self.ndim < 2:
            raise ValueError(f"x.mT needs at least 2 dimensions, this array has {self.ndim}")
        return self._permuted((*range(self.ndim - 2), self.ndim - 1, self.ndim - 2))

    def _permuted(self, axes: tuple[int, ...]) -> Array:
        """The view with axis ``i`` this array's axis ``axes[i]`` (``axes`` a permutation: ``permute_dims``'s
        view without its checks)."""
        v = self._view
        view = View(v.buffer, v.dtype, tuple(v.shape[a] for a in axes), tuple(v.strides[a] for a in axes), v.offset)
        return Array(self._ctx, self._storage, view)

    def to_device(self, device: Device, /, *, stream: int | Any | None = None) -> Array:
        """This array on ``device``: itself where ``device`` is its own; one namespace has one device, so any
        other device is a ValueError (move data between sessions through the host: ``asarray(np.asarray(x))``).

        Args:
            device: The target device (`x.device`).
            stream: Accepted for the standard's signature; not used.

        Returns:
            This array.

        Raises:
            ValueError: `device` is not this array's device.
        """
        if device is not self._ctx.device:
            raise ValueError(f"{device!r} is not this array's device {self._ctx.device!r}; "
                             "an array moves to another session through the host")
        return self

    # -- conversions to the host: the only calls that wait for the device ----------------------------
    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray[Any, Any]:
        """A host copy (numpy's ``numpy.asarray(x)``); ``copy=False`` is a ValueError, the data being elsewhere."""
        if copy is False:
            raise ValueError("the array lives on a gpubroker device: converting it to numpy always copies")
        host = to_host(self)
        return host if dtype is None else host.astype(dtype, copy=False)

    def __dlpack__(self, /, *, stream: int | Any | None = None, max_version: tuple[int, int] | None = None,
                   dl_device: tuple[Any, int] | None = None, copy: bool | None = None) -> Any:
        """DLPack export through the host: the capsule of a host copy (``__dlpack_device__`` says kDLCPU).

        ``copy=False`` is a BufferError (the bytes must come over); ``dl_device`` may only name the CPU.
        """
        if copy is False:
            raise BufferError("the array lives on a gpubroker device: exporting it always copies to the host")
        if dl_device is not None and (int(dl_device[0]), int(dl_device[1])) != (_KDLCPU, 0):
            raise BufferError(f"only the host (kDLCPU, 0) is offered, not {dl_device!r}")
        host = to_host(self)
        if max_version is None:
            return host.__dlpack__()
        return host.__dlpack__(max_version=max_version)

    def __dlpack_device__(self, /) -> tuple[int, int]:
        return (_KDLCPU, 0)

    def _scalar(self, what: str) -> Any:
        if self.ndim != 0:
            raise TypeError(f"{what}() of an array needs a 0-d array, this one has shape {self.shape}")
        return to_host(self)[()].item()

    def __bool__(self, /) -> bool:
        return bool(self._scalar("bool"))

    def __complex__(self, /) -> complex:
        return complex(self._scalar("complex"))

    def __int__(self, /) -> int:
        if self.dtype.kind == "c":
            raise TypeError("int() of a complex array is not allowed (take the real part first)")
        return int(self._scalar("int"))

    def __float__(self, /) -> float:
        if self.dtype.kind == "c":
            raise TypeError("float() of a complex array is not allowed (take the real part first)")
        return float(self._scalar("float"))

    def __index__(self, /) -> int:
        if self.dtype.kind not in "iu":
            raise TypeError(f"only integer arrays can be used as an index, this one is {self.dtype}")
        return int(self._scalar("index"))

    def __iter__(self) -> Iterator[Array]:
        """Arrays along the first axis (views); TypeError for a 0-d array, as numpy's."""
        if self.ndim == 0:
            raise TypeError("iteration over a 0-d array")
        return (self[i] for i in range(self.shape[0]))

    # -- indexing ------------------------------------------------------------------------------------
    def __getitem__(self, key: Any, /) -> Array:
        return _operators.getitem(self, key)

    def __setitem__(self, key: Any, value: Array | complex, /) -> None:
        _operators.setitem(self, key, value)


    # -- operators: each is the namespace function of the same meaning (one implementation) -------------
    def __add__(self, other: Array | complex, /) -> Array:
        return _operators.binary("add", self, other)

    def __radd__(self, other: Array | complex, /) -> Array:
        return _operators.binary("add", other, self)

    def __iadd__(self, other: Array | complex, /) -> Array:
        return _operators.inplace("add", self, other)

    def __sub__(self, other: Array | complex, /) -> Array:
        return _operators.binary("subtract", self, other)

    def __rsub__(self, other: Array | complex, /) -> Array:
        return _operators.binary("subtract", other, self)

    def __isub__(self, other: Array | complex, /) -> Array:
        return _operators.inplace("subtract", self, other)

    def __mul__(self, other: Array | complex, /) -> Array:
        return _operators.binary("multiply", self, other)

    def __rmul__(self, other: Array | complex, /) -> Array:
        return _operators.binary("multiply", other, self)

    def __imul__(self, other: Array | complex, /) -> Array:
        return _operators.inplace("multiply", self, other)

    def __truediv__(self, other: Array | complex, /) -> Array:
        return _operators.binary("divide", self, other)

    def __rtruediv__(self, other: Array | complex, /) -> Array:
        return _operators.binary("divide", other, self)

    def __itruediv__(self, other: Array | complex, /) -> Array:
        return _operators.inplace("divide", self, other)

    def __floordiv__(self, other: Array | complex, /) -> Array:
        return _operators.binary("floor_divide", self, other)

    def __rfloordiv__(self, other: Array | complex, /) -> Array:
        return _operators.binary("floor_divide", other, self)

    def __ifloordiv__(self, other: Array | complex, /) -> Array:
        return _operators.inplace("floor_divide", self, other)

    def __mod__(self, other: Array | complex, /) -> Array:
        return _operators.binary("remainder", self, other)

    def __rmod__(self, other: Array | complex, /) -> Array:
        return _operators.binary("remainder", other, self)

    def __imod__(self, other: Array | complex, /) -> Array:
        return _operators.inplace("remainder", self, other)

    def __pow__(self, other: Array | complex, /) -> Array:
        return _operators.binary("pow", self, other)

    def __rpow__(self, other: Array | complex, /) -> Array:
        return _operators.binary("pow", other, self)

    def __ipow__(self, other: Array | complex, /) -> Array:
        return _operators.inplace("pow", self, other)

    def __and__(self, other: Array | complex, /) -> Array:
        return _operators.binary("bitwise_and", self, other)

    def __rand__(self, other: Array | complex, /) -> Array:
        return _operators.binary("bitwise_and", other, self)

    def __iand__(self, other: Array | complex, /) -> Array:
        return _operators.inplace("bitwise_and", self, other)

    def __or__(self, other: Array | complex, /) -> Array:
        return _operators.binary("bitwise_or", self, other)

    def __ror__(self, other: Array | complex, /) -> Array:
        return _operators.binary("bitwise_or", other, self)

    def __ior__(self, other: Array | complex, /) -> Array:
        return _operators.inplace("bitwise_or", self, other)

    def __xor__(self, other: Array | complex, /) -> Array:
        return _operators.binary("bitwise_xor", self, other)

    def __rxor__(self, other: Array | complex, /) -> Array:
        return _operators.binary("bitwise_xor", other, self)

    def __ixor__(self, other: Array | complex, /) -> Array:
        return _operators.inplace("bitwise_xor", self, other)

    def __lshift__(self, other: Array | complex, /) -> Array:
        return _operators.binary("bitwise_left_shift", self, other)

    def __rlshift__(self, other: Array | complex, /) -> Array:
        return _operators.binary("bitwise_left_shift", other, self)

    def __ilshift__(self, other: Array | complex, /) -> Array:
        return _operators.inplace("bitwise_left_shift", self, other)

    def __rshift__(self, other: Array | complex, /) -> Array:
        return _operators.binary("bitwise_right_shift", self, other)

    def __rrshift__(self, other: Array | complex, /) -> Array:
        return _operators.binary("bitwise_right_shift", other, self)

    def __irshift__(self, other: Array | complex, /) -> Array:
        return _operators.inplace("bitwise_right_shift", self, other)

    def __lt__(self, other: Array | complex, /) -> Array:
        return _operators.binary("less", self, other)

    def __le__(self, other: Array | complex, /) -> Array:
        return _operators.binary("less_equal", self, other)

    def __gt__(self, other: Array | complex, /) -> Array:
        return _operators.binary("greater", self, other)

    def __ge__(self, other: Array | complex, /) -> Array:
        return _operators.binary("greater_equal", self, other)

    def __eq__(self, other: Array | complex, /) -> Array:  # type: ignore[override]
        return _operators.binary("equal", self, other)

    def __ne__(self, other: Array | complex, /) -> Array:  # type: ignore[override]
        return _operators.binary("not_equal", self, other)

    def __matmul__(self, other: Array, /) -> Array:
        return _operators.matmul(self, other)

    def __rmatmul__(self, other: Array, /) -> Array:
        return _operators.matmul(other, self)

    def __imatmul__(self, other: Array, /) -> Array:
        return _operators.inplace_result(self, _operators.matmul(self, other))

    def __neg__(self, /) -> Array:
        return _operators.negative(self)

    def __pos__(self, /) -> Array:
        return _operators.positive(self)

    def __abs__(self, /) -> Array:
        return _operators.abs(self)

    def __invert__(self, /) -> Array:
        return _operators.bitwise_invert(self)

    __hash__ = None  # type: ignore[assignment]  # mutable, and == is elementwise

    def __repr__(self) -> str:
        values = np.array2string(to_host(self), separator=", ", prefix="Array(")
        return f"Array({values}, dtype={self.dtype.name}, device={self._ctx.device!r})"


def empty_array(ctx: Context, shape: tuple[int, ...], dtype: np.dtype[Any]) -> Array:
    """A fresh contiguous array (contents undefined): what every operation writes its result into."""
    storage, view = ctx.empty(tuple(shape), dtype)
    return Array(ctx, storage, view)


def wrap(ctx: Context, storage: Storage, view: View) -> Array:
    """An array over ``view`` of ``storage`` (a view of another array shares its storage)."""
    return Array(ctx, storage, view)


def copy_view(x: Array) -> Array:
    """A fresh contiguous copy of ``x`` (same dtype), made on the device."""
    out = empty_array(x._ctx, x.shape, x.dtype)
    gather(x._ctx, out._view, x._view)
    return out


def contiguous(x: Array) -> Array:
    """``x`` itself where its view is C-contiguous, else a contiguous copy (what a library operation takes)."""
    return x if x._view.contiguous else copy_view(x)


def copy_into(out: Array, src: View) -> None:
    """Queue ``out[...] = src`` (``src`` broadcast to ``out.shape``; cast where the dtypes differ). A source that
    shares memory with ``out`` is copied aside first: a parallel copy between overlapping ranges would race."""
    ctx = out._ctx
    view = broadcast_view(src, out.shape)
    if src.buffer.handle == out._view.buffer.handle:
        aside = empty_array(ctx, src.shape, src.dtype)
        gather(ctx, aside._view, _as_rank(src, len(src.shape)))
        view = broadcast_view(aside._view, out.shape)
    if view.dtype == out.dtype:
        gather(ctx, out._view, view)
    else:
        ctx.kernels.copy(out._view, view)


def _as_rank(view: View, ndim: int) -> View:
    return view if len(view.strides) == ndim else broadcast_view(view, view.shape)


def to_host(x: Array) -> np.ndarray[Any, Any]:
    """A fresh numpy array with ``x``'s values (waits for the work queued before it). A view that is not
    contiguous is first made contiguous on the device, so only its own elements cross."""
    view = x._view
    host = np.empty(view.shape, view.dtype)
    if host.size == 0:
        return host
    if not view.contiguous:
        x = copy_view(x)
        view = x._view
    x._ctx.gpu.copy_d2h(view.buffer, host.reshape(-1).view(np.uint8), view.offset * view.dtype.itemsize)
    return host
