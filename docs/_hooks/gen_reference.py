"""The API reference's generated parts: the library operations' table, read from ``LIBRARY_OPS`` itself."""

from __future__ import annotations

from collections.abc import Callable

from gpubroker.client import LIBRARY_OPS
from gpubroker.wire.library import (
    ALL_DTYPES,
    BOOL,
    COMPLEX_FLOATING,
    FLOATING,
    NUMERIC,
    REAL,
    REAL_FLOATING,
    Param,
)

# The op table's own dtype groups, named, largest first, so a row says "real floating" rather than listing two names.
_GROUPS = (
    ("any", ALL_DTYPES),
    ("numeric", NUMERIC),
    ("bool, real", BOOL + REAL),
    ("real", REAL),
    ("floating", FLOATING),
    ("real floating", REAL_FLOATING),
    ("complex floating", COMPLEX_FLOATING),
)


def _dtypes(dtypes: tuple[str, ...]) -> str:
    for name, group in _GROUPS:
        if set(dtypes) == set(group):
            return name
    return ", ".join(dtypes)


def _param(name: str, spec: Param) -> str:
    kind = {"ints": "list of ints"}.get(spec.kind, spec.kind)
    if spec.kind == "dtype":
        kind = f"a dtype name ({_dtypes(spec.choices)})"
    elif spec.choices:
        kind = " \\| ".join(f'"{c}"' for c in spec.choices)
    text = f"`{name}`: {kind}"
    if spec.nullable:
        text += " or None"
    if spec.minimum is not None:
        text += f", >= {spec.minimum}"
    if spec.required:
        return text + ", required"
    return text + f" (default `{spec.default!r}`)"


def library_ops() -> str:
    """A table row per op: its name, arrays in and out, the first input's dtypes, its params."""
    rows = ["| op | inputs | outputs | first input's dtypes | params |", "|---|---:|---:|---|---|"]
    for name, op in LIBRARY_OPS.items():
        params = "; ".join(_param(p, spec) for p, spec in op.params.items()) or "none"
        rows.append(f"| `{name}` | {op.inputs} | {op.outputs} | {_dtypes(op.dtypes)} | {params} |")
    return "\n".join(rows) + "\n"


GENERATED: dict[str, Callable[[], str]] = {"library-ops": library_ops}
