"""The package layout states the dependency rule: these tests hold it (docs/architecture/index.md).

- import-linter's contracts (``[tool.importlinter]``, run by ``./dev test``) hold, and fail when a forbidden import
  is added;
- no module imports a private module (``_name``) of another package;
- setuptools finds the packages by itself (no package map), and the benchmarks are not in the wheel.
"""

from __future__ import annotations

import ast
import email
import re
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


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> zipfile.ZipFile:
    """The wheel built from the work tree's tracked and untracked (not ignored) files, as a user's pip builds it."""
    tmp_path = tmp_path_factory.mktemp("wheel")
    source = tmp_path / "source"
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True,
                           text=True, check=True).stdout.split()
    for name in files:
        if (ROOT / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, source / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(tmp_path / "dist"), str(source)], check=True, capture_output=True, timeout=300)
    (path,) = (tmp_path / "dist").glob("gpubroker-*.whl")
    return zipfile.ZipFile(path)


def test_setuptools_finds_the_packages_and_the_wheel_holds_no_benchmarks(wheel: zipfile.ZipFile) -> None:
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert "package-dir" not in pyproject
    names = wheel.namelist()
    for expected in ("gpubroker/wire/commands.py", "gpubroker/client/array/__init__.py",
                     "gpubroker/broker/front/_server.py", "gpubroker/broker/worker/__main__.py",
                     "gpubroker/v1/broker.proto", "gpubroker/v1/broker_pb2.pyi", "gpubroker/loadtest/__init__.py",
                     "gpubroker/client/array/csrc/prelude.h", "gpubroker/client/array/csrc/reduce.c.in"):
        assert expected in names
    assert not [n for n in names if n.startswith(("gpubroker_bench/", "bench/", "tests/"))]


def test_the_wheel_is_typed_and_says_where_it_comes_from(wheel: zipfile.ZipFile) -> None:
    """py.typed (PEP 561: a user's type checker reads the SDK's annotations), one version (the package's own
    ``__version__``), the project's links and classifiers."""
    import gpubroker

    assert "gpubroker/py.typed" in wheel.namelist()
    (metadata_name,) = [n for n in wheel.namelist() if n.endswith(".dist-info/METADATA")]
    metadata = email.message_from_bytes(wheel.read(metadata_name))
    assert metadata["Version"] == gpubroker.__version__
    assert metadata_name == f"gpubroker-{gpubroker.__version__}.dist-info/METADATA"
    urls = dict(url.split(", ", 1) for url in metadata.get_all("Project-URL") or [])
    assert {"Homepage", "Documentation", "Source", "Issues", "Changelog"} <= set(urls), urls
    classifiers = metadata.get_all("Classifier") or []
    assert "Typing :: Typed" in classifiers
    assert any(c.startswith("Programming Language :: Python :: 3.11") for c in classifiers)


# What only the broker's processes import: a client-only install (`pip install gpubroker`) goes without them, and
# `pip install gpubroker[broker]` brings them.
BROKER_ONLY = {"cryptography", "uvloop", "prometheus-client", "tomlkit", "pyseccomp", "grpcio-reflection",
               "googleapis-common-protos"}


def test_a_client_only_install_pulls_none_of_the_brokers_dependencies(wheel: zipfile.ZipFile) -> None:
    (metadata_name,) = [n for n in wheel.namelist() if n.endswith(".dist-info/METADATA")]
    requires = email.message_from_bytes(wheel.read(metadata_name)).get_all("Requires-Dist") or []

    def name(requirement: str) -> str:
        return re.split(r"[\s<>=!~;\[]", requirement, maxsplit=1)[0].lower()

    base = {name(r) for r in requires if "extra ==" not in r}
    broker = {name(r) for r in requires if re.search(r"extra == ['\"]broker['\"]", r)}
    assert not base & BROKER_ONLY, base & BROKER_ONLY
    assert broker >= BROKER_ONLY, BROKER_ONLY - broker
    assert {"grpcio", "numpy", "protobuf", "msgspec"} <= base
    assert "msgpack" not in base | broker  # one msgpack library for the wire: msgspec's (msgpack is the tests')


# The modules of the broker's dependencies (BROKER_ONLY) and the tests' msgpack, as a fresh interpreter's finder
# refuses them: a script that starts with REFUSING runs as on a client-only install.
BLOCKED = ["cryptography", "uvloop", "prometheus_client", "tomlkit", "pyseccomp", "grpc_reflection", "msgpack",
           "google.rpc"]
REFUSING = f"""
import sys

def _blocked(name):
    return any(name == b or name.startswith(b + ".") for b in {BLOCKED!r})

class Refuse:
    def find_spec(self, name, path=None, target=None):
        if _blocked(name):
            raise ModuleNotFoundError(f"No module named {{name!r}} (blocked by tests/test_layout.py)", name=name)
        return None

sys.meta_path.insert(0, Refuse())
"""


def test_the_client_imports_none_of_the_brokers_dependencies() -> None:
    """The SDK (and its array and loadtest-free parts) imports with every broker-only module refused: a client-only
    install works. A finder on sys.meta_path refuses them, in a fresh interpreter."""
    script = REFUSING + """
import gpubroker.client
from gpubroker.client import RemoteGpu, connect, AdminClient, list_devices, TlsOptions
import gpubroker.client.array
import gpubroker.client._transports
assert callable(connect) and RemoteGpu and AdminClient and list_devices and TlsOptions
gpu = RemoteGpu("unix:/nonexistent/gpubroker.sock", "gpb_x")  # builds its channel; connects to nothing
print("ok", sorted(m for m in sys.modules if _blocked(m)))
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok []"


def test_the_cli_runs_its_client_commands_on_a_client_only_install(tmp_path: Path) -> None:
    """`gpubroker devices` and the rest that only call a broker work without the broker's dependencies; `tenant add`
    (tomlkit) says which extra to install instead of a traceback."""
    script = REFUSING + f"""
from gpubroker.broker.cli import main
assert main(["devices", "--target", "unix:{tmp_path}/none.sock", "--token", "gpb_x"]) == 1
sys.exit(main(["tenant", "add", "team-a", "--config", "{tmp_path}/gpubroker.toml"]))
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert "no broker is listening there" in result.stderr
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr
    assert "`gpubroker tenant` needs the broker's dependencies (tomlkit is not installed): pip install " \
           "'gpubroker[broker]'" in result.stderr


def test_dev_help_lists_every_command_and_nothing_else() -> None:
    """`./dev help` prints the script's own list (not its `set` line), and the list names each command it runs."""
    script = (ROOT / "dev").read_text()
    commands = set(re.findall(r"^  ([a-z-]+)\)$", script, re.MULTILINE))
    assert {"demo", "test", "bench", "docs", "gpu-wheels"} <= commands
    result = subprocess.run([str(ROOT / "dev"), "help"], capture_output=True, text=True, timeout=30, check=True)
    assert "set -" not in result.stdout and "#" not in result.stdout
    listed = set(re.findall(r"^  \./dev ([a-z-]+)", result.stdout, re.MULTILINE))
    assert listed == commands | {"help"}, listed ^ (commands | {"help"})
    assert subprocess.run([str(ROOT / "dev"), "no-such-command"], capture_output=True, timeout=30).returncode == 2


def test_a_client_only_virtualenv_installs_runs_and_type_checks(wheel: zipfile.ZipFile, tmp_path: Path) -> None:
    """`pip install gpubroker` into a fresh virtualenv, as a user's: none of the broker's dependencies come with it,
    the SDK imports, the CLI's client commands run (and the broker's say which extra they need), and mypy --strict
    there reads the package's annotations (py.typed) and catches a misspelt option."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    python = str(venv / "bin" / "python")
    # (pip's cache already holds these dependencies: ./dev test installed them a moment ago)
    installed = subprocess.run([python, "-m", "pip", "install", "-q", "--disable-pip-version-check", wheel.filename,
                                "mypy"], capture_output=True, text=True, timeout=900)
    assert installed.returncode == 0, installed.stdout + installed.stderr
    listed = subprocess.run([python, "-m", "pip", "list", "--format=freeze"], capture_output=True, text=True,
                            check=True, timeout=120).stdout.lower()
    present = {line.split("==")[0] for line in listed.splitlines()}
    assert not present & BROKER_ONLY, present & BROKER_ONLY
    cli = str(venv / "bin" / "gpubroker")
    asked = subprocess.run([cli, "devices", "--target", f"unix:{tmp_path}/none.sock", "--token", "gpb_x_y"],
                           capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert asked.returncode == 1 and "no broker is listening there" in asked.stderr, asked.stderr
    served = subprocess.run([cli, "serve", "--config", str(tmp_path / "gpubroker.toml")], capture_output=True,
                            text=True, timeout=120, cwd=tmp_path)
    assert served.returncode == 1 and "pip install 'gpubroker[broker]'" in served.stderr, served.stderr
    script = tmp_path / "user.py"
    script.write_text(
        "from gpubroker.client import connect\n"
        "gpu = connect('unix:/run/gpubroker/gpubroker.sock', token='gpb_x', async_commands=True)\n"
        "reveal_type(gpu)\n"
        "connect('unix:/run/gpubroker/gpubroker.sock', async_comands=True)\n")
    checked = subprocess.run([python, "-m", "mypy", "--strict", "--no-incremental", "--config-file", "", str(script)],
                             capture_output=True, text=True, cwd=tmp_path, timeout=600)
    out = checked.stdout + checked.stderr
    assert "py.typed" not in out and "missing library stubs" not in out, out
    assert 'Revealed type is "gpubroker.client._remote.RemoteGpu"' in out, out
    assert 'Unexpected keyword argument "async_comands" for "connect"' in out, out
