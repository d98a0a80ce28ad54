"""``xp.fft``: the standard's FFT extension (2024.12).

The transforms are library operations in the worker (cuFFT through CuPy on CUDA, pocketfft through NumPy on PoCL);
``fftfreq`` and ``rfftfreq`` are computed on the host (n numbers, one upload); the shifts are rolls.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import numpy as np

from gpubroker.client.array import _manipulation
from gpubroker.client.array._array import Array
from gpubroker.client.array._context import Context, Device
from gpubroker.client.array._creation import check_device, default_float, require_dtype, upload
from gpubroker.client.array._dtypes import ALL_DTYPES
from gpubroker.client.array._library_calls import call, context_of, normalize_axis

__all__ = ["fft", "fftfreq", "fftn", "fftshift", "hfft", "ifft", "ifftn", "ifftshift", "ihfft", "irfft", "irfftn",
           "rfft", "rfftfreq", "rfftn"]

Norm = Literal["backward", "ortho", "forward"]
_NORMS = ("backward", "ortho", "forward")


def _check(name: str, x: Array, kind: str, norm: str) -> None:
    """TypeError unless ``x`` is of ``kind`` ("c": complex, "f": real floating), as array-api-strict."""
    context_of(x)
    if x.dtype.kind != kind:
        what = "complex floating-point" if kind == "c" else "real floating-point"
        raise TypeError(f"fft.{name} takes {what} arrays, got {x.dtype}")
    if norm not in _NORMS:
        raise ValueError(f"fft.{name}: norm must be one of {', '.join(_NORMS)}, got {norm!r}")


def _one(op: str, kind: str, x: Array, n: int | None, axis: int, norm: str) -> Array:
    _check(op, x, kind, norm)
    if x.ndim == 0:
        raise ValueError(f"fft.{op} needs an array of at least 1 dimension")
    axis = normalize_axis(axis, x.ndim)
    if n is not None:
        if not isinstance(n, (int, np.integer)) or isinstance(n, bool):
            raise TypeError(f"fft.{op}: n must be an integer, got {type(n).__name__}")
        if n < 1:
            raise ValueError(f"fft.{op}: n must be at least 1, got {n}")
        n = int(n)
    (out,) = call(f"fft.{op}", [x], {"n": n, "axis": axis, "norm": norm})
    return out


def _many(op: str, kind: str, x: Array, s: Sequence[int] | None, axes: Sequence[int] | None, norm: str) -> Array:
    _check(op, x, kind, norm)
    axes_list = None if axes is None else [normalize_axis(a, x.ndim) for a in axes]
    if axes_list is not None and len(set(axes_list)) != len(axes_list):
        raise ValueError(f"fft.{op}: repeated axes in {axes!r}")
    s_list = None if s is None else [int(e) for e in s]
    if s_list is not None:
        if any(e < 1 and e != -1 for e in s_list):
            raise ValueError(f"fft.{op}: every element of s must be at least 1 (or -1), got {s!r}")
        if axes_list is None:
            raise ValueError(f"fft.{op}: s needs axes (the standard leaves no default for them)")
        if len(s_list) != len(axes_list):
            raise ValueError(f"fft.{op}: s and axes differ in length ({s!r}, {axes!r})")
    (out,) = call(f"fft.{op}", [x], {"s": s_list, "axes": axes_list, "norm": norm})
    return out


def fft(x: Array, /, *, n: int | None = None, axis: int = -1, norm: Norm = "backward") -> Array:
    """The one-dimensional discrete Fourier transform of the complex ``x`` along ``axis``."""
    return _one("fft", "c", x, n, axis, norm)


def ifft(x: Array, /, *, n: int | None = None, axis: int = -1, norm: Norm = "backward") -> Array:
    """The one-dimensional inverse discrete Fourier transform of the complex ``x`` along ``axis``."""
    return _one("ifft", "c", x, n, axis, norm)


def rfft(x: Array, /, *, n: int | None = None, axis: int = -1, norm: Norm = "backward") -> Array:
    """The one-dimensional transform of the real ``x``: the ``n // 2 + 1`` non-negative frequencies."""
    return _one("rfft", "f", x, n, axis, norm)


def irfft(x: Array, /, *, n: int | None = None, axis: int = -1, norm: Norm = "backward") -> Array:
    """The inverse of ``rfft``: ``n`` real values (default ``2 * (m - 1)``) from ``m`` non-negative frequencies."""
    return _one("irfft", "c", x, n, axis, norm)


def hfft(x: Array, /, *, n: int | None = None, axis: int = -1, norm: Norm = "backward") -> Array:
    """The transform of a signal with Hermitian symmetry given by its first half: a real result."""
    return _one("hfft", "c", x, n, axis, norm)


def ihfft(x: Array, /, *, n: int | None = None, axis: int = -1, norm: Norm = "backward") -> Array:
    """The inverse of ``hfft``: the first half (complex) of the Hermitian spectrum of the real ``x``."""
    return _one("ihfft", "f", x, n, axis, norm)


def fftn(x: Array, /, *, s: Sequence[int] | None = None, axes: Sequence[int] | None = None,
         norm: Norm = "backward") -> Array:
    """The n-dimensional discrete Fourier transform of the complex ``x`` over ``axes`` (sizes ``s``)."""
    return _many("fftn", "c", x, s, axes, norm)


def ifftn(x: Array, /, *, s: Sequence[int] | None = None, axes: Sequence[int] | None = None,
          norm: Norm = "backward") -> Array:
    """The n-dimensional inverse discrete Fourier transform of the complex ``x``."""
    return _many("ifftn", "c", x, s, axes, norm)


def rfftn(x: Array, /, *, s: Sequence[int] | None = None, axes: Sequence[int] | None = None,
          norm: Norm = "backward") -> Array:
    """The n-dimensional transform of the real ``x`` (the last axis halved, as ``rfft``)."""
    return _many("rfftn", "f", x, s, axes, norm)


def irfftn(x: Array, /, *, s: Sequence[int] | None = None, axes: Sequence[int] | None = None,
           norm: Norm = "backward") -> Array:
    """The inverse of ``rfftn``: a real result."""
    return _many("irfftn", "c", x, s, axes, norm)


def _frequencies(ctx: Context, name: str, values: np.ndarray[Any, Any], dtype: np.dtype[Any] | None,
                 device: Device | None) -> Array:
    check_device(ctx, device)
    if dtype is None:
        dtype = default_float(ctx)
    elif not isinstance(dtype, np.dtype) or dtype not in ALL_DTYPES or dtype.kind != "f":
        raise ValueError(f"fft.{name}: dtype must be a real floating-point dtype, got {dtype!r}")
    return upload(ctx, values.astype(require_dtype(ctx, dtype)))


def _sample_count(name: str, n: int, d: float) -> int:
    if not isinstance(n, (int, np.integer)) or isinstance(n, bool):
        raise TypeError(f"fft.{name}: n must be an integer, got {type(n).__name__}")
    if n < 1:
        raise ValueError(f"fft.{name}: n must be at least 1, got {n}")
    if d == 0:
        raise ValueError(f"fft.{name}: d must not be zero")
    return int(n)


def fftfreq(ctx: Context, n: int, /, *, d: float = 1.0, dtype: np.dtype[Any] | None = None,
            device: Device | None = None) -> Array:
    """The sample frequencies of an ``n``-point ``fft`` with sample spacing ``d``."""
    n = _sample_count("fftfreq", n, d)
    return _frequencies(ctx, "fftfreq", np.fft.fftfreq(n, d), dtype, device)


def rfftfreq(ctx: Context, n: int, /, *, d: float = 1.0, dtype: np.dtype[Any] | None = None,
             device: Device | None = None) -> Array:
    """The sample frequencies of an ``n``-point ``rfft`` with sample spacing ``d`` (``n // 2 + 1`` of them)."""
    n = _sample_count("rfftfreq", n, d)
    return _frequencies(ctx, "rfftfreq", np.fft.rfftfreq(n, d), dtype, device)


def _shift(name: str, x: Array, axes: int | Sequence[int] | None, inverse: bool) -> Array:
    context_of(x)
    if x.dtype.kind not in "fc":
        raise TypeError(f"fft.{name} takes floating-point arrays, got {x.dtype}")
    if axes is None:
        axes_list = list(range(x.ndim))
    elif isinstance(axes, (int, np.integer)):
        axes_list = [int(axes)]
    else:
        axes_list = [int(a) for a in axes]
    axes_list = [normalize_axis(a, x.ndim) for a in axes_list]
    if not axes_list:
        return _manipulation.roll(x, 0)  # a copy: the standard's functions return new arrays
    shifts = [-(x.shape[a] // 2) if inverse else x.shape[a] // 2 for a in axes_list]
    return _manipulation.roll(x, tuple(shifts), axis=tuple(axes_list))


def fftshift(x: Array, /, *, axes: int | Sequence[int] | None = None) -> Array:
    """``x`` with the zero-frequency term moved to the centre of ``axes`` (all by default)."""
    return _shift("fftshift", x, axes, inverse=False)


def ifftshift(x: Array, /, *, axes: int | Sequence[int] | None = None) -> Array:
    """The inverse of ``fftshift``."""
    return _shift("ifftshift", x, axes, inverse=True)
