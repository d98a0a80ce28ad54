"""Every code example in the docs runs against a real broker: PoCL here (two CPU devices), CUDA on the GPU check.

One test per page that has examples: its python and bash blocks run in order in a fresh process (tests/docs/
run_page.py) in a temporary directory, with GPUBROKER_TARGET, GPUBROKER_TOKEN, GPUBROKER_ADMIN_TOKEN and
GPUBROKER_METRICS_URL set as a reader would have exported them. Blocks marked ``gpu`` run only on CUDA; blocks
marked ``skip`` never run and say why (tests/docs/pages.py). TOML blocks are read by the broker's own config parser.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpubroker.broker.config import parse_config
from gpubroker.broker.launcher import BrokerProcess, TenantSpec

from ..conftest import BACKENDS
from .pages import DOCS, REFUSED, RUN, Block, blocks, pages

PAGE_TIMEOUT = int(os.environ.get("GPUBROKER_PAGE_TIMEOUT", "900"))  # a page's examples, all together (s)
# The README's first program is an example too.
EXAMPLE_PAGES = [p for p in [*pages(), DOCS.parent / "README.md"] if any(b.lang in RUN for b in blocks(p))]
# The quickstart runs twice in one directory instead (a reader's second try must work as the first did).
QUICKSTART = DOCS / "quickstart.md"


@pytest.fixture(scope="module", params=BACKENDS)
def docs_broker(request: pytest.FixtureRequest) -> Iterator[BrokerProcess]:
    """The broker the examples talk to: a tenant with a 1 GiB quota and an admin tenant; two PoCL devices."""
    backend = str(request.param)
    # Two PoCL devices; kernels built without optimisation, as in the array tests (results unchanged, CI's cold
    # compiles several times faster).
    env = ({"POCL_DEVICES": "pthread pthread", "POCL_EXTRA_BUILD_FLAGS": "-cl-opt-disable"}
           if backend == "opencl" else {})
    tenants = [TenantSpec("docs", memory_quota=1 << 30), TenantSpec("ops", admin=True)]
    with BrokerProcess(tenants, backend=backend, env=env, settings={"metrics_listen": "127.0.0.1:0"}) as proc:
        yield proc


def test_every_block_is_well_formed() -> None:
    """Fences close, markers parse, and no example hides behind a language the runner does not run."""
    count = 0
    for page in pages():
        for block in blocks(page):
            count += 1
            assert block.lang not in REFUSED, f"{block.where}: write ```{block.lang} as ```python or ```bash"
            assert block.lang, f"{block.where}: say the block's language (```text for output)"
            if block.marker:
                assert block.lang in RUN, f"{block.where}: a docs-test marker on a {block.lang} block, which never runs"
    assert count > 0


def test_toml_blocks_are_valid_config() -> None:
    """Every TOML example is a config the broker accepts (tenant tables get a placeholder token to be whole)."""
    checked = 0
    for page in pages():
        for block in blocks(page):
            if block.lang != "toml":
                continue
            data = tomllib.loads(block.source)
            for table in data.get("tenants", {}).values():
                if isinstance(table, dict):
                    table.setdefault("token_id", "0" * 16)
                    table.setdefault("token_hash", "placeholder")
            parse_config(data, source=block.where)
            checked += 1
    assert checked > 0


def _page_id(page: Path) -> str:
    return str(page.relative_to(DOCS if page.is_relative_to(DOCS) else DOCS.parent).with_suffix(""))


@pytest.mark.timeout(PAGE_TIMEOUT)
@pytest.mark.parametrize("page", [p for p in EXAMPLE_PAGES if p != QUICKSTART], ids=_page_id)
def test_page_examples_run(page: Path, docs_broker: BrokerProcess, tmp_path: Path) -> None:
    workdir = tmp_path / "work"
    workdir.mkdir()
    _run_page(page, docs_broker, tmp_path, workdir)


@pytest.mark.timeout(2 * PAGE_TIMEOUT)
def test_the_quickstart_runs_twice_in_one_directory(docs_broker: BrokerProcess, tmp_path: Path) -> None:
    """A reader who runs the quickstart again where it ran (its config, tokens, socket and ready file are there):
    the second run works as the first (a stale --ready-file once let the wait pass before the broker served)."""
    workdir = tmp_path / "work"
    workdir.mkdir()
    _run_page(QUICKSTART, docs_broker, tmp_path / "first", workdir)
    assert (workdir / "gpubroker.toml").exists()  # (what the first run left is there for the second)
    _run_page(QUICKSTART, docs_broker, tmp_path / "second", workdir)


def _run_page(page: Path, docs_broker: BrokerProcess, tmp_path: Path, workdir: Path) -> None:
    """The page's examples in order, in ``workdir``, as a reader runs them (tests/docs/run_page.py)."""
    on_gpu = docs_broker.backend == "cuda"
    chosen: list[Block] = [b for b in blocks(page)
                           if b.lang in RUN and b.marker != "skip" and (b.marker != "gpu" or on_gpu)]
    if not chosen:
        pytest.skip("every example on this page is marked gpu (run on CUDA) or skip (with its reason)")
    tmp_path.mkdir(exist_ok=True)
    spec = tmp_path / "blocks.json"
    spec.write_text(json.dumps([{"file": str(b.page), "line": b.line, "lang": b.lang, "source": b.source,
                                 "where": b.where} for b in chosen]))
    # A reader's environment: nothing the suite's own conftest set (SCIPY_ARRAY_API) leaks into the examples.
    env = {**{k: v for k, v in os.environ.items() if k not in ("SCIPY_ARRAY_API", "GRPC_ENABLE_FORK_SUPPORT")},
           "PYTHONFAULTHANDLER": "1",  # (a page that outlives its time dumps every Python stack: below)
           "GPUBROKER_TARGET": docs_broker.target,
           "GPUBROKER_TOKEN": docs_broker.tokens["docs"],
           "GPUBROKER_ADMIN_TOKEN": docs_broker.tokens["ops"],
           "GPUBROKER_METRICS_URL": docs_broker.metrics_url,
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
           "PYTHONUNBUFFERED": "1"}
    runner = subprocess.Popen([sys.executable, str(Path(__file__).with_name("run_page.py")), str(spec)], cwd=workdir,
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              start_new_session=True)
    try:
        stdout, stderr = runner.communicate(timeout=PAGE_TIMEOUT - 60)
    except subprocess.TimeoutExpired:
        # Where it hangs: SIGABRT to the page's process group makes each Python in it (faulthandler) print its
        # threads' stacks before it dies.
        os.killpg(runner.pid, signal.SIGABRT)
        try:
            stdout, stderr = runner.communicate(timeout=30)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(runner.pid, signal.SIGKILL)
            runner.wait()
        pytest.fail(f"{page.relative_to(DOCS.parent)}: the examples did not finish in {PAGE_TIMEOUT - 60} s\n"
                    f"--- stdout\n{stdout[-6000:]}\n--- stderr (the stacks)\n{stderr[-12000:]}")
    assert runner.returncode == 0, (f"{page.relative_to(DOCS.parent)}: an example failed\n--- stdout\n"
                                    f"{stdout[-6000:]}\n--- stderr\n{stderr[-6000:]}")
