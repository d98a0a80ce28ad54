"""The package layout states the dependency rule: these tests hold it (docs/architecture/index.md).

- import-linter's contracts (``[tool.importlinter]``, run by ``./dev test``) hold, and fail when a forbidden import
  is added;
- no module imports a private module (``_name``) of another package;
- setuptools finds the packages by itself (no package map), and the benchmarks are not in the wheel.
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"


def _module_name(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _package_of(path: Path) -> str:
    name = _module_name(path)
    return name if path.name == "__init__.py" else name.rpartition(".")[0]


def _private_owner(module: str) -> str | None:
    """The package whose private module ``module`` is, or None when no part of its name is private."""
    parts = module.split(".")
    for i, part in enumerate(parts):
        if part.startswith("_"):
            return ".".join(parts[:i])
    return None


def test_no_module_imports_another_packages_private_module() -> None:
    offences = []
    for path in sorted(SRC.rglob("*.py")):
        package = _package_of(path)
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            for target in targets:
                owner = _private_owner(target) if target.startswith("gpubroker.") else None
                if owner is not None and package != owner and not package.startswith(owner + "."):
                    offences.append(f"{path.relative_to(ROOT)}:{node.lineno}: {target}")
    assert not offences, "private modules imported from another package:\n" + "\n".join(offences)


def _lint_imports(src: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(LINT_IMPORTS), "--no-cache", "--config", str(ROOT / "pyproject.toml")],
                          capture_output=True, text=True, cwd=ROOT, timeout=300,
                          env={"PYTHONPATH": str(src), "PATH": "/usr/bin:/bin"})


@pytest.fixture(scope="module")
def lint_copy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of src/ that each test may break."""
    dest = tmp_path_factory.mktemp("layout") / "src"
    shutil.copytree(SRC, dest, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    return dest


def test_the_contracts_hold() -> None:
    result = _lint_imports(SRC)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


@pytest.mark.parametrize(("module", "line", "contract"), [
    ("wire/errors.py", "import gpubroker.client", "wire imports nothing else of gpubroker"),
    ("client/_remote.py", "import gpubroker.broker.front", "the client never imports the broker"),
    ("broker/worker/_handles.py", "import gpubroker.broker.front.auth", "the front and the worker speak only"),
    ("broker/backends/_common.py", "import grpc", "grpc only in the front"),
])
def test_an_injected_forbidden_import_breaks_its_contract(lint_copy: Path, module: str, line: str,
                                                          contract: str) -> None:
    path = lint_copy / "gpubroker" / module
    original = path.read_text()
    path.write_text(original + f"\n{line}  # injected by tests/test_layout.py\n")
    try:
        result = _lint_imports(lint_copy)
    finally:
        path.write_text(original)
    assert result.returncode != 0, result.stdout
    broken = result.stdout.split("Broken contracts", 1)[-1]
    assert contract in broken, result.stdout


def test_setuptools_finds_the_packages_and_the_wheel_holds_no_benchmarks(tmp_path: Path) -> None:
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert "package-dir" not in pyproject
    source = tmp_path / "source"
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True,
                           text=True, check=True).stdout.split()
    for name in files:
        if (ROOT / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, source / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(tmp_path / "dist"), str(source)], check=True, capture_output=True, timeout=300)
    (wheel,) = (tmp_path / "dist").glob("gpubroker-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    for expected in ("gpubroker/wire/commands.py", "gpubroker/client/array/__init__.py",
                     "gpubroker/broker/front/_server.py", "gpubroker/broker/worker/__main__.py",
                     "gpubroker/v1/broker.proto", "gpubroker/v1/broker_pb2.pyi", "gpubroker/loadtest/__init__.py",
                     "gpubroker/client/array/csrc/prelude.h", "gpubroker/client/array/csrc/reduce.c.in"):
        assert expected in names
    assert not [n for n in names if n.startswith(("gpubroker_bench/", "bench/", "tests/"))]
