"""The reductions, declared as data as CuPy's ``ReductionKernel`` declares one: how each element is read and mapped,
how two values combine, the identity the combining starts from, and the post-map that makes the result.

One kernel family runs them all (``csrc/reduce.c.in``, filled in by ``_kernel_source.reduce_source``): a work-group
per output element accumulates its elements and combines its work-items' shares pairwise, so ``reduce`` must be
associative and ``identity`` its neutral element. Expressions are C with ``{a}`` and ``{b}`` for two values of the
accumulator's type (``{T}``; ``{U}``: its unsigned type), keyed by the accumulator's kind ("b" bool, "i" signed,
"u" unsigned, "f" real floating, "c" complex); ``{LOWEST}`` and ``{HIGHEST}`` are the type's extremes (-inf and
inf for floats).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Literal

__all__ = ["REDUCTIONS", "Reduction"]


@dataclass(frozen=True)
class Reduction:
    """One reduction over some axes of x into an output of the remaining ones."""

    accumulator: Literal["out", "x", "bool", "int64"]
    """The dtype values are combined in: the output's, x's, bool or int64."""
    reduce: dict[str, str]
    """``{a}`` and ``{b}`` combined, per kind of the accumulator."""
    identity: dict[str, str]
    """The value combining starts from, per kind of the accumulator."""
    map: str = "v"
    """Each element's value before it is combined, from ``v`` (the element read) and ``cv`` (the center, where the
    reduction takes one: sumsq's mean)."""
    read: Literal["value", "nonzero"] = "value"
    """How an element of x is read: converted to the accumulator's dtype, or as 1 where it is nonzero, else 0."""
    post_map: str = "{a}"
    """The result from the combined value ``{a}``, then converted to the output's dtype."""
    partials: str | None = None
    """The reduction that combines this one's partial values where a large reduction is split in parts (each part
    one work-group's), or None where it never splits."""
    better: Literal[">", "<"] | None = None
    """argmax and argmin: the comparison by which a value beats the best so far; the result is the best value's
    first index (C order over the reduced axes), not a value."""


def _kinds(kinds: str, expression: str) -> dict[str, str]:
    return dict.fromkeys(kinds, expression)


_WRAP_ADD: Final = "({T})(({U}){a} + ({U}){b})"  # integers wrap around like NumPy's, without signed-overflow UB
_WRAP_MUL: Final = "({T})(({U}){a} * ({U}){b})"
_ZERO: Final = _kinds("biufc", "({T})0")
_HIGHER: Final = "({b} > {a} ? {b} : {a})"
_LOWER: Final = "({b} < {a} ? {b} : {a})"

REDUCTIONS: Final[dict[str, Reduction]] = {
    "sum": Reduction("out", {"b": "{a} + {b}", "i": _WRAP_ADD, "u": _WRAP_ADD, "f": "{a} + {b}",
                             "c": "{T}_add({a}, {b})"},
                     {**_ZERO, "c": "{T}_make(0, 0)"}, partials="sum"),
    "prod": Reduction("out", {"b": "{a} * {b}", "i": _WRAP_MUL, "u": _WRAP_MUL, "f": "{a} * {b}",
                              "c": "{T}_mul({a}, {b})"},
                      {**_kinds("biufc", "({T})1"), "c": "{T}_make(1, 0)"}, partials="prod"),
    # NaN wins: once the accumulated value is NaN it stays, and a NaN element replaces any number
    "max": Reduction("x", {**_kinds("biuc", _HIGHER), "f": "((!isnan({a}) && ({b} > {a} || isnan({b}))) ? {b} : {a})"},
                     _kinds("biufc", "{LOWEST}"), partials="max"),
    "min": Reduction("x", {**_kinds("biuc", _LOWER), "f": "((!isnan({a}) && ({b} < {a} || isnan({b}))) ? {b} : {a})"},
                     _kinds("biufc", "{HIGHEST}"), partials="min"),
    "all": Reduction("bool", _kinds("biufc", "(U8)({a} && {b})"), _kinds("biufc", "(U8)1"), partials="all"),
    "any": Reduction("bool", _kinds("biufc", "(U8)({a} || {b})"), _kinds("biufc", "(U8)0"), partials="any"),
    "argmax": Reduction("x", {}, _kinds("biufc", "{LOWEST}"), better=">"),
    "argmin": Reduction("x", {}, _kinds("biufc", "{HIGHEST}"), better="<"),
    # the sum of squared deviations from a center (var's second pass, the mean its center)
    "sumsq": Reduction("out", _kinds("biufc", "{a} + {b}"), _ZERO, map="(v - cv) * (v - cv)", partials="sum"),
    # how many elements are nonzero (count_nonzero)
    "count": Reduction("int64", _kinds("biufc", "{a} + {b}"), _ZERO, read="nonzero", partials="sum"),
}
