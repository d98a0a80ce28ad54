"""The library operations' one table: what each op takes, what it accepts, and what it returns.

``GpuCompute.run_library(op, inputs, outputs, params)`` runs a library operation (cuBLAS, cuSOLVER, cuFFT through
CuPy on CUDA; NumPy on PoCL's host device) on C-contiguous arrays the caller allocated. This module is pure (no
device): the client asks ``library_outputs`` what dtypes and shapes to allocate, and the worker asks the same
function whether the outputs it was given are exactly those, so the two can never disagree.

Names and semantics are NumPy's and the Array API standard's (2024.12). Dtypes are NumPy dtype names ("float32",
"int64", "complex64", "bool"); shapes are tuples of extents. An op whose result size depends on the data
(``unique_*``, ``nonzero``, ``compress``) takes its size as the param ``count``, which the caller learned first
(``count_unique``, a count of nonzero elements); the worker computes and refuses a result whose size differs.

Every refusal is an ``InvalidArgument`` whose message starts with the op's name.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, cast

import numpy as np

from gpubroker.wire.errors import InvalidArgument
from gpubroker.wire.types import ArrayRef, Buffer

__all__ = [
    "ALL_DTYPES",
    "ArraySpec",
    "LIBRARY_OPS",
    "LibraryOp",
    "MAX_LIBRARY_NDIM",
    "MAX_PARAM_INTS",
    "MAX_PARAM_STR",
    "Param",
    "ParamValue",
    "Params",
    "Shape",
    "check_library_call",
    "check_library_params",
    "check_shape",
    "fft_length",
    "fftn_plan",
    "library_op",
    "library_outputs",
]

Shape = tuple[int, ...]
ArraySpec = tuple[str, Shape]  # (dtype name, shape)
ParamValue = int | float | bool | str | None | list[int]

MAX_LIBRARY_NDIM: Final = 32  # dimensions of an array of a library op (NumPy allows 64, CuPy 64)
MAX_PARAM_STR: Final = 32  # characters of a str param
MAX_PARAM_INTS: Final = 32  # entries of a list[int] param
_MAX_INT: Final = 1 << 62  # any int param or extent past this is nonsense (and would overflow msgpack / C)

BOOL: Final = ("bool",)
SIGNED: Final = ("int8", "int16", "int32", "int64")
UNSIGNED: Final = ("uint8", "uint16", "uint32", "uint64")
REAL_FLOATING: Final = ("float32", "float64")
COMPLEX_FLOATING: Final = ("complex64", "complex128")
FLOATING: Final = REAL_FLOATING + COMPLEX_FLOATING
REAL: Final = SIGNED + UNSIGNED + REAL_FLOATING
NUMERIC: Final = REAL + COMPLEX_FLOATING
ALL_DTYPES: Final = BOOL + NUMERIC

_ITEMSIZE: Final = {"bool": 1, "int8": 1, "int16": 2, "int32": 4, "int64": 8, "uint8": 1, "uint16": 2, "uint32": 4,
                     "uint64": 8, "float32": 4, "float64": 8, "complex64": 8, "complex128": 16}
_REAL_OF: Final = {"float32": "float32", "float64": "float64", "complex64": "float32", "complex128": "float64"}
_COMPLEX_OF: Final = {"float32": "complex64", "float64": "complex128", "complex64": "complex64",
                      "complex128": "complex128"}
# cumulative_sum / cumulative_prod without a dtype: small integers widen to the default integer (as
# array-api-strict and NumPy 2 do), bool counts as int64.
_ACCUMULATE_DEFAULT: Final = {"bool": "int64", "int8": "int64", "int16": "int64", "int32": "int64",
                              "uint8": "uint64", "uint16": "uint64", "uint32": "uint64"}


@dataclass(frozen=True)
class Param:
    """One param of an op: its kind ("bool", "int", "float", "str", "ints", "dtype"), its default, whether None
    is allowed, the allowed strings of a "str", the least value of an "int" / "float", and whether it must be
    given."""

    kind: str
    default: ParamValue = None
    nullable: bool = False
    choices: tuple[str, ...] = ()
    minimum: int | None = None
    required: bool = False

    def check(self, op: str, name: str, value: object) -> ParamValue:
        """``value`` as the op takes it, or InvalidArgument naming the op and the param."""
        if value is None:
            if self.nullable:
                return None
            raise InvalidArgument(f"{op}: param {name!r} must not be None")
        kind = self.kind
        if kind == "bool":
            if isinstance(value, (bool, np.bool_)):
                return bool(value)
            raise InvalidArgument(f"{op}: param {name!r} must be a bool, got {_show(value)}")
        if kind == "int":
            integer = _as_int(value)
            if integer is None:
                raise InvalidArgument(f"{op}: param {name!r} must be an int, got {_show(value)}")
            _check_int(op, name, integer, self.minimum)
            return integer
        if kind == "float":
            if not isinstance(value, (int, float, np.integer, np.floating)) or isinstance(value, bool):
                raise InvalidArgument(f"{op}: param {name!r} must be a float, got {_show(value)}")
            number = float(value)
            if not math.isfinite(number) or (self.minimum is not None and number < self.minimum):
                raise InvalidArgument(f"{op}: param {name!r} must be a finite float >= {self.minimum}, got {number!r}")
            return number
        if kind in ("str", "dtype"):
            if type(value) is not str or len(value) > MAX_PARAM_STR:
                raise InvalidArgument(f"{op}: param {name!r} must be a str of at most {MAX_PARAM_STR} characters, "
                                      f"got {_show(value)}")
            if value not in self.choices:
                raise InvalidArgument(f"{op}: param {name!r} must be one of {list(self.choices)}, got {value!r}")
            return value
        # "ints"
        if type(value) not in (list, tuple) or len(value) > MAX_PARAM_INTS:  # type: ignore[arg-type]
            raise InvalidArgument(f"{op}: param {name!r} must be a list of at most {MAX_PARAM_INTS} ints, "
                                  f"got {_show(value)}")
        items: list[int] = []
        for item in value:  # type: ignore[attr-defined]
            entry = _as_int(item)
            if entry is None:
                raise InvalidArgument(f"{op}: param {name!r} must hold ints, got {_show(item)}")
            _check_int(op, name, entry, self.minimum)
            items.append(entry)
        return items


def _as_int(value: object) -> int | None:
    """A Python or NumPy integer as an int (what the wire carries); None for anything else, bools included."""
    if type(value) is int:
        return value
    if isinstance(value, np.integer):
        return int(value)
    return None


def _show(value: object) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:40] + '...' if len(text) > 40 else text}"


def _check_int(op: str, name: str, value: int, minimum: int | None) -> None:
    if not -_MAX_INT <= value <= _MAX_INT:
        raise InvalidArgument(f"{op}: param {name!r} is out of range: {value}")
    if minimum is not None and value < minimum:
        raise InvalidArgument(f"{op}: param {name!r} must be >= {minimum}, got {value}")


Params = dict[str, ParamValue]
ShapeRule = Callable[["LibraryOp", list[ArraySpec], Params], list[ArraySpec]]


@dataclass(frozen=True)
class LibraryOp:
    """One library op: how many inputs and outputs, the dtypes its first input may have, its params, and the rule
    that gives its outputs' dtypes and shapes from its inputs' (and raises InvalidArgument on what it refuses)."""

    name: str
    inputs: int
    outputs: int
    dtypes: tuple[str, ...]
    rule: ShapeRule
    params: Mapping[str, Param] = field(default_factory=dict)

    def check_params(self, params: Mapping[str, object] | None) -> Params:
        """Every param of the op, checked, with its default where not given; an unknown param is refused."""
        given = {} if params is None else params
        if not isinstance(given, Mapping):
            raise InvalidArgument(f"{self.name}: params must be a mapping, got {type(given).__name__}")
        for key in given:
            if key not in self.params:
                shown = key[:40] if isinstance(key, str) else repr(key)[:40]
                raise InvalidArgument(f"{self.name}: unknown param {shown!r}; it takes "
                                      f"{sorted(self.params) or 'none'}")
        checked: Params = {}
        for name, spec in self.params.items():
            if name in given:
                checked[name] = spec.check(self.name, name, given[name])
            elif spec.required:
                raise InvalidArgument(f"{self.name}: param {name!r} is required")
            else:
                checked[name] = spec.default
        return checked

    def outputs_for(self, inputs: Sequence[tuple[str, Sequence[int]]], params: Params) -> list[ArraySpec]:
        """The outputs for checked ``params`` (``check_params``)."""
        if isinstance(inputs, (str, bytes)) or not isinstance(inputs, Sequence):
            raise InvalidArgument(f"{self.name}: inputs must be a sequence of (dtype, shape)")
        if len(inputs) != self.inputs:
            raise InvalidArgument(f"{self.name}: takes {self.inputs} input(s), got {len(inputs)}")
        specs = [_spec(self.name, i, item) for i, item in enumerate(inputs)]
        if specs and specs[0][0] not in self.dtypes:
            raise InvalidArgument(f"{self.name}: input dtype {specs[0][0]} is not supported; it takes "
                                  f"{', '.join(self.dtypes)}")
        return self.rule(self, specs, params)


def _spec(op: str, index: int, item: object) -> ArraySpec:
    if not isinstance(item, (tuple, list)) or len(item) != 2:
        raise InvalidArgument(f"{op}: input {index} must be a (dtype, shape) pair")
    dtype, shape = item
    if isinstance(dtype, np.dtype):
        dtype = dtype.name
    if type(dtype) is not str or dtype not in ALL_DTYPES:
        raise InvalidArgument(f"{op}: input {index} has an unknown dtype {_show(dtype)}")
    return dtype, check_shape(op, f"input {index}", shape)


def check_shape(op: str, what: str, shape: object) -> Shape:
    """``shape`` as a tuple of extents, or InvalidArgument naming the op and ``what``."""
    if not isinstance(shape, (tuple, list)) or len(shape) > MAX_LIBRARY_NDIM:
        raise InvalidArgument(f"{op}: {what} shape must be a tuple of at most {MAX_LIBRARY_NDIM} ints")
    extents = tuple(_as_int(extent) for extent in shape)
    for extent in extents:
        if extent is None or not 0 <= extent <= _MAX_INT:
            raise InvalidArgument(f"{op}: {what} shape {tuple(shape)!r} must hold ints >= 0")
    return extents  # type: ignore[return-value]  # (no None is left)


# -- shape helpers ---------------------------------------------------------------------------------
def _axis(op: str, axis: object, ndim: int, name: str = "axis") -> int:
    assert type(axis) is int
    if not -ndim <= axis < ndim:
        raise InvalidArgument(f"{op}: {name} {axis} is out of range for an array of {ndim} dimension(s)")
    return axis % ndim


def _broadcast(op: str, a: Shape, b: Shape) -> Shape:
    out: list[int] = []
    for i in range(max(len(a), len(b))):
        x = a[len(a) - 1 - i] if i < len(a) else 1
        y = b[len(b) - 1 - i] if i < len(b) else 1
        if x != y and x != 1 and y != 1:
            raise InvalidArgument(f"{op}: batch shapes {a} and {b} do not broadcast")
        out.append(y if x == 1 else x)
    return tuple(reversed(out))


def _same_dtypes(op: str, specs: list[ArraySpec]) -> str:
    dtype = specs[0][0]
    for i, (other, _) in enumerate(specs[1:], 1):
        if other != dtype:
            raise InvalidArgument(f"{op}: input {i} has dtype {other}, input 0 has {dtype}; they must be the same")
    return dtype


def _matrices(op: str, shape: Shape, square: bool = False) -> tuple[Shape, int, int]:
    if len(shape) < 2:
        raise InvalidArgument(f"{op}: x must have at least 2 dimensions (a stack of matrices), got shape {shape}")
    m, n = shape[-2], shape[-1]
    if square and m != n:
        raise InvalidArgument(f"{op}: x must be a stack of square matrices, got shape {shape}")
    return shape[:-2], m, n


def _count(op: str, params: Params, most: int) -> int:
    count = params["count"]
    assert type(count) is int
    if count > most:
        raise InvalidArgument(f"{op}: count {count} exceeds the {most} element(s) it can have")
    return count


# -- rules -----------------------------------------------------------------------------------------
def _matmul(op: LibraryOp, specs: list[ArraySpec], params: Params) -> list[ArraySpec]:
    dtype = _same_dtypes(op.name, specs)
    (_, a), (_, b) = specs
    if len(a) < 2 or len(b) < 2:
        raise InvalidArgument(f"{op.name}: both operands must have at least 2 dimensions, got {a} and {b}")
    if a[-1] != b[-2]:
        raise InvalidArgument(f"{op.name}: shapes {a} and {b} do not align: {a[-1]} (dim -1) != {b[-2]} (dim -2)")
    return [(dtype, (*_broadcast(op.name, a[:-2], b[:-2]), a[-2], b[-1]))]


def _square_same(op: LibraryOp, specs: list[ArraySpec], params: Params) -> list[ArraySpec]:
    dtype, shape = specs[0]
    _matrices(op.name, shape, square=True)
    return [(dtype, shape)]


def _det(op: LibraryOp, specs: list[ArraySpec], params: Params) -> list[ArraySpec]:
    dtype, shape = specs[0]
    batch, _, _ = _matrices(op.name, shape, square=True)
    return [(dtype, batch)]


def _slogdet(op: LibraryOp, specs: list[ArraySpec], params: Params) -> list[ArraySpec]:
    dtype, shape = specs[0]
    batch, _, _ = _matrices(op.name, shape, square=True)
    return [(dtype, batch), (_REAL_OF[dtype], batch)]


def _eigh(op: LibraryOp, specs: list[ArraySpec], params: Params) -> list[ArraySpec]:
    dtype, shape = specs[0]
    batch, m, _ = _matrices(op.name, shape, square=True)
    return [(_REAL_OF[dtype], (*batch, m)), (dtype, shape)]


def _eigvalsh(op: LibraryOp, specs: list[ArraySpec], params: Params) -> list[ArraySpec]:
    return _eigh(op, specs, params)[:1]


def _pinv(op: LibraryOp, specs: list[ArraySpec], params: Params) -> list[ArraySpec]:
    dtype, shape = specs[0]
    batch, m, n = _matrices(op.name, shape)
    return [(dtype, (*batch, n, m))]


def _qr(op: LibraryOp, specs: list[ArraySpec], params: Params) -> list[ArraySpec]:
    dtype, shape = specs[0]
    batch, m, n = _matrices(op.name, shape)
    k = m if params["mode"] == "complete" else min(m, n)
    return [(dtype, (*batch, m, k)), (dtype, (*batch, k, n))]


def _svd(op: LibraryOp, specs: list[ArraySpec], params: Params) -> list[ArraySpec]:
    dtype, shape = specs[0]
    batch, m, n = _matrices(op.name, shape)
    k = min(m, n)
    if params["full_matrices"]:
        return [(dtype, (*batch, m, m)), (_REAL_OF[dtype], (*batch, k)), (dtype, (*batch, n, n))]
    return [(dtype, (*batch, m, k)), (_REAL_OF[dtype], (*batch, k)), (dtype, (*batch, k, n))]


def _svdvals(op: LibraryOp, specs: list[ArraySpec], params: Params) -> list[ArraySpec]:
    dtype, shape = specs[0]
    batch, m, n = _matrices(op.name, shape)
    return [(_REAL_OF[dtype], (*batch, min(m, n)))]


def _matrix_rank(op: LibraryOp, specs: list[ArraySpec], params: Params) -> list[ArraySpec]:
    _, shape = specs[0]
    batch, _, _ = _matrices(op.name, shape)
    return [("int64", batch)]


def _solve(op: LibraryOp, specs: list[ArraySpec], params: Params) -> list[ArraySpec]:
    # The standard (2024.12): x2 is a vector only when it is 1-d; otherwise a stack of (M, K) matrices whose batch
    # broadcasts against x1's.
    dtype = _same_dtypes(op.name, specs)
    (_, a), (_, b) = specs
    batch, m, _ = _matrices(op.name, a, square=True)
    if len(b) == 1:
        if b[0] != m:
            raise InvalidArgument(f"{op.name}: x2 of shape {b} does not match x1 of shape {a} (needs ({m},))")
        return [(dtype, a[:-1])]
    if len(b) == 0 or b[-2] != m:
        raise InvalidArgument(f"{op.name}: x2 of shape {b} must be ({m},) or (..., {m}, K) for x1 of shape {a}")
    return [(dtype, _broadcast(op.name, batch, b[:-2]) + b[-2:])]


def fft_length(op: str, shape: Shape, params: Params) -> tuple[int, int]:
    """A one-dimensional transform's (axis, n): the axis made non-negative and the transform's length ``n``
    (given, or the default for the op), refused where the standard leaves no transform."""
    if len(shape) == 0:
        raise InvalidArgument(f"{op}: x must have at least 1 dimension")
    axis = _axis(op, params["axis"], len(shape))
    n = params["n"]
    if n is None:
        m = shape[axis]
        n = 2 * (m - 1) if op in ("fft.irfft", "fft.hfft") else m
        if n < 1:
            raise InvalidArgument(f"{op}: an input of {m} element(s) along axis {axis} leaves no transform; "
                                  "give n")
    assert type(n) is int
    return axis, n


def _fft(op: LibraryOp, specs: list[ArraySpec], params: Params) -> list[ArraySpec]:
    dtype, shape = specs[0]
    axis, n = fft_length(op.name, shape, params)
    out_length = n // 2 + 1 if op.name in ("fft.rfft", "fft.ihfft") else n
    out_dtype = _REAL_OF[dtype] if op.name in ("fft.irfft", "fft.hfft") else _COMPLEX_OF[dtype]
    return [(out_dtype, (*shape[:axis], out_length, *shape[axis + 1:]))]


def fftn_plan(op: str, shape: Shape, params: Params) -> tuple[list[int], list[int]]:
    """An n-dimensional transform's (s, axes), both resolved: axes non-negative and unique, s the length of each
    (a -1 or a missing s taken from the input, or for ``irfftn``'s last axis ``2 * (m - 1)``)."""
    ndim = len(shape)
    s, axes = params["s"], params["axes"]
    assert s is None or isinstance(s, list)
    assert axes is None or isinstance(axes, list)
    if ndim == 0:
        raise InvalidArgument(f"{op}: x must have at least 1 dimension")
    if axes is None:
        count = ndim if s is None else len(s)
        if count > ndim:
            raise InvalidArgument(f"{op}: s has {count} entries, more than x's {ndim} dimension(s)")
        axes = list(range(ndim - count, ndim))
    else:
        axes = [_axis(op, a, ndim, "axes entry") for a in axes]
        if len(set(axes)) != len(axes):
            raise InvalidArgument(f"{op}: axes {params['axes']} repeat an axis")
        if s is not None and len(s) != len(axes):
            raise InvalidArgument(f"{op}: s has {len(s)} entries and axes {len(axes)}; they must be as many")
    if not axes:
        raise InvalidArgument(f"{op}: transforms no axis")
    lengths: list[int] = []
    for i, axis in enumerate(axes):
        length = -1 if s is None else s[i]
        if length == -1:
            m = shape[axis]
            length = 2 * (m - 1) if op == "fft.irfftn" and i == len(axes) - 1 else m
            if length < 1:
                raise InvalidArgument(f"{op}: an input of {m} element(s) along axis {axis} leaves no transform; "
                                      "give s")
        elif length < 1:
            raise InvalidArgument(f"{op}: s entries must be >= 1 or -1, got {s}")
        lengths.append(length)
    return lengths, axes


def _fftn(op: LibraryOp, specs: list[ArraySpec], params: Params) -> list[ArraySpec]:
    dtype, shape = specs[0]
    lengths, axes = fftn_plan(op.name, shape, params)
    out = list(shape)
    for axis, length in zip(axes, lengths, strict=True):
        out[axis] = length
    if op.name == "fft.rfftn":
        out[axes[-1]] = lengths[-1] // 2 + 1
    out_dtype = _REAL_OF[dtype] if op.name == "fft.irfftn" else _COMPLEX_OF[dtype]
    return [(out_dtype, tuple(out))]


def _sort(op: LibraryOp, specs: list[ArraySpec], params: Params) -> list[ArraySpec]:
    dtype, shape = specs[0]
    if len(shape) == 0:
        raise InvalidArgument(f"{op.name}: x must have at least 1 dimension")
    _axis(op.name, params["axis"], len(shape))
    return [("int64" if op.name == "argsort" else dtype, shape)]


def _searchsorted(op: LibraryOp, specs: list[ArraySpec], params: Params) -> list[ArraySpec]:
    _same_dtypes(op.name, specs)
    (_, sorted_shape), (_, shape) = specs
    if len(sorted_shape) != 1:
        raise InvalidArgument(f"{op.name}: x1 must be 1-d, got shape {sorted_shape}")
    return [("int64", shape)]


def _cumulative(op: LibraryOp, specs: list[ArraySpec], params: Params) -> list[ArraySpec]:
    dtype, shape = specs[0]
    if len(shape) == 0:
        raise InvalidArgument(f"{op.name}: x must have at least 1 dimension")
    axis = params["axis"]
    if axis is None:
        if len(shape) != 1:
            raise InvalidArgument(f"{op.name}: axis is required for an array of {len(shape)} dimensions")
        axis = 0
    axis = _axis(op.name, axis, len(shape))
    out_dtype = params["dtype"]
    if out_dtype is None:
        out_dtype = _ACCUMULATE_DEFAULT.get(dtype, dtype)
    assert type(out_dtype) is str
    if dtype in COMPLEX_FLOATING and out_dtype not in COMPLEX_FLOATING:
        raise InvalidArgument(f"{op.name}: a complex input cannot accumulate in {out_dtype}")
    extra = 1 if params["include_initial"] else 0
    return [(out_dtype, (*shape[:axis], shape[axis] + extra, *shape[axis + 1:]))]


def _count_unique(op: LibraryOp, specs: list[ArraySpec], params: Params) -> list[ArraySpec]:
    return [("int64", ())]


def _unique(op: LibraryOp, specs: list[ArraySpec], params: Params) -> list[ArraySpec]:
    dtype, shape = specs[0]
    size = math.prod(shape)
    count = _count(op.name, params, size)
    if (size > 0) != (count > 0):
        raise InvalidArgument(f"{op.name}: count {count} is impossible for {size} element(s)")
    values = (dtype, (count,))
    indices = ("int64", (count,))
    inverse = ("int64", shape)
    if op.name == "unique_all":
        return [values, indices, inverse, indices]
    if op.name == "unique_counts":
        return [values, indices]
    if op.name == "unique_inverse":
        return [values, inverse]
    return [values]


def _nonzero(op: LibraryOp, specs: list[ArraySpec], params: Params) -> list[ArraySpec]:
    _, shape = specs[0]
    if len(shape) == 0:
        raise InvalidArgument(f"{op.name}: x must have at least 1 dimension")
    return [("int64", (len(shape), _count(op.name, params, math.prod(shape))))]


def _compress(op: LibraryOp, specs: list[ArraySpec], params: Params) -> list[ArraySpec]:
    # x[mask]: the mask covers x's leading dimensions (all of them, usually); the result is the selected
    # elements (or sub-arrays) in row-major order.
    (dtype, shape), (mask_dtype, mask_shape) = specs
    if mask_dtype != "bool":
        raise InvalidArgument(f"{op.name}: the mask must be bool, got {mask_dtype}")
    if shape[:len(mask_shape)] != mask_shape:
        raise InvalidArgument(f"{op.name}: mask of shape {mask_shape} does not match x of shape {shape}")
    count = _count(op.name, params, math.prod(mask_shape))
    return [(dtype, (count, *shape[len(mask_shape):]))]


# -- the table -------------------------------------------------------------------------------------
_NORM = Param("str", "backward", choices=("backward", "ortho", "forward"))
_FFT_PARAMS = {"n": Param("int", None, nullable=True, minimum=1), "axis": Param("int", -1), "norm": _NORM}
_FFTN_PARAMS = {"s": Param("ints", None, nullable=True, minimum=-1), "axes": Param("ints", None, nullable=True),
                "norm": _NORM}
_SORT_PARAMS = {"axis": Param("int", -1), "descending": Param("bool", False), "stable": Param("bool", True)}
_ACCUMULATE_PARAMS = {"axis": Param("int", None, nullable=True), "include_initial": Param("bool", False),
                      "dtype": Param("dtype", None, nullable=True, choices=NUMERIC)}
_RTOL = {"rtol": Param("float", None, nullable=True, minimum=0)}
_COUNT = {"count": Param("int", minimum=0, required=True)}


def _table(*ops: LibraryOp) -> dict[str, LibraryOp]:
    return {op.name: op for op in ops}


LIBRARY_OPS: Final[Mapping[str, LibraryOp]] = _table(
    LibraryOp("matmul", 2, 1, NUMERIC, _matmul),
    LibraryOp("linalg.cholesky", 1, 1, FLOATING, _square_same, {"upper": Param("bool", False)}),
    LibraryOp("linalg.det", 1, 1, FLOATING, _det),
    LibraryOp("linalg.eigh", 1, 2, FLOATING, _eigh),
    LibraryOp("linalg.eigvalsh", 1, 1, FLOATING, _eigvalsh),
    LibraryOp("linalg.inv", 1, 1, FLOATING, _square_same),
    LibraryOp("linalg.pinv", 1, 1, FLOATING, _pinv, _RTOL),
    LibraryOp("linalg.qr", 1, 2, FLOATING, _qr,
              {"mode": Param("str", "reduced", choices=("reduced", "complete"))}),
    LibraryOp("linalg.slogdet", 1, 2, FLOATING, _slogdet),
    LibraryOp("linalg.solve", 2, 1, FLOATING, _solve),
    LibraryOp("linalg.svd", 1, 3, FLOATING, _svd, {"full_matrices": Param("bool", True)}),
    LibraryOp("linalg.svdvals", 1, 1, FLOATING, _svdvals),
    LibraryOp("linalg.matrix_rank", 1, 1, FLOATING, _matrix_rank, _RTOL),
    LibraryOp("fft.fft", 1, 1, COMPLEX_FLOATING, _fft, _FFT_PARAMS),
    LibraryOp("fft.ifft", 1, 1, COMPLEX_FLOATING, _fft, _FFT_PARAMS),
    LibraryOp("fft.rfft", 1, 1, REAL_FLOATING, _fft, _FFT_PARAMS),
    LibraryOp("fft.irfft", 1, 1, COMPLEX_FLOATING, _fft, _FFT_PARAMS),
    LibraryOp("fft.hfft", 1, 1, COMPLEX_FLOATING, _fft, _FFT_PARAMS),
    LibraryOp("fft.ihfft", 1, 1, REAL_FLOATING, _fft, _FFT_PARAMS),
    LibraryOp("fft.fftn", 1, 1, COMPLEX_FLOATING, _fftn, _FFTN_PARAMS),
    LibraryOp("fft.ifftn", 1, 1, COMPLEX_FLOATING, _fftn, _FFTN_PARAMS),
    LibraryOp("fft.rfftn", 1, 1, REAL_FLOATING, _fftn, _FFTN_PARAMS),
    LibraryOp("fft.irfftn", 1, 1, COMPLEX_FLOATING, _fftn, _FFTN_PARAMS),
    LibraryOp("sort", 1, 1, BOOL + REAL, _sort, _SORT_PARAMS),
    LibraryOp("argsort", 1, 1, BOOL + REAL, _sort, _SORT_PARAMS),
    LibraryOp("searchsorted", 2, 1, REAL, _searchsorted,
              {"side": Param("str", "left", choices=("left", "right"))}),
    LibraryOp("cumulative_sum", 1, 1, BOOL + NUMERIC, _cumulative, _ACCUMULATE_PARAMS),
    LibraryOp("cumulative_prod", 1, 1, BOOL + NUMERIC, _cumulative, _ACCUMULATE_PARAMS),
    LibraryOp("count_unique", 1, 1, ALL_DTYPES, _count_unique),
    LibraryOp("unique_all", 1, 4, ALL_DTYPES, _unique, _COUNT),
    LibraryOp("unique_counts", 1, 2, ALL_DTYPES, _unique, _COUNT),
    LibraryOp("unique_inverse", 1, 2, ALL_DTYPES, _unique, _COUNT),
    LibraryOp("unique_values", 1, 1, ALL_DTYPES, _unique, _COUNT),
    LibraryOp("nonzero", 1, 1, ALL_DTYPES, _nonzero, _COUNT),
    LibraryOp("compress", 2, 1, ALL_DTYPES, _compress, _COUNT),
)
"""The library operations [`run_library`][gpubroker.client.GpuCompute.run_library] runs, by name.

Each entry (a `LibraryOp`) says what the op takes: `inputs` and `outputs` (how many arrays), `dtypes` (what its
first input may be: NumPy dtype names) and `params` (each a `Param`: its kind, default, and the strings or least
value it allows). The names and semantics are NumPy's and the Array API standard's: `matmul`, `linalg.*`,
`fft.*`, sorting, searching, cumulative sums and products, `unique_*`, `nonzero`. Ops whose result size depends
on the data (`unique_*`, `nonzero`, `compress`) take that size as the param `count`, learned first (`count_unique`,
a count of nonzero elements). [`library_outputs`][gpubroker.client.library_outputs] gives the outputs to allocate.
The table is read-only, and the same in the client and the worker.
"""


def library_op(op: object) -> LibraryOp:
    """The table's entry for ``op``; InvalidArgument for an unknown one."""
    entry = LIBRARY_OPS.get(op) if type(op) is str else None
    if entry is None:
        shown = op[:40] if isinstance(op, str) else f"of type {type(op).__name__}"
        raise InvalidArgument(f"unknown library op {shown!r}; known: {', '.join(LIBRARY_OPS)}")
    return entry


def check_library_params(op: str, params: Mapping[str, object] | None) -> Params:
    """``op``'s params checked, defaults filled in (what the implementations are given)."""
    return library_op(op).check_params(params)


def library_outputs(op: str, inputs: Sequence[tuple[str, Sequence[int]]],
                    params: Mapping[str, object] | None = None) -> list[ArraySpec]:
    """The (dtype, shape) of each output ``op`` writes for ``inputs`` (each a (dtype, shape)) and ``params``.

    The caller allocates exactly these (C-contiguous) and passes them to ``GpuCompute.run_library``; the worker
    refuses any other. Pure: it asks no device.

    Args:
        op: The operation's name, a key of [`LIBRARY_OPS`][gpubroker.client.LIBRARY_OPS].
        inputs: Each input's NumPy dtype name and shape, such as `[("float32", (64, 32)), ("float32", (32, 8))]`.
        params: The op's parameters; missing ones take their defaults.

    Returns:
        Each output's dtype name and shape, in the order `run_library` takes them.

    Raises:
        InvalidArgument: naming the op: an unknown op or param, a wrong number of inputs, a dtype the op does not
            take, a shape it cannot work on, or a param out of range.
    """
    # The table is pure: a loop calling one op on the same shapes (a matmul per step) asks it once. Checked on both
    # sides of every call, it was most of a small library call's cost.
    key = _outputs_key(op, inputs, params)
    known = _OUTPUTS_SEEN.get(key) if key is not None else None
    if known is not None:
        return list(known)
    entry = library_op(op)
    outputs = entry.outputs_for(inputs, entry.check_params(params))
    if key is not None:
        _remember(_OUTPUTS_SEEN, key, tuple(outputs))
    return outputs


# What library_outputs answered, by ``_outputs_key``.
_OUTPUTS_SEEN: dict[tuple[object, ...], tuple[ArraySpec, ...]] = {}
_SEEN_MAX: Final = 1024


def _remember(seen: dict[Any, Any], key: tuple[object, ...], value: object) -> None:
    if len(seen) >= _SEEN_MAX:
        seen.clear()
    seen[key] = value


def _plain_spec(dtype: object, shape: object) -> ArraySpec | None:
    """(dtype, shape) as a key where both are of the plain types the wire carries (a str, a tuple or list of
    ints: True is not 1), else None."""
    if type(dtype) is not str or (type(shape) is not tuple and type(shape) is not list):
        return None
    for extent in shape:
        if type(extent) is not int:
            return None
    return dtype, tuple(shape)


def _params_key(params: object) -> tuple[object, ...] | None:
    """The params as a key, each value with its type (True is not 1), or None where they are not a plain dict."""
    if params is None:
        return ()
    if type(params) is not dict:
        return None
    return tuple((name, type(value), value) for name, value in params.items())


def _hashable(key: tuple[object, ...]) -> tuple[object, ...] | None:
    try:
        hash(key)
    except TypeError:  # (a param holding a list)
        return None
    return key


def _outputs_key(op: object, inputs: object, params: object) -> tuple[object, ...] | None:
    """(op, each input's (dtype, shape), the params with their types), or None where anything is not plain."""
    if type(inputs) is not list and type(inputs) is not tuple:
        return None
    specs = []
    for item in inputs:
        if (type(item) is not tuple and type(item) is not list) or len(item) != 2:
            return None
        spec = _plain_spec(item[0], item[1])
        if spec is None:
            return None
        specs.append(spec)
    given = _params_key(params)
    return None if given is None else _hashable((op, tuple(specs), given))


def check_library_call(op: object, inputs: object, outputs: object, params: Mapping[str, object] | None,
                       resolve: Callable[[Buffer], Buffer] | None = None
                       ) -> tuple[list[ArrayRef], list[ArrayRef], Params]:
    """Everything about a call that does not need the data: the op and its params, each array a well-formed
    ArrayRef inside its allocation (``resolve`` gives a buffer view sized to the real allocation), the outputs
    exactly what ``library_outputs`` says. Returns the arrays on resolved buffers and the checked params."""
    entry = library_op(op)
    name = entry.name
    key = _call_key(name, inputs, outputs, params)
    if key is not None and (known := _CALLS_SEEN.get(key)) is not None:
        # The same dtypes, shapes and params passed before: only the buffers are new, and each array must lie in
        # its own (as the full check's _placed says; the names for its message are made only for a failure).
        checked, sizes = known
        given = [*cast("Sequence[ArrayRef]", inputs), *cast("Sequence[ArrayRef]", outputs)]  # (so _call_key found)
        placed: list[ArrayRef] = []
        for i, (ref, (dtype, shape), nbytes) in enumerate(zip(given, key[1] + key[2], sizes, strict=True)):
            buffer = ref.buffer
            if not isinstance(buffer, Buffer):
                raise InvalidArgument(f"{name}: {_what(i, len(key[1]))} must be an ArrayRef, got {type(ref).__name__}")
            if resolve is not None:
                buffer = resolve(buffer)
            if type(buffer.offset) is not int or type(buffer.size) is not int \
                    or not 0 <= buffer.offset <= buffer.size - nbytes:
                placed.append(_placed(name, _what(i, len(key[1])), buffer, dtype, shape, nbytes, None))  # (raises)
            elif buffer is ref.buffer and type(ref.shape) is tuple:
                placed.append(ref)  # (making a frozen dataclass anew costs a microsecond)
            else:
                placed.append(ArrayRef(buffer, dtype, shape))
        n_in = len(key[1])
        return placed[:n_in], placed[n_in:], dict(checked)
    checked = entry.check_params(params)
    resolved: list[list[ArrayRef]] = []
    for what, refs in (("inputs", inputs), ("outputs", outputs)):
        if isinstance(refs, (str, bytes)) or not isinstance(refs, Sequence):
            raise InvalidArgument(f"{name}: {what} must be a sequence of ArrayRef")
        out: list[ArrayRef] = []
        for i, ref in enumerate(refs):
            if not isinstance(ref, ArrayRef) or not isinstance(ref.buffer, Buffer):
                raise InvalidArgument(f"{name}: {what}[{i}] must be an ArrayRef, got {type(ref).__name__}")
            out.append(_fits(name, f"{what}[{i}]", ref, resolve))
        resolved.append(out)
    ins, outs = resolved
    expected = entry.outputs_for([(r.dtype, r.shape) for r in ins], checked)
    if len(outs) != len(expected):
        raise InvalidArgument(f"{name}: writes {len(expected)} output(s), got {len(outs)}")
    for i, (ref, (dtype, shape)) in enumerate(zip(outs, expected, strict=True)):
        if ref.dtype != dtype or tuple(ref.shape) != shape:
            raise InvalidArgument(f"{name}: output {i} must be {dtype} of shape {shape}, got {ref.dtype} of shape "
                                  f"{tuple(ref.shape)}")
    if key is not None:
        sizes = tuple(math.prod(r.shape) * _ITEMSIZE[r.dtype] for r in (*ins, *outs))
        _remember(_CALLS_SEEN, key, (dict(checked), sizes))
    return ins, outs, checked


# Calls whose op, dtypes, shapes and params passed every check (by ``_call_key``), with their checked params and
# each array's bytes: a loop calling one op on the same shapes (a matmul per step) checks only that each array
# lies in its buffer (``_placed``, as the full check does). Checked on both sides of every call, the whole check
# was most of a small call's host cost.
_CALLS_SEEN: dict[tuple[Any, ...], tuple[Params, tuple[int, ...]]] = {}


def _call_key(op: str, inputs: object, outputs: object, params: object) -> tuple[Any, ...] | None:
    """(op, each input's and each output's (dtype, shape), the params with their types: True is not 1), or None
    where anything is not of the plain types the wire carries (str dtypes, int extents, a dict of hashable
    params): those take the full check."""
    groups: list[tuple[ArraySpec, ...]] = []
    for refs in (inputs, outputs):
        if type(refs) is not list and type(refs) is not tuple:
            return None
        group = []
        for ref in refs:
            if type(ref) is not ArrayRef:
                return None
            spec = _plain_spec(ref.dtype, ref.shape)  # (a list, as msgpack gives it, or anything a caller passed)
            if spec is None:
                return None
            group.append(spec)
        groups.append(tuple(group))
    given = _params_key(params)
    return None if given is None else _hashable((op, groups[0], groups[1], given))


def _what(index: int, inputs: int) -> str:
    """How a check's message names the array at ``index`` of a call's inputs then outputs."""
    return f"inputs[{index}]" if index < inputs else f"outputs[{index - inputs}]"


def _fits(op: str, what: str, ref: ArrayRef, resolve: Callable[[Buffer], Buffer] | None) -> ArrayRef:
    dtype: object = ref.dtype
    if isinstance(dtype, np.dtype):
        dtype = dtype.name
    if type(dtype) is not str or dtype not in ALL_DTYPES:
        raise InvalidArgument(f"{op}: {what} has an unknown dtype {str(dtype)[:40]!r}")
    shape = check_shape(op, what, ref.shape)
    return _placed(op, what, ref.buffer, dtype, shape, math.prod(shape) * _ITEMSIZE[dtype], resolve)


def _placed(op: str, what: str, buffer: Buffer, dtype: str, shape: Shape, nbytes: int,
            resolve: Callable[[Buffer], Buffer] | None) -> ArrayRef:
    """The array of ``nbytes`` on its buffer view (``resolve``d), which must be well formed and hold it."""
    if resolve is not None:
        buffer = resolve(buffer)
    if type(buffer.offset) is not int or type(buffer.size) is not int or buffer.offset < 0:
        raise InvalidArgument(f"{op}: {what} has a malformed buffer view ({buffer.offset!r} into {buffer.size!r})")
    if buffer.offset + nbytes > buffer.size:
        raise InvalidArgument(f"{op}: {what} ({dtype} of shape {shape}, {nbytes} bytes from offset "
                              f"{buffer.offset}) overruns its {buffer.size}-byte buffer")
    return ArrayRef(buffer, dtype, shape)
