"""MkDocs hooks: the pages' generated parts, made from the code and bench/results at every build.

A page asks for one with a line ``<!-- generated: NAME -->``; the line is replaced by the markdown that the
generator NAME returns. Generators live in the ``gen_*.py`` modules beside this one, each exporting ``GENERATED``
(name -> function returning markdown) and optionally ``FILES`` (a function returning {site path: bytes}, files such
as plots that pages link to; they are added before the build, so links to them are checked like any other).
An unknown name fails the build, as does a generator that raises.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # mkdocs is imported where the build calls in: the tests read the generators without it
    from mkdocs.structure.files import Files

_HERE = Path(__file__).resolve().parent
_MARKER = re.compile(r"^<!-- generated: ([a-z0-9-]+) -->$", re.MULTILINE)


def load(stem: str) -> ModuleType:
    """The module docs/_hooks/STEM.py, loaded once (as ``gpubroker_docs_STEM``: the folder is no package)."""
    name = f"gpubroker_docs_{stem}"
    module = sys.modules.get(name)
    if module is None:
        spec = importlib.util.spec_from_file_location(name, _HERE / f"{stem}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return module


def _modules() -> list[ModuleType]:
    return [load(path.stem) for path in sorted(_HERE.glob("gen_*.py"))]


def generators() -> dict[str, Callable[[], str]]:
    """Every generator by name."""
    table: dict[str, Callable[[], str]] = {}
    for module in _modules():
        for name, fn in getattr(module, "GENERATED", {}).items():
            if name in table:
                raise ValueError(f"generated part {name!r} is defined twice")
            table[name] = fn
    return table


def on_files(files: Files, config: Any) -> Files:
    from mkdocs.structure.files import File

    for module in _modules():
        make = getattr(module, "FILES", None)
        if make is None:
            continue
        for path, content in make().items():
            files.append(File.generated(config, path, content=content))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    table = generators()

    def replace(match: re.Match[str]) -> str:
        name = match.group(1)
        if name not in table:
            raise ValueError(f"{page.file.src_uri}: no generated part named {name!r} (known: {sorted(table)})")
        return table[name]()

    return _MARKER.sub(replace, markdown)
