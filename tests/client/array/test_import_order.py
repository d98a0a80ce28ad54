"""The modules of ``client/array`` import one another in one order, lowest first (the package's docstring names it):
at the top of each module, never inside a function, and never in a circle. A module that needs one above it takes
what it needs as a value instead (the array's operators: ``_array.install_operators``)."""

from __future__ import annotations

import ast
import graphlib
from pathlib import Path

import gpubroker.client.array as package

ROOT = Path(package.__file__).parent


def _modules() -> dict[str, ast.Module]:
    return {path.stem: ast.parse(path.read_text(encoding="utf-8")) for path in sorted(ROOT.glob("*.py"))}


def test_no_module_imports_inside_a_function() -> None:
    late = [f"{name}:{node.lineno}" for name, tree in _modules().items() for fn in ast.walk(tree)
            if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef)
            for node in ast.walk(fn) if isinstance(node, ast.Import | ast.ImportFrom)]
    assert not late, f"imports inside functions: {late}"


def test_the_modules_import_one_another_without_a_circle() -> None:
    graph: dict[str, set[str]] = {}
    for name, tree in _modules().items():
        graph[name] = set()
        for node in tree.body:
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                graph[name] |= {node.module} if node.module else {alias.name for alias in node.names}
            assert not (isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)), \
                f"{name} imports under TYPE_CHECKING: import it at the top, or it is above {name}"
    order = list(graphlib.TopologicalSorter(graph).static_order())  # CycleError names a circle
    assert order.index("_array") < order.index("_elementwise") < order.index("_namespace")
