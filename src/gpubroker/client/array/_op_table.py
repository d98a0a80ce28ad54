"""The elementwise operations: one table of C per operation and kind of dtype, from which every elementwise
function's kernel is generated (``_kernel_source.elementwise_source`` puts an operation's expression in the map
family's kernel; ``Kernels.elementwise`` launches it).

An operation is an expression, not a kernel: the loads, conversions, indexing and the store around it are the
family's. Adding one is a line here and a function in ``_elementwise`` that checks its dtypes and calls it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

import numpy as np

from gpubroker.client.array._csource import UNSIGNED, ctype

__all__ = ["ELEMENTWISE_OPS", "Op", "expression", "result_dtype"]


@dataclass(frozen=True)
class Op:
    """One elementwise operation: C per kind of its compute dtype ("b" bool, "i" signed, "u" unsigned, "f" real
    floating, "c" complex), with ``{a}``, ``{b}``, ``{c}`` for its operands (of the compute dtype, except inputs
    marked "bool" in ``args``), ``{T}`` for the compute dtype's C type, ``{U}`` its unsigned type, ``{BITS}`` its
    width. ``result``: "same" (the compute dtype), "bool" (an int 0/1) or "real" (the real type of a complex)."""

    arity: int
    code: dict[str, str]
    result: str = "same"
    args: tuple[str, ...] = ()  # per input: "T" (the compute dtype) or "bool"; empty: all "T"


def _float_fn(name: str) -> Op:
    return Op(1, {"f": f"{name}({{a}})", "c": f"{{T}}_{name}({{a}})"})


_INT_SAME = "{a}"

ELEMENTWISE_OPS: Final[dict[str, Op]] = {
    "copy": Op(1, {k: "{a}" for k in "biufc"}),
    "abs": Op(1, {"i": "({a} < 0 ? ({T})(({U})0 - ({U}){a}) : {a})", "u": "{a}", "f": "fabs({a})",
                  "c": "{T}_abs({a})"}, "real"),
    **{name: _float_fn(name) for name in ("acos", "acosh", "asin", "asinh", "atan", "atanh", "cos", "cosh", "exp",
                                          "expm1", "log", "log1p", "log2", "log10", "sin", "sinh", "sqrt", "tan",
                                          "tanh")},
    "ceil": Op(1, {"i": _INT_SAME, "u": _INT_SAME, "f": "ceil({a})"}),
    "floor": Op(1, {"i": _INT_SAME, "u": _INT_SAME, "f": "floor({a})"}),
    "trunc": Op(1, {"i": _INT_SAME, "u": _INT_SAME, "f": "trunc({a})"}),
    "round": Op(1, {"i": _INT_SAME, "u": _INT_SAME, "f": "rint({a})", "c": "{T}_round({a})"}),
    "conj": Op(1, {"i": "{a}", "u": "{a}", "f": "{a}", "c": "{T}_conj({a})"}),
    "real": Op(1, {"i": "{a}", "u": "{a}", "f": "{a}", "c": "({a}).re"}, "real"),
    "imag": Op(1, {"i": "({T})0", "u": "({T})0", "f": "({T})0", "c": "({a}).im"}, "real"),
    "isfinite": Op(1, {"b": "1", "i": "1", "u": "1", "f": "isfinite({a})", "c": "{T}_isfinite({a})"}, "bool"),
    "isinf": Op(1, {"b": "0", "i": "0", "u": "0", "f": "isinf({a})", "c": "{T}_isinf({a})"}, "bool"),
    "isnan": Op(1, {"b": "0", "i": "0", "u": "0", "f": "isnan({a})", "c": "{T}_isnan({a})"}, "bool"),
    "logical_not": Op(1, {"b": "!{a}"}, "bool"),
    "bitwise_invert": Op(1, {"b": "!{a}", "i": "~{a}", "u": "~{a}"}),
    "negative": Op(1, {"i": "({T})(({U})0 - ({U}){a})", "u": "({T})(({U})0 - {a})", "f": "-{a}",
                       "c": "{T}_neg({a})"}),
    "positive": Op(1, {k: "{a}" for k in "iufc"}),
    "reciprocal": Op(1, {"f": "(({T})1 / {a})", "c": "{T}_reciprocal({a})"}),
    "sign": Op(1, {"i": "({T})(({a} > 0) - ({a} < 0))", "u": "({T})({a} > 0)",
                   "f": "({a} > 0 ? ({T})1 : ({a} < 0 ? ({T})-1 : ({a} == 0 ? ({T})0 : {a})))",
                   "c": "{T}_sign({a})"}),
    "signbit": Op(1, {"f": "signbit({a})"}, "bool"),
    "square": Op(1, {"i": "({T})(({U}){a} * ({U}){a})", "u": "({T})({a} * {a})", "f": "({a} * {a})",
                     "c": "{T}_square({a})"}),
    "add": Op(2, {"i": "({T})(({U}){a} + ({U}){b})", "u": "({T})({a} + {b})", "f": "({a} + {b})",
                  "c": "{T}_add({a}, {b})"}),
    "subtract": Op(2, {"i": "({T})(({U}){a} - ({U}){b})", "u": "({T})({a} - {b})", "f": "({a} - {b})",
                       "c": "{T}_sub({a}, {b})"}),
    "multiply": Op(2, {"i": "({T})(({U}){a} * ({U}){b})", "u": "({T})({a} * {b})", "f": "({a} * {b})",
                       "c": "{T}_mul({a}, {b})"}),
    "divide": Op(2, {"f": "({a} / {b})", "c": "{T}_div({a}, {b})"}),
    "atan2": Op(2, {"f": "atan2({a}, {b})"}),
    "copysign": Op(2, {"f": "copysign({a}, {b})"}),
    "hypot": Op(2, {"f": "hypot({a}, {b})"}),
    "nextafter": Op(2, {"f": "nextafter({a}, {b})"}),
    "logaddexp": Op(2, {"f": "{T}_logaddexp({a}, {b})"}),
    "maximum": Op(2, {"i": "({a} > {b} ? {a} : {b})", "u": "({a} > {b} ? {a} : {b})",
                      "f": "(({a} > {b} || isnan({a})) ? {a} : {b})"}),
    "minimum": Op(2, {"i": "({a} < {b} ? {a} : {b})", "u": "({a} < {b} ? {a} : {b})",
                      "f": "(({a} < {b} || isnan({a})) ? {a} : {b})"}),
    "pow": Op(2, {"i": "{T}_pow({a}, {b})", "u": "{T}_pow({a}, {b})", "f": "pow({a}, {b})",
                  "c": "{T}_pow({a}, {b})"}),
    "floor_divide": Op(2, {k: "{T}_floordiv({a}, {b})" for k in "iuf"}),
    "remainder": Op(2, {k: "{T}_rem({a}, {b})" for k in "iuf"}),
    "equal": Op(2, {**{k: "({a} == {b})" for k in "biuf"}, "c": "{T}_eq({a}, {b})"}, "bool"),
    "not_equal": Op(2, {**{k: "({a} != {b})" for k in "biuf"}, "c": "!{T}_eq({a}, {b})"}, "bool"),
    "less": Op(2, {k: "({a} < {b})" for k in "iuf"}, "bool"),
    "less_equal": Op(2, {k: "({a} <= {b})" for k in "iuf"}, "bool"),
    "greater": Op(2, {k: "({a} > {b})" for k in "iuf"}, "bool"),
    "greater_equal": Op(2, {k: "({a} >= {b})" for k in "iuf"}, "bool"),
    "bitwise_and": Op(2, {k: "({T})({a} & {b})" for k in "biu"}),
    "bitwise_or": Op(2, {k: "({T})({a} | {b})" for k in "biu"}),
    "bitwise_xor": Op(2, {k: "({T})({a} ^ {b})" for k in "biu"}),
    "bitwise_left_shift": Op(2, {k: "((U64){b} >= {BITS} ? ({T})0 : ({T})(({U}){a} << {b}))" for k in "iu"}),
    "bitwise_right_shift": Op(2, {"i": "((U64){b} >= {BITS} ? ({T})({a} < 0 ? -1 : 0) : ({T})({a} >> {b}))",
                                  "u": "((U64){b} >= {BITS} ? ({T})0 : ({T})({a} >> {b}))"}),
    "logical_and": Op(2, {"b": "({a} && {b})"}, "bool"),
    "logical_or": Op(2, {"b": "({a} || {b})"}, "bool"),
    "logical_xor": Op(2, {"b": "(({a} != 0) != ({b} != 0))"}, "bool"),
    "where": Op(3, {k: "({a} ? {b} : {c})" for k in "biufc"}, args=("bool", "T", "T")),
    "clip": Op(3, {k: "{T}_clip({a}, {b}, {c})" for k in "iuf"}),
    "clip_min": Op(2, {"i": "({a} < {b} ? {b} : {a})", "u": "({a} < {b} ? {b} : {a})",
                       "f": "(isnan({b}) || {a} < {b} ? {b} : {a})"}),
    "clip_max": Op(2, {"i": "({a} > {b} ? {b} : {a})", "u": "({a} > {b} ? {b} : {a})",
                       "f": "(isnan({b}) || {a} > {b} ? {b} : {a})"}),
}


def result_dtype(fn: str, compute: np.dtype[Any]) -> np.dtype[Any]:
    """The dtype of ``fn``'s value computed in ``compute`` (before the store converts it to the output's)."""
    kind = ELEMENTWISE_OPS[fn].result
    if kind == "bool":
        return np.dtype(np.bool_)
    if kind == "real" and compute.kind == "c":
        return np.dtype(np.float32 if compute.itemsize == 8 else np.float64)
    return compute


def expression(fn: str, compute: np.dtype[Any], operands: Sequence[str]) -> str:
    """C for ``fn`` of ``operands`` (C expressions of the compute dtype) in ``compute``; TypeError where the table
    has no C for its kind."""
    op = ELEMENTWISE_OPS[fn]
    kind = "b" if compute.kind == "b" else compute.kind
    try:
        template = op.code[kind]
    except KeyError:
        raise TypeError(f"{fn} is not defined for {compute}") from None
    t = ctype(compute)
    return template.format(*operands, **dict(zip("abc", operands, strict=False)), T=t,
                           U=UNSIGNED.get(t, t), BITS=compute.itemsize * 8)
