"""The standard's elementwise functions (2024.12), each one generated kernel launch into a fresh array.

Every function checks its operands' dtypes against the standard's category for it (TypeError otherwise, as
array-api-strict does), promotes (``_dtypes.promote``; a Python scalar takes ``_dtypes.scalar_dtype``) and
broadcasts, then queues one kernel (``Kernels.elementwise``) that converts each operand to the promoted dtype as it
reads it: a promotion costs no separate copy. The operation table and its C live in ``_op_table``.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from typing import Any, Final

import numpy as np

from gpubroker.client.array._array import Array, empty_array
from gpubroker.client.array._context import Context
from gpubroker.client.array._dtypes import ALL_DTYPES, promote, scalar_dtype
from gpubroker.client.array._op_table import result_dtype
from gpubroker.client.array._views import View, broadcast_shapes, broadcast_view

__all__ = [
    "abs", "acos", "acosh", "add", "as_operand", "asin", "asinh", "atan", "atan2", "atanh", "bitwise_and",
    "bitwise_invert", "bitwise_left_shift", "bitwise_or", "bitwise_right_shift", "bitwise_xor", "ceil", "clip",
    "conj", "copysign", "cos", "cosh", "divide", "equal", "exp", "expm1", "floor", "floor_divide", "greater",
    "greater_equal", "hypot", "imag", "inplace", "inplace_result", "isfinite", "isinf", "isnan", "less",
    "less_equal", "log", "log1p", "log2", "log10", "logaddexp", "logical_and", "logical_not", "logical_or",
    "logical_xor", "maximum", "minimum", "multiply", "negative", "nextafter", "not_equal", "positive", "pow",
    "real", "reciprocal", "remainder", "round", "sign", "signbit", "sin", "sinh", "sqrt", "square", "subtract",
    "tan", "tanh", "trunc", "where",
]

Scalar = bool | int | float | complex

# -- the standard's dtype categories ------------------------------------------------------------------------------
_BOOL: Final = frozenset(d for d in ALL_DTYPES if d.kind == "b")
_INTEGER: Final = frozenset(d for d in ALL_DTYPES if d.kind in "iu")
_REAL_FLOATING: Final = frozenset(d for d in ALL_DTYPES if d.kind == "f")
_FLOATING: Final = frozenset(d for d in ALL_DTYPES if d.kind in "fc")
_NUMERIC: Final = _INTEGER | _FLOATING
_REAL_NUMERIC: Final = _INTEGER | _REAL_FLOATING
_INTEGER_OR_BOOL: Final = _INTEGER | _BOOL
_ALL: Final = frozenset(ALL_DTYPES)
_CATEGORY_NAMES: Final = {_BOOL: "boolean", _INTEGER: "integer", _REAL_FLOATING: "real floating-point",
                          _FLOATING: "floating-point", _NUMERIC: "numeric", _REAL_NUMERIC: "real numeric",
                          _INTEGER_OR_BOOL: "integer or boolean", _ALL: "any"}

# The category of each binary function's operands (what the in-place operators check too).
_BINARY: Final[dict[str, frozenset[np.dtype[Any]]]] = {
    "add": _NUMERIC, "subtract": _NUMERIC, "multiply": _NUMERIC, "divide": _FLOATING, "pow": _NUMERIC,
    "floor_divide": _REAL_NUMERIC, "remainder": _REAL_NUMERIC, "atan2": _REAL_FLOATING,
    "copysign": _REAL_FLOATING, "hypot": _REAL_FLOATING, "logaddexp": _REAL_FLOATING,
    "nextafter": _REAL_FLOATING, "maximum": _REAL_NUMERIC, "minimum": _REAL_NUMERIC, "equal": _ALL,
    "not_equal": _ALL, "less": _REAL_NUMERIC, "less_equal": _REAL_NUMERIC, "greater": _REAL_NUMERIC,
    "greater_equal": _REAL_NUMERIC, "bitwise_and": _INTEGER_OR_BOOL, "bitwise_or": _INTEGER_OR_BOOL,
    "bitwise_xor": _INTEGER_OR_BOOL, "bitwise_left_shift": _INTEGER, "bitwise_right_shift": _INTEGER,
    "logical_and": _BOOL, "logical_or": _BOOL, "logical_xor": _BOOL,
}


def _refuse(fn: str, category: frozenset[np.dtype[Any]], dtype: np.dtype[Any]) -> TypeError:
    return TypeError(f"{fn} takes {_CATEGORY_NAMES[category]} dtypes, got {dtype}")


# -- constants: Python scalars as 0-d device arrays -----------------------------------------------------------
_CONSTANTS_MAX: Final = 1024
_constants: weakref.WeakKeyDictionary[Context, OrderedDict[tuple[np.dtype[Any], str], Array]] = \
    weakref.WeakKeyDictionary()
_constants_lock = threading.Lock()


def as_operand(ctx: Context, value: Scalar, dtype: np.dtype[Any]) -> Array:
    """``value`` as a 0-d array of ``dtype`` on ``ctx``'s device: made once (a fill kernel, no host transfer) and
    cached, so ``x * 2.0`` in a loop launches one kernel per iteration. The array is shared: never write to it.
    OverflowError where an integer does not fit ``dtype``."""
    key = (dtype, repr(value))  # repr: -0.0 and 0.0 (and nan) are different constants
    with _constants_lock:
        table = _constants.get(ctx)
        if table is None:
            table = _constants[ctx] = OrderedDict()
        hit = table.get(key)
        if hit is not None:
            table.move_to_end(key)
            return hit
    if dtype.kind in "iu":
        if not isinstance(value, (bool, int)):
            raise TypeError(f"a {type(value).__name__} cannot be an operand of {dtype} here")
        info = np.iinfo(dtype)
        if not info.min <= value <= info.max:
            raise OverflowError(f"Python integer {value} is out of bounds for {dtype}")
    out = empty_array(ctx, (), dtype)
    ctx.kernels.fill(out._view, value)
    with _constants_lock:
        table[key] = out
        if len(table) > _CONSTANTS_MAX:
            table.popitem(last=False)
    return out


# -- the shapes of a launch -----------------------------------------------------------------------------------
def _launch(fn: str, ctx: Context, views: list[View], compute: np.dtype[Any],
            out_dtype: np.dtype[Any] | None = None) -> Array:
    """A fresh array of the operands' broadcast shape holding ``fn`` of them."""
    shape = views[0].shape
    for v in views[1:]:
        if v.shape != shape:
            shape = broadcast_shapes(*(w.shape for w in views))
            break
    views = [v if v.shape == shape else broadcast_view(v, shape) for v in views]
    out = empty_array(ctx, shape, out_dtype if out_dtype is not None else result_dtype(fn, compute))
    ctx.kernels.elementwise(fn, out._view, views, compute)
    return out


def _unary(fn: str, category: frozenset[np.dtype[Any]], x: Array) -> Array:
    if not isinstance(x, Array):
        raise TypeError(f"{fn} takes an array, got {type(x).__name__}")
    dtype = x.dtype
    if dtype not in category:
        raise _refuse(fn, category, dtype)
    return _launch(fn, x._ctx, [x._view], dtype)


def _operands(fn: str, category: frozenset[np.dtype[Any]], x1: Array | Scalar, x2: Array | Scalar
              ) -> tuple[Context, View, View, np.dtype[Any]]:
    """The context, both operands as views (a scalar as a cached constant) and the dtype they promote to. A NumPy
    scalar counts as the Python scalar it holds."""
    if isinstance(x2, np.generic):
        x2 = x2.item()
    if isinstance(x1, np.generic):
        x1 = x1.item()
    if isinstance(x1, Array):
        ctx = x1._ctx
        d1 = x1.dtype
        if d1 not in category:
            raise _refuse(fn, category, d1)
        if isinstance(x2, Array):
            d2 = x2.dtype
            if x2._ctx is not ctx:
                raise ValueError(f"{fn}: the arrays are on different devices ({ctx.device!r}, {x2.device!r})")
            if d2 not in category:
                raise _refuse(fn, category, d2)
            dtype = d1 if d1 == d2 else promote(d1, d2)
            return ctx, x1._view, x2._view, dtype
        dtype = _with_scalar(fn, category, d1, x2)
        return ctx, x1._view, as_operand(ctx, x2, dtype)._view, dtype
    if isinstance(x2, Array):
        ctx = x2._ctx
        d2 = x2.dtype
        if d2 not in category:
            raise _refuse(fn, category, d2)
        dtype = _with_scalar(fn, category, d2, x1)
        return ctx, as_operand(ctx, x1, dtype)._view, x2._view, dtype
    raise TypeError(f"{fn} takes at least one array, got {type(x1).__name__} and {type(x2).__name__}")


def _with_scalar(fn: str, category: frozenset[np.dtype[Any]], dtype: np.dtype[Any], value: object
                 ) -> np.dtype[Any]:
    if not isinstance(value, (bool, int, float, complex)):
        raise TypeError(f"{fn} takes arrays and Python scalars, got {type(value).__name__}")
    out = promote(dtype, scalar_dtype(value, dtype))
    if out not in category:
        raise TypeError(f"{fn} takes {_CATEGORY_NAMES[category]} operands, got a {type(value).__name__} "
                        f"beside {dtype}")
    return out


def binary(fn: str, x1: Array | Scalar, x2: Array | Scalar) -> Array:
    """The elementwise function ``fn`` of two operands (what the array's binary operators call)."""
    ctx, v1, v2, dtype = _operands(fn, _BINARY[fn], x1, x2)
    return _launch(fn, ctx, [v1, v2], dtype)


# -- unary functions ----------------------------------------------------------------------------------------------
def abs(x: Array, /) -> Array:
    """|x| (for complex, the modulus, of the real dtype of the same precision)."""
    return _unary("abs", _NUMERIC, x)


def acos(x: Array, /) -> Array:
    return _unary("acos", _FLOATING, x)


def acosh(x: Array, /) -> Array:
    return _unary("acosh", _FLOATING, x)


def asin(x: Array, /) -> Array:
    return _unary("asin", _FLOATING, x)


def asinh(x: Array, /) -> Array:
    return _unary("asinh", _FLOATING, x)


def atan(x: Array, /) -> Array:
    return _unary("atan", _FLOATING, x)


def atanh(x: Array, /) -> Array:
    return _unary("atanh", _FLOATING, x)


def bitwise_invert(x: Array, /) -> Array:
    return _unary("bitwise_invert", _INTEGER_OR_BOOL, x)


def ceil(x: Array, /) -> Array:
    return _unary("ceil", _REAL_NUMERIC, x)


def conj(x: Array, /) -> Array:
    return _unary("conj", _NUMERIC, x)


def cos(x: Array, /) -> Array:
    return _unary("cos", _FLOATING, x)


def cosh(x: Array, /) -> Array:
    return _unary("cosh", _FLOATING, x)


def exp(x: Array, /) -> Array:
    return _unary("exp", _FLOATING, x)


def expm1(x: Array, /) -> Array:
    return _unary("expm1", _FLOATING, x)


def floor(x: Array, /) -> Array:
    return _unary("floor", _REAL_NUMERIC, x)


def imag(x: Array, /) -> Array:
    """The imaginary part (zeros for a real array), of the real dtype of the same precision."""
    return _unary("imag", _NUMERIC, x)


def isfinite(x: Array, /) -> Array:
    return _unary("isfinite", _NUMERIC | _BOOL, x)


def isinf(x: Array, /) -> Array:
    return _unary("isinf", _NUMERIC | _BOOL, x)


def isnan(x: Array, /) -> Array:
    return _unary("isnan", _NUMERIC | _BOOL, x)


def log(x: Array, /) -> Array:
    return _unary("log", _FLOATING, x)


def log1p(x: Array, /) -> Array:
    return _unary("log1p", _FLOATING, x)


def log2(x: Array, /) -> Array:
    return _unary("log2", _FLOATING, x)


def log10(x: Array, /) -> Array:
    return _unary("log10", _FLOATING, x)


def logical_not(x: Array, /) -> Array:
    return _unary("logical_not", _BOOL, x)


def negative(x: Array, /) -> Array:
    return _unary("negative", _NUMERIC, x)


def positive(x: Array, /) -> Array:
    return _unary("positive", _NUMERIC, x)


def real(x: Array, /) -> Array:
    """The real part, of the real dtype of the same precision (a real array's copy)."""
    return _unary("real", _NUMERIC, x)


def reciprocal(x: Array, /) -> Array:
    return _unary("reciprocal", _FLOATING, x)


def round(x: Array, /) -> Array:
    """To the nearest integer, halves to even (complex: each part)."""
    return _unary("round", _NUMERIC, x)


def sign(x: Array, /) -> Array:
    """-1, 0 or 1 (NaN for NaN); for complex ``x / |x|`` (0 for 0)."""
    return _unary("sign", _NUMERIC, x)


def signbit(x: Array, /) -> Array:
    return _unary("signbit", _REAL_FLOATING, x)


def sin(x: Array, /) -> Array:
    return _unary("sin", _FLOATING, x)


def sinh(x: Array, /) -> Array:
    return _unary("sinh", _FLOATING, x)


def sqrt(x: Array, /) -> Array:
    return _unary("sqrt", _FLOATING, x)


def square(x: Array, /) -> Array:
    return _unary("square", _NUMERIC, x)


def tan(x: Array, /) -> Array:
    return _unary("tan", _FLOATING, x)


def tanh(x: Array, /) -> Array:
    return _unary("tanh", _FLOATING, x)


def trunc(x: Array, /) -> Array:
    return _unary("trunc", _REAL_NUMERIC, x)


# -- binary functions ---------------------------------------------------------------------------------------------
def add(x1: Array | complex, x2: Array | complex, /) -> Array:
    return binary("add", x1, x2)


def atan2(x1: Array | float, x2: Array | float, /) -> Array:
    return binary("atan2", x1, x2)


def bitwise_and(x1: Array | int, x2: Array | int, /) -> Array:
    return binary("bitwise_and", x1, x2)


def bitwise_left_shift(x1: Array | int, x2: Array | int, /) -> Array:
    """``x1 << x2``; a shift past the width gives 0 (a negative shift is not defined by the standard: 0)."""
    return binary("bitwise_left_shift", x1, x2)


def bitwise_or(x1: Array | int, x2: Array | int, /) -> Array:
    return binary("bitwise_or", x1, x2)


def bitwise_right_shift(x1: Array | int, x2: Array | int, /) -> Array:
    """``x1 >> x2`` (arithmetic for signed integers); a shift past the width gives 0 or -1."""
    return binary("bitwise_right_shift", x1, x2)


def bitwise_xor(x1: Array | int, x2: Array | int, /) -> Array:
    return binary("bitwise_xor", x1, x2)


def copysign(x1: Array | float, x2: Array | float, /) -> Array:
    return binary("copysign", x1, x2)


def divide(x1: Array | complex, x2: Array | complex, /) -> Array:
    return binary("divide", x1, x2)


def equal(x1: Array | complex, x2: Array | complex, /) -> Array:
    return binary("equal", x1, x2)


def floor_divide(x1: Array | float, x2: Array | float, /) -> Array:
    """Python's ``//``: rounds toward -inf; an integer division by zero gives 0 (it never traps the device)."""
    return binary("floor_divide", x1, x2)


def greater(x1: Array | float, x2: Array | float, /) -> Array:
    return binary("greater", x1, x2)


def greater_equal(x1: Array | float, x2: Array | float, /) -> Array:
    return binary("greater_equal", x1, x2)


def hypot(x1: Array | float, x2: Array | float, /) -> Array:
    return binary("hypot", x1, x2)


def less(x1: Array | float, x2: Array | float, /) -> Array:
    return binary("less", x1, x2)


def less_equal(x1: Array | float, x2: Array | float, /) -> Array:
    return binary("less_equal", x1, x2)


def logaddexp(x1: Array | float, x2: Array | float, /) -> Array:
    return binary("logaddexp", x1, x2)


def logical_and(x1: Array | bool, x2: Array | bool, /) -> Array:
    return binary("logical_and", x1, x2)


def logical_or(x1: Array | bool, x2: Array | bool, /) -> Array:
    return binary("logical_or", x1, x2)


def logical_xor(x1: Array | bool, x2: Array | bool, /) -> Array:
    return binary("logical_xor", x1, x2)


def maximum(x1: Array | float, x2: Array | float, /) -> Array:
    """The larger of each pair; NaN if either is NaN."""
    return binary("maximum", x1, x2)


def minimum(x1: Array | float, x2: Array | float, /) -> Array:
    """The smaller of each pair; NaN if either is NaN."""
    return binary("minimum", x1, x2)


def multiply(x1: Array | complex, x2: Array | complex, /) -> Array:
    return binary("multiply", x1, x2)


def nextafter(x1: Array | float, x2: Array | float, /) -> Array:
    return binary("nextafter", x1, x2)


def not_equal(x1: Array | complex, x2: Array | complex, /) -> Array:
    return binary("not_equal", x1, x2)


def pow(x1: Array | complex, x2: Array | complex, /) -> Array:
    """``x1 ** x2``; an integer to a negative integer power gives 0 (1 and -1 give +-1)."""
    return binary("pow", x1, x2)


def remainder(x1: Array | float, x2: Array | float, /) -> Array:
    """Python's ``%``: the result takes the divisor's sign; an integer remainder by zero gives 0."""
    return binary("remainder", x1, x2)


def subtract(x1: Array | complex, x2: Array | complex, /) -> Array:
    return binary("subtract", x1, x2)


# -- where and clip -----------------------------------------------------------------------------------------------
def where(condition: Array, x1: Array | Scalar, x2: Array | Scalar, /) -> Array:
    """``x1`` where ``condition`` holds, else ``x2`` (broadcast together; at most one of them a Python scalar)."""
    if not isinstance(condition, Array):
        raise TypeError(f"where's condition must be an array, got {type(condition).__name__}")
    if condition.dtype.kind != "b":
        raise TypeError(f"where's condition must be boolean, got {condition.dtype}")
    ctx, v1, v2, dtype = _operands("where", _ALL, x1, x2)
    if ctx is not condition._ctx:
        raise ValueError("where: the arrays are on different devices")
    return _launch("where", ctx, [condition._view, v1, v2], dtype, dtype)


def clip(x: Array, /, min: Array | float | None = None, max: Array | float | None = None) -> Array:
    """``x`` limited to [min, max] (either may be None), of ``x``'s dtype and the broadcast shape; NaN in ``x``
    or a bound gives NaN. A Python integer bound beyond ``x``'s integer dtype is no bound."""
    if not isinstance(x, Array):
        raise TypeError(f"clip takes an array, got {type(x).__name__}")
    dtype = x.dtype
    if dtype not in _REAL_NUMERIC:
        raise _refuse("clip", _REAL_NUMERIC, dtype)
    ctx = x._ctx
    bounds: list[View | None] = []
    for name, bound in (("min", min), ("max", max)):
        if bound is None:
            bounds.append(None)
        elif isinstance(bound, Array):
            if bound.dtype not in _REAL_NUMERIC:
                raise _refuse("clip", _REAL_NUMERIC, bound.dtype)
            if bound._ctx is not ctx:
                raise ValueError("clip: the arrays are on different devices")
            if (dtype.kind in "iu") != (bound.dtype.kind in "iu"):
                raise TypeError(f"clip's {name} ({bound.dtype}) must be of the same kind as x ({dtype})")
            bounds.append(bound._view)
        elif isinstance(bound, (bool, int, float)):
            if dtype.kind in "iu":
                if not isinstance(bound, int):
                    raise TypeError(f"clip's {name} must be an integer when x is {dtype}")
                info = np.iinfo(dtype)
                if (name == "min" and bound <= info.min) or (name == "max" and bound >= info.max):
                    bounds.append(None)
                    continue
                bound = info.min if bound < info.min else info.max if bound > info.max else bound
            bounds.append(as_operand(ctx, bound, dtype)._view)
        else:
            raise TypeError(f"clip's {name} must be an array, a Python number or None, got {type(bound).__name__}")
    lo, hi = bounds
    if lo is not None and hi is not None:
        return _launch("clip", ctx, [x._view, lo, hi], dtype, dtype)
    if lo is not None:
        return _launch("clip_min", ctx, [x._view, lo], dtype, dtype)
    if hi is not None:
        return _launch("clip_max", ctx, [x._view, hi], dtype, dtype)
    return _launch("copy", ctx, [x._view], dtype, dtype)


# -- in-place operators -------------------------------------------------------------------------------------------
def inplace(fn_name: str, x: Array, other: Array | Scalar) -> Array:
    """``x <op>= other``: ``fn_name`` of the two computed into ``x``'s own memory (every view of it sees the
    change). The result must keep ``x``'s dtype and shape: TypeError (``x`` int and ``other`` float, say) or
    ValueError (``other`` broadcasts ``x`` to a larger shape) otherwise."""
    ctx, vx, vo, dtype = _operands(fn_name, _BINARY[fn_name], x, other)
    if dtype != x.dtype or result_dtype(fn_name, dtype) != x.dtype:
        raise TypeError(f"{fn_name} of {x.dtype} and {dtype} gives {result_dtype(fn_name, dtype)}, which cannot "
                        f"be stored in place into an array of {x.dtype}")
    if vo.shape != vx.shape:
        if broadcast_shapes(vx.shape, vo.shape) != vx.shape:
            raise ValueError(f"in-place {fn_name}: shape {vo.shape} does not broadcast to {vx.shape}")
        vo = broadcast_view(vo, vx.shape)
    if isinstance(other, Array) and other._storage is x._storage and vo != vx:
        # the operand overlaps the target in another layout: reading and writing in one pass would race
        return inplace_result(x, _launch(fn_name, ctx, [vx, vo], dtype))
    ctx.kernels.elementwise(fn_name, vx, [vx, vo], dtype)
    return x


def inplace_result(x: Array, result: Array) -> Array:
    """Copy ``result`` into ``x``'s memory (``x @= y``); it must have ``x``'s dtype (or one that promotes to it)
    and broadcast to ``x``'s shape."""
    if result.dtype != x.dtype and promote(x.dtype, result.dtype) != x.dtype:
        raise TypeError(f"a result of {result.dtype} cannot be stored in place into an array of {x.dtype}")
    view = result._view
    if view.shape != x.shape:
        if broadcast_shapes(x.shape, view.shape) != x.shape:
            raise ValueError(f"a result of shape {view.shape} does not broadcast to {x.shape}")
        view = broadcast_view(view, x.shape)
    x._ctx.kernels.copy(x._view, view)
    return x

