"""What ``xp`` holds: every name of the Python Array API standard (2024.12) that the namespace has, each imported from
the module that implements it (as array-api-strict's ``__init__`` lists its own).

``Namespace`` sets exactly ``__all__`` on ``xp``, and the extensions' names as ``xp.linalg`` and ``xp.fft``; a
function whose first parameter is ``ctx`` (one that makes arrays from nothing) is bound to the namespace's Context.
The helpers the modules share (``promote``, ``as_operand``, ...) are not listed, and so are not in ``xp``.
"""

from __future__ import annotations

from typing import Final

from gpubroker.client.array import _fft, _linalg
from gpubroker.client.array._constants import e, inf, nan, newaxis, pi
from gpubroker.client.array._creation import (
    arange,
    asarray,
    astype,
    empty,
    empty_like,
    eye,
    from_dlpack,
    full,
    full_like,
    linspace,
    meshgrid,
    ones,
    ones_like,
    tril,
    triu,
    zeros,
    zeros_like,
)
from gpubroker.client.array._dtypes import (
    bool,
    can_cast,
    complex64,
    complex128,
    finfo,
    float32,
    float64,
    iinfo,
    int8,
    int16,
    int32,
    int64,
    isdtype,
    result_type,
    uint8,
    uint16,
    uint32,
    uint64,
)
from gpubroker.client.array._elementwise import (
    abs,
    acos,
    acosh,
    add,
    asin,
    asinh,
    atan,
    atan2,
    atanh,
    bitwise_and,
    bitwise_invert,
    bitwise_left_shift,
    bitwise_or,
    bitwise_right_shift,
    bitwise_xor,
    ceil,
    clip,
    conj,
    copysign,
    cos,
    cosh,
    divide,
    equal,
    exp,
    expm1,
    floor,
    floor_divide,
    greater,
    greater_equal,
    hypot,
    imag,
    isfinite,
    isinf,
    isnan,
    less,
    less_equal,
    log,
    log1p,
    log2,
    log10,
    logaddexp,
    logical_and,
    logical_not,
    logical_or,
    logical_xor,
    maximum,
    minimum,
    multiply,
    negative,
    nextafter,
    not_equal,
    positive,
    pow,
    real,
    reciprocal,
    remainder,
    round,
    sign,
    signbit,
    sin,
    sinh,
    sqrt,
    square,
    subtract,
    tan,
    tanh,
    trunc,
    where,
)
from gpubroker.client.array._indexing import take, take_along_axis
from gpubroker.client.array._info import __array_namespace_info__
from gpubroker.client.array._linear import matmul, matrix_transpose, tensordot, vecdot
from gpubroker.client.array._manipulation import (
    broadcast_arrays,
    broadcast_to,
    concat,
    expand_dims,
    flip,
    moveaxis,
    permute_dims,
    repeat,
    reshape,
    roll,
    squeeze,
    stack,
    tile,
    unstack,
)
from gpubroker.client.array._scans import cumulative_prod, cumulative_sum
from gpubroker.client.array._searching import nonzero, searchsorted
from gpubroker.client.array._sets import unique_all, unique_counts, unique_inverse, unique_values
from gpubroker.client.array._sorting import argsort, sort
from gpubroker.client.array._statistical import argmax, argmin, count_nonzero, max, mean, min, prod, std, sum, var
from gpubroker.client.array._utility import all, any, diff

__all__ = [
    # data types and their functions (_dtypes)
    "bool", "can_cast", "complex64", "complex128", "finfo", "float32", "float64", "iinfo", "int8", "int16", "int32",
    "int64", "isdtype", "result_type", "uint8", "uint16", "uint32", "uint64",
    # creation functions (_creation); the ones that take ``ctx`` are bound
    "arange", "asarray", "empty", "empty_like", "eye", "from_dlpack", "full", "full_like", "linspace", "meshgrid",
    "ones", "ones_like", "tril", "triu", "zeros", "zeros_like",
    # elementwise functions (_elementwise)
    "abs", "acos", "acosh", "add", "asin", "asinh", "atan", "atan2", "atanh", "bitwise_and", "bitwise_invert",
    "bitwise_left_shift", "bitwise_or", "bitwise_right_shift", "bitwise_xor", "ceil", "clip", "conj", "copysign", "cos",
    "cosh", "divide", "equal", "exp", "expm1", "floor", "floor_divide", "greater", "greater_equal", "hypot", "imag",
    "isfinite", "isinf", "isnan", "less", "less_equal", "log", "log1p", "log2", "log10", "logaddexp", "logical_and",
    "logical_not", "logical_or", "logical_xor", "maximum", "minimum", "multiply", "negative", "nextafter", "not_equal",
    "positive", "pow", "real", "reciprocal", "remainder", "round", "sign", "signbit", "sin", "sinh", "sqrt", "square",
    "subtract", "tan", "tanh", "trunc", "where",
    # statistical functions (_statistical)
    "argmax", "argmin", "count_nonzero", "max", "mean", "min", "prod", "std", "sum", "var",
    # manipulation functions (_manipulation; astype, the standard's data type function, is _creation's)
    "astype", "broadcast_arrays", "broadcast_to", "concat", "expand_dims", "flip", "moveaxis", "permute_dims",
    "repeat", "reshape", "roll", "squeeze", "stack", "tile", "unstack",
    # indexing (_indexing), searching (_searching), sorting (_sorting), set functions (_sets)
    "take", "take_along_axis",
    "nonzero", "searchsorted",
    "argsort", "sort",
    "unique_all", "unique_counts", "unique_inverse", "unique_values",
    # linear algebra of the core (_linear)
    "matmul", "matrix_transpose", "tensordot", "vecdot",
    # utility functions (_utility)
    "all", "any", "diff",
    # inspection (_info), bound
    "__array_namespace_info__",
    # cumulative sums and products (_scans)
    "cumulative_prod", "cumulative_sum",
    # constants (_constants)
    "e", "inf", "nan", "newaxis", "pi",
]

# The extensions, each a sub-namespace of xp: the names of its module that it holds.
EXTENSIONS: Final = {
    "linalg": (_linalg, ("cholesky", "cross", "det", "diagonal", "eigh", "eigvalsh", "inv", "matmul", "matrix_norm",
                         "matrix_power", "matrix_rank", "matrix_transpose", "outer", "pinv", "qr", "slogdet", "solve",
                         "svd", "svdvals", "tensordot", "trace", "vecdot", "vector_norm")),
    "fft": (_fft, ("fft", "fftfreq", "fftn", "fftshift", "hfft", "ifft", "ifftn", "ifftshift", "ihfft", "irfft",
                   "irfftn", "rfft", "rfftfreq", "rfftn")),
}
