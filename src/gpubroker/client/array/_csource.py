"""The C of the generated kernels: the dtypes' C type names, conversions between them, the files of ``csrc/`` and a
source's assembly.

``csrc/`` holds every line of C the generators emit as is: the prelude that makes one source both CUDA C and
OpenCL C (``prelude.h``), the helper functions of each real, integer and complex type (``real.h``, ``integer.h``,
``complex.h``, written once with one-letter type names that ``helpers`` replaces), and the kernel families'
templates (``*.c.in``: ``string.Template`` text that ``_kernel_source`` fills in). A source is the prelude, the
helpers its kernel names (directly or through other helpers) and the kernel.
"""

from __future__ import annotations

import re
from importlib import resources
from string import Template
from typing import Any, Final

import numpy as np

__all__ = ["FP64", "PRELUDE", "UNSIGNED", "REAL_OF", "cast", "ctype", "source", "template"]

# -- C types ---------------------------------------------------------------------------------------------------
_CTYPE: Final = {"b": "U8", "i1": "I8", "i2": "I16", "i4": "I32", "i8": "I64", "u1": "U8", "u2": "U16",
                 "u4": "U32", "u8": "U64", "f4": "F32", "f8": "F64", "c8": "C64", "c16": "C128"}
UNSIGNED: Final = {"I8": "U8", "I16": "U16", "I32": "U32", "I64": "U64", "U8": "U8", "U16": "U16", "U32": "U32",
                   "U64": "U64"}
REAL_OF: Final = {"C64": "F32", "C128": "F64"}


def ctype(dtype: np.dtype[Any]) -> str:
    """The prelude's macro for a dtype's C type (bool is stored as an unsigned char holding 0 or 1)."""
    return _CTYPE["b" if dtype.kind == "b" else f"{dtype.kind}{dtype.itemsize}"]


def cast(src: np.dtype[Any], dst: np.dtype[Any], expr: str) -> str:
    """C for ``expr`` (a value of ``src``) converted to ``dst`` as ``astype`` converts (complex to real keeps the
    real part; anything to bool is ``!= 0``)."""
    if src == dst:
        return expr
    d = ctype(dst)
    if dst.kind == "b":
        if src.kind == "c":
            return f"(U8)(({expr}).re != 0 || ({expr}).im != 0)"
        return f"(U8)(({expr}) != 0)"
    if dst.kind == "c":
        r = REAL_OF[d]
        if src.kind == "c":
            return f"{d}_make(({r})({expr}).re, ({r})({expr}).im)"
        return f"{d}_make(({r})({expr}), ({r})0)"
    if src.kind == "c":
        return f"({d})(({expr}).re)"
    return f"({d})({expr})"


# -- the files of csrc/ ----------------------------------------------------------------------------------------
_PACKAGE: Final = __name__.rpartition(".")[0]  # gpubroker.client.array: csrc/ is beside this module

def _read(name: str) -> str:
    """A file of csrc/ without its leading ``//`` lines (they describe the file; compilers never see them)."""
    lines = (resources.files(_PACKAGE) / "csrc" / name).read_text(encoding="utf-8").split("\n")
    start = 0
    while start < len(lines) and lines[start].startswith("//"):
        start += 1
    return "\n".join(lines[start:])


def template(name: str) -> Template:
    """A kernel family's template (``csrc/<name>.in``), its ``${...}`` filled in by ``_kernel_source``."""
    return Template(_read(f"{name}.in"))


PRELUDE: Final = _read("prelude.h")
FP64: Final = _read("fp64.h")

_TOKEN = re.compile(r"\b([RTUC])(?=\b|_)")


def _functions(text: str, names: dict[str, str]) -> list[tuple[str, str]]:
    """(name, text) of each top-level definition in a helpers file, its one-letter type names (R real, T integer,
    U unsigned, C complex) replaced, in order."""
    text = _TOKEN.sub(lambda m: names[m.group(1)], text)
    out = []
    for part in re.split(r"\n(?=FN |typedef )", text.strip("\n")):
        match = re.search(r"(\w+)\s*\(", part) if part.startswith("FN ") else re.search(r"}\s*(\w+);", part)
        assert match is not None
        out.append((match.group(1), part + "\n"))
    return out


def _helper_table() -> dict[str, list[tuple[str, str]]]:
    real, integer, complex_ = _read("real.h"), _read("integer.h"), _read("complex.h")
    table: dict[str, list[tuple[str, str]]] = {}
    for t in ("F32", "F64"):
        table[t] = _functions(real, {"R": t})
    for t in ("I8", "I16", "I32", "I64", "U8", "U16", "U32", "U64"):
        table[t] = _functions(integer, {"T": t, "U": UNSIGNED[t]})
    for c in ("C64", "C128"):
        table[c] = _functions(complex_, {"C": c, "R": REAL_OF[c]})
    return table


_HELPERS: Final = _helper_table()
_TYPES: Final = ("F32", "F64", "I8", "I16", "I32", "I64", "U8", "U16", "U32", "U64", "C64", "C128")
_WORD = re.compile(r"\w+")


def source(types: set[str], body: str) -> str:
    """The prelude, the helpers of ``types`` that ``body`` uses (directly or through other helpers), and ``body``;
    with the fp64 extension first where a type needs double precision."""
    fp64 = FP64 if types & {"F64", "C128"} else ""
    helpers = [item for t in _TYPES if t in types for item in _HELPERS[t]]
    used = set(_WORD.findall(body))
    while True:  # a helper is kept if the body or a kept helper names it
        grown = used | {w for name, text in helpers if name in used for w in _WORD.findall(text)}
        if grown == used:
            break
        used = grown
    return fp64 + PRELUDE + "".join(text for name, text in helpers if name in used) + body
