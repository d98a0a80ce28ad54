"""Best-effort kernel signatures from CUDA C source, so launches can tell pointers from scalars.

The driver (cuFuncGetParamInfo) gives only each parameter's size, and an 8-byte integer fits a
pointer's slot. When we compiled the source ourselves we can read the declaration; whatever we
cannot read with certainty (typedefs, templates, macros) stays "unknown" and is checked by size only.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["ParamKind", "param_kinds"]

_COMMENTS = re.compile(r"//[^\n]*|/\*.*?\*/", re.S)
_QUALIFIERS = {"const", "volatile", "__restrict__", "restrict", "struct", "__grid_constant__"}
_FLOATS = {"float", "double", "__half", "half", "__nv_bfloat16"}
_INTS = {"int", "unsigned", "signed", "long", "short", "char", "bool", "size_t", "ptrdiff_t", "intptr_t",
         "uintptr_t"} | {f"{u}int{b}_t" for u in ("", "u") for b in (8, 16, 32, 64)}


@dataclass(frozen=True)
class ParamKind:
    kind: str  # "pointer", "scalar" or "unknown"
    is_float: bool = False
    text: str = ""  # the declaration, for error messages


def _param_list(source: str, start: int) -> str | None:
    """The text between the '(' at ``start`` and its matching ')'."""
    depth = 0
    for i in range(start, len(source)):
        if source[i] == "(":
            depth += 1
        elif source[i] == ")":
            depth -= 1
            if depth == 0:
                return source[start + 1:i]
    return None


def _split_top_level(params: str) -> list[str]:
    parts: list[str] = []
    depth = 0
    current: list[str] = []
    for ch in params:
        if ch in "(<[":
            depth += 1
        elif ch in ")>]":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append("".join(current))
            current = []
        else:
            current.append(ch)
    parts.append("".join(current))
    return [p.strip() for p in parts]


def _kind(decl: str) -> ParamKind:
    decl = decl.split("=", 1)[0].strip()  # default arguments
    if "*" in decl or "[" in decl:
        return ParamKind("pointer", text=decl)
    words = [w for w in re.findall(r"[A-Za-z_]\w*", decl) if w not in _QUALIFIERS]
    if len(words) > 1 and words[-1] not in _FLOATS | _INTS:
        words = words[:-1]  # the parameter's name
    if words and all(w in _INTS for w in words):
        return ParamKind("scalar", False, decl)
    if len(words) == 1 and words[0] in _FLOATS:
        return ParamKind("scalar", True, decl)
    return ParamKind("unknown", text=decl)


def param_kinds(source: str, name: str, count: int) -> list[ParamKind] | None:
    """What each of kernel ``name``'s ``count`` parameters is, or None when the source is unclear."""
    text = _COMMENTS.sub(" ", source)
    pattern = re.compile(r"__global__(?:[^;{}()]|\([^()]*\))*?\b" + re.escape(name) + r"\s*\(")
    found: list[list[ParamKind]] = []
    for match in pattern.finditer(text):
        params = _param_list(text, match.end() - 1)
        if params is None:
            return None
        parts = [] if params.strip() in ("", "void") else _split_top_level(params)
        found.append([_kind(p) for p in parts])
    # Declarations and the definition must agree; #if'd variants or overloads make it unclear.
    if not found or any([k.kind for k in f] != [k.kind for k in found[0]] for f in found):
        return None
    return found[0] if len(found[0]) == count else None
