"""Data types: the standard's thirteen, its promotion rules, and the inspection functions.

The namespace's dtype objects are numpy's (``xp.float32 is numpy.dtype("float32")``): one name per thing between
the host and the device, and conversions to and from numpy need no table. What a device lacks (float64 and
complex128 on an OpenCL device without cl_khr_fp64) is left out of ``__array_namespace_info__().dtypes()`` and
refused where it would be made.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

import numpy as np

__all__ = [
    "ALL_DTYPES",
    "DType",
    "bool",
    "can_cast",
    "complex64",
    "complex128",
    "finfo",
    "finfo_object",
    "float32",
    "float64",
    "iinfo",
    "iinfo_object",
    "int8",
    "int16",
    "int32",
    "int64",
    "isdtype",
    "promote",
    "result_type",
    "result_type_of",
    "scalar_dtype",
    "uint8",
    "uint16",
    "uint32",
    "uint64",
]

DType = np.dtype
_pybool = bool  # the builtin, before the module's ``bool`` (the dtype) shadows it

bool: Final = np.dtype("bool")
int8: Final = np.dtype("int8")
int16: Final = np.dtype("int16")
int32: Final = np.dtype("int32")
int64: Final = np.dtype("int64")
uint8: Final = np.dtype("uint8")
uint16: Final = np.dtype("uint16")
uint32: Final = np.dtype("uint32")
uint64: Final = np.dtype("uint64")
float32: Final = np.dtype("float32")
float64: Final = np.dtype("float64")
complex64: Final = np.dtype("complex64")
complex128: Final = np.dtype("complex128")

ALL_DTYPES: Final = (bool, int8, int16, int32, int64, uint8, uint16, uint32, uint64, float32, float64, complex64,
                     complex128)
_BY_KIND: Final = {
    "bool": (bool,),
    "signed integer": (int8, int16, int32, int64),
    "unsigned integer": (uint8, uint16, uint32, uint64),
    "integral": (int8, int16, int32, int64, uint8, uint16, uint32, uint64),
    "real floating": (float32, float64),
    "complex floating": (complex64, complex128),
    "numeric": (int8, int16, int32, int64, uint8, uint16, uint32, uint64, float32, float64, complex64, complex128),
}
_SIGNED_BY_SIZE: Final[dict[int, np.dtype[Any]]] = {1: int8, 2: int16, 4: int32, 8: int64}
_FLOAT_BY_SIZE: Final[dict[int, np.dtype[Any]]] = {4: float32, 8: float64}
_COMPLEX_BY_FLOAT: Final[dict[np.dtype[Any], np.dtype[Any]]] = {float32: complex64, float64: complex128}


def _check(dtype: object) -> np.dtype[Any]:
    if not isinstance(dtype, np.dtype) or dtype not in ALL_DTYPES:
        raise TypeError(f"{dtype!r} is not one of the Array API's data types")
    return dtype


def promote(a: np.dtype[Any], b: np.dtype[Any]) -> np.dtype[Any]:
    """The standard's promotion of two dtypes, extended where it is silent: an integer with a floating dtype gives
    the floating one (a float32 model stays float32), bool with a number gives the number's dtype.

    uint64 with a signed integer has no common type: TypeError (as in the standard and array-api-strict).
    """
    if a == b:
        return a
    ka, kb = a.kind, b.kind
    if ka == "b":
        return b
    if kb == "b":
        return a
    if ka in "iu" and kb in "iu":
        if ka == kb:
            return a if a.itemsize >= b.itemsize else b
        signed, unsigned = (a, b) if ka == "i" else (b, a)
        if signed.itemsize > unsigned.itemsize:
            return signed
        if unsigned.itemsize == 8:
            raise TypeError(f"{a} and {b} have no common type (uint64 with a signed integer)")
        return _SIGNED_BY_SIZE[unsigned.itemsize * 2]
    if ka in "iu":
        return b
    if kb in "iu":
        return a
    # floating with floating (real or complex): the wider precision, complex if either is
    pa = a.itemsize // (2 if ka == "c" else 1)
    pb = b.itemsize // (2 if kb == "c" else 1)
    real = _FLOAT_BY_SIZE[max(pa, pb)]
    return _COMPLEX_BY_FLOAT[real] if "c" in (ka, kb) else real


def scalar_dtype(value: object, array_dtype: np.dtype[Any]) -> np.dtype[Any]:
    """The dtype a Python scalar takes beside an array of ``array_dtype`` (the standard: the array's, where the
    scalar's kind fits it). A float beside integers gives float64 (NumPy's choice), a complex beside real floats
    the complex dtype of the same precision."""
    if isinstance(value, (np.generic,)):
        value = value.item()
    k = array_dtype.kind
    if isinstance(value, _pybool):
        return array_dtype
    if isinstance(value, int):
        return array_dtype if k != "b" else int64
    if isinstance(value, float):
        return array_dtype if k in "fc" else float64
    if isinstance(value, complex):
        if k == "c":
            return array_dtype
        return complex128 if k != "f" or array_dtype == float64 else complex64
    raise TypeError(f"expected an array or a Python scalar, got {type(value).__name__}")


def result_type_of(*items: object) -> np.dtype[Any]:
    """``result_type`` over dtypes, arrays (anything with a ``dtype``) and Python scalars (taking the dtype the
    others promote to; scalars alone take their own default dtype)."""
    dtypes: list[np.dtype[Any]] = []
    scalars: list[object] = []
    for item in items:
        if isinstance(item, np.dtype):
            dtypes.append(_check(item))
        elif hasattr(item, "dtype") and not isinstance(item, np.generic):
            dtypes.append(_check(item.dtype))
        elif isinstance(item, (_pybool, int, float, complex)):
            scalars.append(item)
        else:
            raise TypeError(f"result_type takes arrays, dtypes and Python scalars, got {type(item).__name__}")
    if not dtypes:
        if not scalars:
            raise ValueError("result_type needs at least one array, dtype or scalar")
        dtypes.append(_default_for(scalars[0]))
        scalars = scalars[1:]
    out = dtypes[0]
    for d in dtypes[1:]:
        out = promote(out, d)
    for s in scalars:
        out = promote(out, scalar_dtype(s, out))
    return out


def result_type(*arrays_and_dtypes: Any) -> np.dtype[Any]:
    """The dtype the standard's promotion gives ``arrays_and_dtypes`` (arrays, dtypes and Python scalars; at
    least one array or dtype: ValueError otherwise)."""
    if not any(isinstance(item, np.dtype) or (hasattr(item, "dtype") and not isinstance(item, np.generic))
               for item in arrays_and_dtypes):
        raise ValueError("result_type needs at least one array or dtype")
    return result_type_of(*arrays_and_dtypes)


def _default_for(value: object) -> np.dtype[Any]:
    if isinstance(value, _pybool):
        return bool
    if isinstance(value, int):
        return int64
    if isinstance(value, float):
        return float64
    return complex128


def can_cast(from_: Any, to: np.dtype[Any], /) -> _pybool:
    """Whether promotion allows ``from_`` (a dtype or an array) to become ``to`` without a change of kind that the
    standard forbids (the promotion of the two is ``to``)."""
    src = _check(from_.dtype if hasattr(from_, "dtype") and not isinstance(from_, np.dtype) else from_)
    dst = _check(to)
    if src == dst:
        return True
    if dst.kind == "b":
        return False
    if src.kind == "b":
        return True  # False and True survive as 0 and 1 in every dtype (numpy's "safe" casting)
    if src.kind in "fc" and dst.kind in "iu":
        return False
    if src.kind == "c" and dst.kind == "f":
        return False
    if src.kind in "iu" and dst.kind in "fc":
        # Cross-kind, outside the standard's promotion table (which leaves it to the library): allowed where
        # every value survives exactly, as numpy's "safe" casting says (int32 -> float64, not int64 -> float32).
        return _pybool(np.can_cast(src, dst, "safe"))
    try:
        return promote(src, dst) == dst
    except TypeError:
        return False


@dataclass(frozen=True)
class finfo_object:
    bits: int
    eps: float
    max: float
    min: float
    smallest_normal: float
    dtype: np.dtype[Any]


@dataclass(frozen=True)
class iinfo_object:
    bits: int
    max: int
    min: int
    dtype: np.dtype[Any]


def finfo(type: Any, /) -> finfo_object:
    dt = _check(type.dtype if hasattr(type, "dtype") and not isinstance(type, np.dtype) else type)
    if dt.kind not in "fc":
        raise ValueError(f"finfo takes a floating dtype, got {dt}")
    info = np.finfo(dt)
    real = np.dtype(info.dtype)
    return finfo_object(info.bits, float(info.eps), float(info.max), float(info.min), float(info.smallest_normal),
                        real)


def iinfo(type: Any, /) -> iinfo_object:
    dt = _check(type.dtype if hasattr(type, "dtype") and not isinstance(type, np.dtype) else type)
    if dt.kind not in "iu":
        raise ValueError(f"iinfo takes an integer dtype, got {dt}")
    info = np.iinfo(dt)
    return iinfo_object(info.bits, int(info.max), int(info.min), dt)


def isdtype(dtype: np.dtype[Any], kind: Any) -> _pybool:
    """Whether ``dtype`` is of ``kind``: a dtype, one of the standard's kind names, or a tuple of either."""
    _check(dtype)
    if isinstance(kind, tuple):
        return any(isdtype(dtype, k) for k in kind)
    if isinstance(kind, np.dtype):
        return dtype == kind
    if isinstance(kind, str):
        if kind not in _BY_KIND:
            raise ValueError(f"unknown dtype kind {kind!r}; expected one of {', '.join(_BY_KIND)}")
        return dtype in _BY_KIND[kind]
    raise TypeError(f"kind must be a dtype, a kind name or a tuple of them, got {type(kind).__name__}")
