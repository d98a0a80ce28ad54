"""Creation functions: arrays from host data (``asarray``, ``from_dlpack``), from nothing (``zeros``, ``arange``,
``eye``, ...) and from other arrays (``zeros_like``, ``astype``, ``tril``, ``meshgrid``, ...).

Functions that make an array from nothing take the namespace's Context as their first parameter (the namespace
binds it). Host data crosses once, with ``copy_h2d``; everything else is device work queued without a wait.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from gpubroker.client.array._array import Array, copy_into, copy_view, empty_array, to_host
from gpubroker.client.array._context import Context, Device
from gpubroker.client.array._dtypes import ALL_DTYPES
from gpubroker.client.array._elementwise import greater_equal, less_equal, subtract, where
from gpubroker.client.array._gather import gather
from gpubroker.client.array._views import View

__all__ = ["arange", "asarray", "astype", "empty", "empty_like", "eye", "from_dlpack", "full", "full_like",
           "linspace", "meshgrid", "ones", "ones_like", "tril", "triu", "zeros", "zeros_like"]

Scalar = bool | int | float | complex
_I64 = np.dtype("int64")
_F32, _F64 = np.dtype("float32"), np.dtype("float64")
_C64, _C128 = np.dtype("complex64"), np.dtype("complex128")


# -- helpers shared by the namespace's modules ---------------------------------------------------------
def check_device(ctx: Context, device: Device | None) -> None:
    """ValueError unless ``device`` is None or this namespace's device (one namespace, one device)."""
    if device is not None and device is not ctx.device:
        raise ValueError(f"{device!r} is not this namespace's device {ctx.device!r}")


def supports(ctx: Context, dtype: np.dtype[Any]) -> bool:
    """Whether the device computes in ``dtype``."""
    return ctx.kernels.supports(dtype)


def require_dtype(ctx: Context, dtype: Any) -> np.dtype[Any]:
    """``dtype`` as one of the standard's dtypes that this device has; TypeError naming what is wrong."""
    try:
        dt: np.dtype[Any] = np.dtype(dtype)
    except TypeError:
        raise TypeError(f"{dtype!r} is not one of the Array API's data types") from None
    if dt not in ALL_DTYPES or (not isinstance(dtype, np.dtype) and dtype is not dt.type):
        raise TypeError(f"{dtype!r} is not one of the Array API's data types")
    if not supports(ctx, dt):
        raise TypeError(f"this device ({ctx.info_name}) has no {dt} (no double precision): use "
                        f"{'float32' if dt.kind == 'f' else 'complex64'}")
    return dt


def default_float(ctx: Context) -> np.dtype[Any]:
    """float64 where the device has it, else float32 (``default_dtypes()["real floating"]``)."""
    return _F64 if supports(ctx, _F64) else _F32


def default_complex(ctx: Context) -> np.dtype[Any]:
    return _C128 if supports(ctx, _C128) else _C64


def default_dtype_of(ctx: Context, value: object) -> np.dtype[Any]:
    """The dtype a Python scalar takes on its own: bool, int64, the default real or complex floating dtype."""
    if isinstance(value, (bool, np.bool_)):
        return np.dtype(bool)
    if isinstance(value, (int, np.integer)):
        return _I64
    if isinstance(value, (float, np.floating)):
        return default_float(ctx)
    if isinstance(value, (complex, np.complexfloating)):
        return default_complex(ctx)
    raise TypeError(f"expected a Python scalar (bool, int, float or complex), got {type(value).__name__}")


def normalize_shape(shape: int | Sequence[int]) -> tuple[int, ...]:
    """A shape as a tuple of non-negative ints (an int is a 1-d shape); TypeError / ValueError otherwise."""
    if isinstance(shape, (int, np.integer)) and not isinstance(shape, (bool, np.bool_)):
        shape = (int(shape),)
    try:
        dims = tuple(int(s.__index__()) for s in shape)  # type: ignore[union-attr]
    except (TypeError, AttributeError):
        raise TypeError(f"a shape is an int or a sequence of ints, got {shape!r}") from None
    if any(d < 0 for d in dims):
        raise ValueError(f"negative dimensions are not allowed: {dims}")
    return dims


def upload(ctx: Context, host: np.ndarray[Any, Any]) -> Array:
    """A fresh device array with ``host``'s values (its dtype checked against the device)."""
    require_dtype(ctx, host.dtype)
    if not host.flags.c_contiguous:
        host = host.copy(order="C")
    out = empty_array(ctx, host.shape, host.dtype)
    if host.size:
        ctx.gpu.copy_h2d(host.reshape(-1).view(np.uint8), out._view.buffer, out._view.offset * host.itemsize)
    return out


def fill(out: Array, value: Scalar) -> None:
    """Queue every element of ``out`` set to ``value`` (zero bytes through a memset)."""
    if out.size == 0:
        return
    ctx = out._ctx
    view = out._view
    if view.contiguous and _zero_bits(value):
        ctx.gpu.memset(view.buffer, 0, out.size * out.dtype.itemsize, view.offset * out.dtype.itemsize)
        return
    ctx.kernels.fill(view, value)


def _zero_bits(value: Scalar) -> bool:
    if isinstance(value, complex):
        return value == 0 and not math.copysign(1, value.real) < 0 and not math.copysign(1, value.imag) < 0
    if isinstance(value, float):
        return value == 0 and math.copysign(1, value) > 0
    return value == 0


def _python_only(obj: object) -> bool:
    """Whether ``obj`` is a Python scalar or a nested sequence of them only (its dtype is then the standard's
    default for the kinds found, not numpy's)."""
    if isinstance(obj, (bool, int, float, complex)):
        return True
    if isinstance(obj, (list, tuple)):
        return all(_python_only(item) for item in obj)
    return False


def _host_from_python(ctx: Context, obj: object, dtype: np.dtype[Any] | None) -> np.ndarray[Any, Any]:
    if dtype is not None:
        if dtype.kind in "iu":
            _check_ints(obj, dtype)
        return np.array(obj, dtype=dtype)
    host = np.array(obj)
    kind = host.dtype.kind
    if kind == "b":
        return host
    if kind in "iu":
        if host.dtype != _I64:
            raise OverflowError("an integer does not fit int64 (the default integer dtype); give dtype=")
        return host
    if kind == "f":
        return host.astype(default_float(ctx), copy=False)
    if kind == "c":
        return host.astype(default_complex(ctx), copy=False)
    raise TypeError(f"cannot make an array of {type(obj).__name__} (nested sequences must be regular and hold "
                    "only bool, int, float or complex)")


def _check_ints(obj: object, dtype: np.dtype[Any]) -> None:
    info = np.iinfo(dtype)
    if isinstance(obj, int) and not isinstance(obj, bool) and not info.min <= obj <= info.max:
        raise OverflowError(f"{obj} is out of range for {dtype}")
    if isinstance(obj, (list, tuple)):
        for item in obj:
            _check_ints(item, dtype)


# -- from host data -----------------------------------------------------------------------------------
def asarray(ctx: Context, obj: Any, /, *, dtype: Any = None, device: Device | None = None,
            copy: bool | None = None) -> Array:
    """An array of ``obj``: one of ours (itself, or a copy where ``copy`` or a new ``dtype`` asks), a numpy
    array, a Python scalar or nested sequence, or anything with ``__dlpack__``, ``__array__`` or the buffer
    protocol (uploaded: ``copy=False`` is then a ValueError)."""
    check_device(ctx, device)
    want = None if dtype is None else require_dtype(ctx, dtype)
    if isinstance(obj, Array) and obj._ctx is ctx:
        if want is None or want == obj.dtype:
            return copy_view(obj) if copy else obj
        if copy is False:
            raise ValueError(f"asarray(copy=False) cannot change the dtype from {obj.dtype} to {want}")
        return astype(obj, want)
    if copy is False:
        raise ValueError(f"asarray(copy=False): a {type(obj).__name__} must be copied to the device")
    host: np.ndarray[Any, Any]
    if isinstance(obj, Array):
        host = to_host(obj)  # another session's array: through the host
    elif _python_only(obj):
        host = _host_from_python(ctx, obj, want)
        want = None
    elif isinstance(obj, (np.ndarray, np.generic)):
        host = np.asarray(obj)
    elif isinstance(obj, (list, tuple)):
        host = np.array(obj)  # holding numpy scalars or 0-d arrays: their dtypes decide
    elif hasattr(obj, "__dlpack__"):
        host = np.from_dlpack(obj)
    elif hasattr(obj, "__array__"):
        host = np.asarray(obj)
    else:
        try:
            host = np.asarray(memoryview(obj))
        except TypeError:
            raise TypeError(f"cannot make an array from {type(obj).__name__}") from None
    if want is not None and host.dtype != want:
        host = host.astype(want)
    if host.dtype not in ALL_DTYPES:
        raise TypeError(f"{host.dtype} is not one of the Array API's data types")
    return upload(ctx, host)


def from_dlpack(ctx: Context, x: Any, /, *, device: Device | None = None, copy: bool | None = None) -> Array:
    """An array from a DLPack producer: one of ours is itself (or a copy with ``copy=True``); anything else is
    read on the host through numpy and uploaded (``copy=False`` is then a BufferError)."""
    check_device(ctx, device)
    if isinstance(x, Array) and x._ctx is ctx:
        return copy_view(x) if copy else x
    if copy is False:
        raise BufferError("from_dlpack(copy=False): the data must be copied to the device")
    if isinstance(x, Array):
        return upload(ctx, to_host(x))
    if not hasattr(x, "__dlpack__"):
        raise TypeError(f"{type(x).__name__} does not implement __dlpack__")
    return upload(ctx, np.from_dlpack(x))


# -- from nothing ---------------------------------------------------------------------------------------
def empty(ctx: Context, shape: int | tuple[int, ...], *, dtype: Any = None,
          device: Device | None = None) -> Array:
    check_device(ctx, device)
    dt = default_float(ctx) if dtype is None else require_dtype(ctx, dtype)
    return empty_array(ctx, normalize_shape(shape), dt)


def zeros(ctx: Context, shape: int | tuple[int, ...], *, dtype: Any = None,
          device: Device | None = None) -> Array:
    out = empty(ctx, shape, dtype=dtype, device=device)
    fill(out, 0)
    return out


def ones(ctx: Context, shape: int | tuple[int, ...], *, dtype: Any = None,
         device: Device | None = None) -> Array:
    out = empty(ctx, shape, dtype=dtype, device=device)
    fill(out, True if out.dtype.kind == "b" else 1)
    return out


def full(ctx: Context, shape: int | tuple[int, ...], fill_value: Scalar, *, dtype: Any = None,
         device: Device | None = None) -> Array:
    check_device(ctx, device)
    fill_value = _scalar(fill_value)
    dt = default_dtype_of(ctx, fill_value) if dtype is None else require_dtype(ctx, dtype)
    out = empty_array(ctx, normalize_shape(shape), dt)
    fill(out, fill_value)
    return out


def _scalar(value: Any) -> Scalar:
    if isinstance(value, Array):
        if value.ndim != 0:
            raise TypeError("fill_value must be a scalar")
        return value._scalar("fill_value")  # type: ignore[no-any-return]
    if isinstance(value, np.generic):
        return value.item()  # type: ignore[no-any-return]
    if not isinstance(value, (bool, int, float, complex)):
        raise TypeError(f"fill_value must be a bool, int, float or complex, got {type(value).__name__}")
    return value


def arange(ctx: Context, start: int | float, /, stop: int | float | None = None, step: int | float = 1, *,
           dtype: Any = None, device: Device | None = None) -> Array:
    """``[start, start + step, ...)`` up to ``stop`` (exclusive); ``arange(n)`` counts from 0."""
    check_device(ctx, device)
    if stop is None:
        start, stop = 0, start
    for value in (start, stop, step):
        if isinstance(value, (complex, np.complexfloating)) or not isinstance(value, (int, float, np.number)):
            raise TypeError(f"arange takes real numbers, got {value!r}")
    if step == 0:
        raise ValueError("arange: step must not be zero")
    all_ints = all(isinstance(v, (int, np.integer)) for v in (start, stop, step))
    dt = (_I64 if all_ints else default_float(ctx)) if dtype is None else require_dtype(ctx, dtype)
    if all_ints:
        n = len(range(int(start), int(stop), int(step)))
    else:
        n = max(0, math.ceil((float(stop) - float(start)) / float(step)))
    out = empty_array(ctx, (n,), dt)
    if n:
        _arange_into(out, start, step)
    return out


def _arange_into(out: Array, start: int | float, step: int | float) -> None:
    out._ctx.kernels.arange(out._view, start, step)


def linspace(ctx: Context, start: Any, stop: Any, /, num: int, *,
             dtype: Any = None, device: Device | None = None, endpoint: bool = True) -> Array:
    """``num`` evenly spaced values from ``start`` to ``stop`` (included where ``endpoint``)."""
    check_device(ctx, device)
    if not isinstance(num, (int, np.integer)) or isinstance(num, bool) or num < 0:
        raise ValueError(f"linspace: num must be a non-negative int, got {num!r}")
    is_complex = isinstance(start, complex) or isinstance(stop, complex)
    if dtype is None:
        dt = default_complex(ctx) if is_complex else default_float(ctx)
    else:
        dt = require_dtype(ctx, dtype)
        if dt.kind not in "fc":
            raise TypeError(f"linspace makes floating arrays, not {dt}")
        if is_complex and dt.kind != "c":
            raise TypeError(f"complex bounds need a complex dtype, not {dt}")
    num = int(num)
    out = empty_array(ctx, (num,), dt)
    if num == 0:
        return out
    divisions = num - 1 if endpoint else num
    if dt.kind == "c":  # rare: computed on the host
        host = np.linspace(complex(start), complex(stop), num, endpoint=endpoint).astype(dt)
        copy_into(out, upload(ctx, host)._view)
        return out
    step = (float(stop) - float(start)) / divisions if divisions else 0.0
    _arange_into(out, float(start), step)
    if endpoint and num > 1:
        last = Array(ctx, out._storage, View(out._view.buffer, dt, (), (), num - 1))
        fill(last, float(stop))
    return out


def eye(ctx: Context, n_rows: int, n_cols: int | None = None, /, *, k: int = 0, dtype: Any = None,
        device: Device | None = None) -> Array:
    """Ones on the ``k``-th diagonal, zeros elsewhere."""
    cols = n_rows if n_cols is None else n_cols
    out = zeros(ctx, (n_rows, cols), dtype=dtype, device=device)
    if k >= 0:
        length, offset = max(0, min(n_rows, cols - k)), k
    else:
        length, offset = max(0, min(n_rows + k, cols)), -k * cols
    if length:
        diagonal = Array(ctx, out._storage, View(out._view.buffer, out.dtype, (length,), (cols + 1,), offset))
        fill(diagonal, True if out.dtype.kind == "b" else 1)
    return out


# -- from other arrays ----------------------------------------------------------------------------------
def _like(x: Array, dtype: Any, device: Device | None) -> Array:
    if not isinstance(x, Array):
        raise TypeError(f"expected an array, got {type(x).__name__}")
    check_device(x._ctx, device)
    dt = x.dtype if dtype is None else require_dtype(x._ctx, dtype)
    return empty_array(x._ctx, x.shape, dt)


def empty_like(x: Array, /, *, dtype: Any = None, device: Device | None = None) -> Array:
    return _like(x, dtype, device)


def zeros_like(x: Array, /, *, dtype: Any = None, device: Device | None = None) -> Array:
    out = _like(x, dtype, device)
    fill(out, 0)
    return out


def ones_like(x: Array, /, *, dtype: Any = None, device: Device | None = None) -> Array:
    out = _like(x, dtype, device)
    fill(out, True if out.dtype.kind == "b" else 1)
    return out


def full_like(x: Array, /, fill_value: Scalar, *, dtype: Any = None, device: Device | None = None) -> Array:
    out = _like(x, dtype, device)
    fill(out, _scalar(fill_value))
    return out


def astype(x: Array, dtype: Any, /, *, copy: bool = True, device: Any = None) -> Array:
    """``x`` as ``dtype``: itself where nothing changes and ``copy`` is False, else a fresh array. Complex to
    real is a TypeError (the standard: take ``real`` first); bool casts to 0/1, nonzero numbers to True."""
    if not isinstance(x, Array):
        raise TypeError(f"expected an array, got {type(x).__name__}")
    check_device(x._ctx, device)
    dt = require_dtype(x._ctx, dtype)
    if x.dtype.kind == "c" and dt.kind != "c":
        raise TypeError(f"casting {x.dtype} to {dt} drops the imaginary part: take real() first")
    if dt == x.dtype:
        return copy_view(x) if copy else x
    out = empty_array(x._ctx, x.shape, dt)
    if out.size:
        x._ctx.kernels.copy(out._view, x._view)
    return out


def _triangle(x: Array, k: int, lower: bool) -> Array:
    if not isinstance(x, Array):
        raise TypeError(f"expected an array, got {type(x).__name__}")
    if x.ndim < 2:
        raise ValueError(f"tril/triu need at least 2 dimensions, got shape {x.shape}")
    ctx = x._ctx
    n, m = x.shape[-2:]
    rows = arange(ctx, n)
    cols = arange(ctx, m)
    rows_2d = Array(ctx, rows._storage, View(rows._view.buffer, rows.dtype, (n, 1), (1, 0), 0))
    cols_2d = Array(ctx, cols._storage, View(cols._view.buffer, cols.dtype, (1, m), (0, 1), 0))
    diff = subtract(cols_2d, rows_2d)  # j - i: the diagonal each element is on
    keep = less_equal(diff, k) if lower else greater_equal(diff, k)
    zero = zeros(ctx, (), dtype=x.dtype)
    return where(keep, x, zero)


def tril(x: Array, /, *, k: int = 0) -> Array:
    """The lower triangle (on and below the ``k``-th diagonal) of the last two axes; zeros above."""
    return _triangle(x, k, lower=True)


def triu(x: Array, /, *, k: int = 0) -> Array:
    """The upper triangle (on and above the ``k``-th diagonal) of the last two axes; zeros below."""
    return _triangle(x, k, lower=False)


def meshgrid(*arrays: Array, indexing: str = "xy") -> list[Array]:
    """Coordinate matrices from 1-d arrays (``indexing`` "xy": Cartesian, the first two axes swapped; "ij":
    matrix). Each result is a fresh array."""
    if indexing not in ("xy", "ij"):
        raise ValueError(f"indexing must be 'xy' or 'ij', got {indexing!r}")
    if not arrays:
        return []
    for a in arrays:
        if not isinstance(a, Array):
            raise TypeError(f"meshgrid takes arrays, got {type(a).__name__}")
        if a.ndim != 1:
            raise ValueError(f"meshgrid takes 1-d arrays, got shape {a.shape}")
    if len({a.dtype for a in arrays}) > 1:
        raise TypeError("meshgrid's arrays must share one dtype")
    shape = [a.shape[0] for a in arrays]
    axes = list(range(len(arrays)))
    if indexing == "xy" and len(arrays) > 1:
        shape[0], shape[1] = shape[1], shape[0]
        axes[0], axes[1] = 1, 0
    out_shape = tuple(shape)
    results = []
    for a, axis in zip(arrays, axes, strict=True):
        ctx = a._ctx
        strides = tuple(a._view.strides[0] if d == axis else 0 for d in range(len(out_shape)))
        out = empty_array(ctx, out_shape, a.dtype)
        gather(ctx, out._view, View(a._view.buffer, a.dtype, out_shape, strides, a._view.offset))
        results.append(out)
    return results
