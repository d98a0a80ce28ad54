"""Every public name of the client SDK has a docstring, and the API reference shows every one.

Read as the API reference reads them: griffe loads ``gpubroker.client`` from the package's layout
(scripts/package_tree.sh lays it under build/pkg, as ``./dev docs`` does), so module attributes (``HostBuffer``,
``LIBRARY_OPS``) count, and names the package re-exports are followed to where they are defined.

- Each name in the ``__all__`` of ``gpubroker.client``, ``gpubroker.client.array`` and ``gpubroker.client.torch``
  has a docstring, and so does each public method and property of each public class.
- Each ``GpuCompute`` method, the SDK's contract, has an ``Args:`` section naming exactly its parameters, a
  ``Returns:`` section where it returns a value, and a ``Raises:`` section (``close`` excepted: it raises nothing).
- The reference pages (docs/reference/*.md) render every public name with a ``::: gpubroker.client...`` block, and
  a block that picks its members by name leaves out no public method or property.
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import griffe
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
REFERENCE = ROOT / "docs" / "reference"
MODULES = ("gpubroker.client", "gpubroker.client.array", "gpubroker.client.torch")
NO_RAISES = {"close"}  # GpuCompute methods that raise nothing, so need no Raises: section


@cache
def _package() -> griffe.Module:
    loaded = griffe.load("gpubroker.client", search_paths=[str(ROOT / "src")], docstring_parser="google",
                         resolve_aliases=True, resolve_implicit=False)
    assert isinstance(loaded, griffe.Module)
    return loaded


def _module(path: str) -> griffe.Module:
    module: Any = _package()
    for part in path.split(".")[2:]:
        module = module.members[part]
    assert isinstance(module, griffe.Module)
    return module


def _exports(path: str) -> dict[str, griffe.Object]:
    """A module's ``__all__``: each name and the object it finally names (a re-export followed to its definition)."""
    module = _module(path)
    assert module.exports, f"{path} has no __all__"
    found: dict[str, griffe.Object] = {}
    for name in module.exports:
        name = str(name)
        member = module.members[name]
        target = member.final_target if isinstance(member, griffe.Alias) else member
        assert isinstance(target, griffe.Object), f"{path}.{name} does not resolve"
        found[name] = target
    return found


def _is_public_routine(member: griffe.Object | griffe.Alias) -> bool:
    """A public method or property defined in the class itself (inherited ones are checked where defined)."""
    if member.name.startswith("_") or isinstance(member, griffe.Alias):
        return False
    return member.is_function or (member.is_attribute and "property" in member.labels)


def _public_routines(cls: griffe.Class) -> dict[str, griffe.Object]:
    return {name: member for name, member in cls.members.items()
            if _is_public_routine(member) and isinstance(member, griffe.Object)}


def _public_objects() -> dict[str, griffe.Object]:
    """Every public name, and every public method and property of every public class, by its public path."""
    found: dict[str, griffe.Object] = {}
    for path in MODULES:
        for name, obj in _exports(path).items():
            found[f"{path}.{name}"] = obj
            if isinstance(obj, griffe.Class):
                for member_name, member in _public_routines(obj).items():
                    found[f"{path}.{name}.{member_name}"] = member
    return found


def _text(obj: griffe.Object) -> str:
    return obj.docstring.value.strip() if obj.docstring is not None else ""


def test_every_public_name_has_a_docstring() -> None:
    objects = _public_objects()
    assert "gpubroker.client.GpuCompute.allocate_memory" in objects
    assert "gpubroker.client.HostBuffer" in objects and "gpubroker.client.array.Array.shape" in objects
    missing = sorted(path for path, obj in objects.items() if not _text(obj))
    assert not missing, f"{len(missing)} of {len(objects)} public names have no docstring:\n" + "\n".join(missing)


def _sections(obj: griffe.Object) -> dict[str, griffe.DocstringSection]:
    assert obj.docstring is not None
    with _quiet_griffe():
        parsed = obj.docstring.parse("google")
    return {section.kind.value: section for section in parsed}


@contextlib.contextmanager
def _quiet_griffe() -> Iterator[None]:
    """Griffe logs what it cannot parse; the assertions below report it instead."""
    logger = logging.getLogger("griffe")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _gpucompute_methods() -> dict[str, griffe.Function]:
    cls = _exports("gpubroker.client")["GpuCompute"]
    assert isinstance(cls, griffe.Class)
    return {name: member for name, member in _public_routines(cls).items() if isinstance(member, griffe.Function)}


def test_gpucompute_methods_document_args_returns_and_raises() -> None:
    methods = _gpucompute_methods()
    assert len(methods) >= 20, sorted(methods)
    problems = []
    for name, fn in methods.items():
        if not _text(fn):
            problems.append(f"{name}: no docstring")
            continue
        sections = _sections(fn)
        params = [p.name for p in fn.parameters if p.name != "self"]
        documented = [p.name for p in sections["parameters"].value] if "parameters" in sections else []
        if params and "parameters" not in sections:
            problems.append(f"{name}: no Args: section for {params}")
        elif sorted(documented) != sorted(params):
            problems.append(f"{name}: Args: documents {documented}, the signature has {params}")
        returns = fn.returns is not None and str(fn.returns) != "None"
        if returns and "returns" not in sections:
            problems.append(f"{name}: returns {fn.returns} but has no Returns: section")
        if not returns and "returns" in sections:
            problems.append(f"{name}: returns nothing but has a Returns: section")
        if name not in NO_RAISES and "raises" not in sections:
            problems.append(f"{name}: no Raises: section")
    assert not problems, f"{len(problems)} problems in GpuCompute's docstrings:\n" + "\n".join(problems)


# -- the reference pages ------------------------------------------------------------------------------------------

_DIRECTIVE = re.compile(r"^::: (?P<path>[\w.]+)[ \t]*\n(?P<options>(?:[ \t]+.*\n|[ \t]*\n(?=[ \t]+\S))*)", re.MULTILINE)


def _directives() -> dict[str, dict[str, Any]]:
    """Each ``::: path`` block of the reference pages and its options."""
    found: dict[str, dict[str, Any]] = {}
    for page in sorted(REFERENCE.glob("*.md")):
        for match in _DIRECTIVE.finditer(page.read_text() + "\n"):
            options = yaml.safe_load(match.group("options")) if match.group("options").strip() else None
            path = match.group("path")
            assert path not in found, f"{path} is rendered twice (also in {page.name})"
            found[path] = (options or {}).get("options", {}) or {}
    return found


def test_the_reference_renders_every_public_name() -> None:
    directives = _directives()
    problems = []
    for module in MODULES:
        for name, obj in _exports(module).items():
            path = f"{module}.{name}"
            if path not in directives:
                problems.append(f"{path}: no `::: {path}` block in docs/reference/")
                continue
            members = directives[path].get("members")
            if members is False and isinstance(obj, griffe.Class) and _public_routines(obj):
                problems.append(f"{path}: `members: false` hides {sorted(_public_routines(obj))}")
            elif isinstance(members, list) and isinstance(obj, griffe.Class):
                left_out = sorted(set(_public_routines(obj)) - set(members))
                if left_out:
                    problems.append(f"{path}: its `members:` list leaves out {left_out}")
    assert not problems, "the API reference drops public names:\n" + "\n".join(problems)


@pytest.mark.parametrize("module", MODULES)
def test_all_names_exist_at_run_time(module: str) -> None:
    """What griffe read is what Python imports: every name of ``__all__`` is there (lazy ones included)."""
    imported = __import__(module, fromlist=["__all__"])
    assert sorted(imported.__all__) == sorted(_exports(module))
    for name in imported.__all__:
        assert getattr(imported, name) is not None
