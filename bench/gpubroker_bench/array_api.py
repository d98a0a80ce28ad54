"""The Array API standard's conformance suite (array-api-tests) against ``gpubroker.client.array``.

``gpubroker bench array-api`` copies the offline suite (``../shared/array-api-tests``: its PROVENANCE.txt says it
is read-only in CI and must run from a writable copy) to a temporary directory and runs it with pytest, its
``ARRAY_API_TESTS_MODULE`` naming ``namespace_from_env()`` below, in one of two modes:

- ``--mode broker`` (the default): a real broker (``gpubroker serve`` in a child process, as ``gpubroker demo``
  starts one) on ``--backend opencl|cuda``; the suite's process connects to it with ``async_commands=True`` over
  ``--transport``, so every array lives in the tenant's worker.
- ``--mode inprocess``: the backend opened in the suite's own process (no broker): quick local iteration.
- ``--mode strict``: array-api-strict itself, the reference (a check of this runner and of the suite's copy).

It writes pytest-json-report's report (``--json-report FILE``), prints pass / fail / error / skip counts per test
file and the pass percentage (passed / (passed + failed + errors); skipped tests are listed apart with their
reasons), and with ``--out FILE`` writes that summary as JSON (the failing test ids with the first line of their
reason). Arguments after ``--`` go to pytest as they are (test files or ids, ``-k``, ``-x``).

Examples::

    gpubroker bench array-api --mode inprocess --max-examples 20
    gpubroker bench array-api --backend cuda --max-examples 50 --out /tmp/aat.json
    gpubroker bench array-api --mode inprocess -- array_api_tests/test_linalg.py -k solve

The suite needs pytest, pytest-json-report, hypothesis>=6.151 and ndindex>=1.8 (the ``dev`` extra has them).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["SuiteResult", "find_suite", "main", "namespace_from_env", "run_suite", "summarize"]

# What the suite's process reads to build the namespace (set by run_suite; see namespace_from_env).
ENV_MODE = "GPUBROKER_XP_MODE"  # "inprocess" or "broker"
ENV_BACKEND = "GPUBROKER_XP_BACKEND"
ENV_TARGET = "GPUBROKER_XP_TARGET"
ENV_TOKEN = "GPUBROKER_XP_TOKEN"
ENV_TRANSPORT = "GPUBROKER_XP_TRANSPORT"
MODULE_SPEC = "exec('import gpubroker_bench.array_api as m; xp = m.namespace_from_env()')"
REPO_ROOT = Path(__file__).resolve().parents[1]
TENANT = "conformance"


def namespace_from_env() -> Any:
    """The namespace the suite tests, built in the suite's own process from the ``GPUBROKER_XP_*`` variables."""
    from gpubroker.client.array import namespace

    mode = os.environ.get(ENV_MODE, "inprocess")
    backend = os.environ.get(ENV_BACKEND, "opencl")
    if mode == "inprocess":
        from gpubroker.broker.backends import open_backend

        gpu: Any = open_backend(backend)
    else:
        from gpubroker.client import connect

        gpu = connect(os.environ[ENV_TARGET], token=os.environ[ENV_TOKEN], async_commands=True,
                      transport=os.environ.get(ENV_TRANSPORT, "auto"))
    xp = namespace(gpu)
    # The suite names the module under test by ``xp.__name__`` in its report header and JSON metadata; the
    # standard does not ask a namespace for one, so a namespace object without it gets the package's name here.
    if not hasattr(xp, "__name__"):
        xp.__name__ = "gpubroker.client.array"
    return xp


def find_suite(explicit: str | None = None) -> Path:
    """The offline array-api-tests folder: ``explicit``, ``$ARRAY_API_TESTS_DIR``, ``shared/array-api-tests`` in or
    beside the repository (an editable install's) or the current directory (where gpubroker is installed from
    wheels, as on the GPU machine): the first that has ``array_api_tests/``."""
    roots = [REPO_ROOT, REPO_ROOT.parent, Path.cwd(), Path.cwd().parent]
    candidates = [explicit] if explicit else [os.environ.get("ARRAY_API_TESTS_DIR"),
                                               *(str(root / "shared" / "array-api-tests") for root in roots)]
    for candidate in candidates:
        if candidate and (Path(candidate) / "array_api_tests").is_dir():
            return Path(candidate)
    raise FileNotFoundError(f"no array-api-tests suite in {[c for c in candidates if c]} (pass --suite DIR)")


def _writable_copy(suite: Path, into: Path) -> Path:
    """A copy of the suite where pytest and hypothesis may write their caches (the source may be read-only)."""
    target = into / "array-api-tests"
    shutil.copytree(suite, target, ignore=shutil.ignore_patterns(".hypothesis", "__pycache__", ".pytest_cache",
                                                                  ".git"))
    for root, dirs, files in os.walk(target):
        for name in dirs + files:
            path = Path(root) / name
            path.chmod(path.stat().st_mode | stat.S_IWUSR)
    target.chmod(target.stat().st_mode | stat.S_IWUSR)
    return target


@contextmanager
def _namespace_env(mode: str, backend: str, transport: str) -> Iterator[dict[str, str]]:
    """The suite process's environment for ``mode``; in broker mode a broker runs for as long as this is open."""
    env = {ENV_MODE: mode, ENV_BACKEND: backend, "ARRAY_API_TESTS_MODULE": MODULE_SPEC}
    if mode == "strict":
        env["ARRAY_API_TESTS_MODULE"] = "array_api_strict"
        env["ARRAY_API_TESTS_VERSION"] = "2024.12"
        yield env
        return
    if mode == "inprocess":
        yield env
        return
    from gpubroker.broker.launcher import BrokerProcess, TenantSpec

    with BrokerProcess([TenantSpec(TENANT, memory_quota=1 << 40)], backend=backend) as broker:
        env.update({ENV_TARGET: broker.target, ENV_TOKEN: broker.tokens[TENANT], ENV_TRANSPORT: transport})
        yield env


@dataclass
class SuiteResult:
    """What one run of the suite gave: counts per test file and in all, and the failing and skipped tests."""

    per_file: dict[str, dict[str, int]] = field(default_factory=dict)
    totals: dict[str, int] = field(default_factory=dict)
    pass_percent: float = 0.0
    failures: dict[str, str] = field(default_factory=dict)  # test id (or collector) -> first line of its reason
    skipped: dict[str, str] = field(default_factory=dict)  # test id -> the skip's reason
    unexpected_passes: list[str] = field(default_factory=list)  # xfail-marked tests that passed
    outcomes: dict[str, str] = field(default_factory=dict)  # test id -> passed, failed, error or skipped
    exit_code: int = 0
    seconds: float = 0.0


def _short_reason(phase: dict[str, Any]) -> str:
    crash = phase.get("crash") or {}
    message = str(crash.get("message") or phase.get("longrepr") or "")
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    return lines[0][:300] if lines else "(no message)"


def _skip_reason(phase: dict[str, Any]) -> str:
    # pytest-json-report keeps a skip's longrepr as the repr of (file, line, "Skipped: reason").
    text = str(phase.get("longrepr") or "")
    match = re.search(r"Skipped: (.*?)['\"]\)?$", text)
    return match.group(1) if match else text


def _test_file(nodeid: str) -> str:
    return nodeid.split("::", 1)[0].rsplit("/", 1)[-1]


def summarize(report: dict[str, Any]) -> SuiteResult:
    """Counts per test file, the pass percentage and the failure and skip lists of a pytest-json-report report."""
    result = SuiteResult()
    counts: dict[str, Counter[str]] = {}
    for test in report.get("tests", []):
        nodeid, outcome = test["nodeid"], test["outcome"]
        result.outcomes[nodeid] = outcome
        file_counts = counts.setdefault(_test_file(nodeid), Counter())
        if outcome in ("passed", "xpassed"):
            file_counts["passed"] += 1
            if outcome == "xpassed":
                result.unexpected_passes.append(nodeid)
        elif outcome in ("failed", "xfailed"):
            file_counts["failed"] += 1
            result.failures[nodeid] = _short_reason(test.get("call") or {})
        elif outcome == "error":
            file_counts["errors"] += 1
            phase = next((test[p] for p in ("setup", "call", "teardown")
                          if test.get(p, {}).get("outcome") == "failed"), {})
            result.failures[nodeid] = "error: " + _short_reason(phase)
        else:  # skipped
            file_counts["skipped"] += 1
            phase = next((test[p] for p in ("setup", "call") if test.get(p, {}).get("outcome") == "skipped"), {})
            result.skipped[nodeid] = _skip_reason(phase)
    # A test module that cannot even be imported collects no tests: one error for the whole file.
    for collector in report.get("collectors", []):
        if collector.get("outcome") == "failed":
            nodeid = collector["nodeid"]
            counts.setdefault(_test_file(nodeid), Counter())["errors"] += 1
            result.failures[nodeid] = "collection error: " + (str(collector.get("longrepr") or "").strip()
                                                               .splitlines() or ["(no message)"])[-1][:300]
    keys = ("passed", "failed", "errors", "skipped")
    result.per_file = {name: {k: c[k] for k in keys} for name, c in sorted(counts.items())}
    result.totals = {k: sum(c[k] for c in counts.values()) for k in keys}
    ran = result.totals["passed"] + result.totals["failed"] + result.totals["errors"]
    result.pass_percent = round(100.0 * result.totals["passed"] / ran, 2) if ran else 0.0
    return result


def run_suite(*, mode: str = "broker", backend: str = "opencl", transport: str = "auto", max_examples: int = 20,
              pytest_args: list[str] | None = None, suite: str | None = None, json_report: str | None = None,
              derandomize: bool = False, deadline: bool = False, test_timeout: float = 300.0,
              timeout: float | None = None, traceback: str = "line", shrink: bool = True,
              quiet: bool = False) -> SuiteResult:
    """Run the conformance suite once against the namespace and summarize it (see the module's docstring)."""
    source = find_suite(suite)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="array-api-tests-") as scratch:
        copy = _writable_copy(source, Path(scratch))
        report_path = Path(json_report).resolve() if json_report else Path(scratch) / "report.json"
        command = [sys.executable, "-m", "pytest", *(pytest_args or ["array_api_tests"]),
                   "-p", "no:cacheprovider", "-q", "-rN", f"--tb={traceback}", f"--max-examples={max_examples}",
                   "--json-report", f"--json-report-file={report_path}", "--json-report-omit", "log", "streams",
                   "-o", "addopts="]
        if importlib.util.find_spec("pytest_timeout") is not None:  # a hung test fails alone, not the whole run
            command.append(f"--timeout={test_timeout:g}")
        if not deadline:
            # Hypothesis' default deadline (800 ms) counts a kernel's first compile and a broker's round trips
            # against one example; the suite's own option turns it off.
            command.append("--disable-deadline")
        if derandomize:
            command.append("--derandomize")
        if not shrink:
            command += ["-p", "gpubroker_bench._array_api_plugin"]
        with _namespace_env(mode, backend, transport) as extra_env:
            env = {**os.environ, **extra_env, "PYTHONDONTWRITEBYTECODE": "1"}
            env.pop("PYTEST_ADDOPTS", None)
            completed = subprocess.run(command, cwd=copy, env=env, timeout=timeout, check=False,
                                       stdout=subprocess.DEVNULL if quiet else None,
                                       stderr=subprocess.STDOUT if quiet else None)
        if not report_path.exists():
            raise RuntimeError(f"the suite wrote no report (pytest exit code {completed.returncode})")
        report = json.loads(report_path.read_text())
    result = summarize(report)
    result.exit_code = completed.returncode
    result.seconds = round(time.perf_counter() - started, 1)
    return result


def format_summary(result: SuiteResult) -> str:
    """The per-file table, the totals and the pass percentage, then the skipped tests with their reasons."""
    lines = [f"{'test file':48} {'passed':>7} {'failed':>7} {'errors':>7} {'skipped':>8}"]
    for name, c in result.per_file.items():
        lines.append(f"{name:48} {c['passed']:7} {c['failed']:7} {c['errors']:7} {c['skipped']:8}")
    t = result.totals
    lines.append(f"{'TOTAL':48} {t['passed']:7} {t['failed']:7} {t['errors']:7} {t['skipped']:8}")
    lines.append(f"pass percentage: {result.pass_percent:.2f} % (passed / (passed + failed + errors)); "
                 f"{result.seconds:.0f} s")
    if result.skipped:
        lines.append(f"skipped ({len(result.skipped)}), why:")
        by_reason = Counter(result.skipped.values())
        for reason, n in by_reason.most_common():
            lines.append(f"  {n:4} x {reason}")
    if result.unexpected_passes:
        lines.append(f"unexpected passes (xfail-marked): {len(result.unexpected_passes)}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gpubroker bench array-api", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=["broker", "inprocess", "strict"], default="broker")
    parser.add_argument("--backend", choices=["opencl", "cuda"], default="opencl")
    parser.add_argument("--transport", default="auto", help="the client's transport in broker mode")
    parser.add_argument("--max-examples", type=int, default=20)
    parser.add_argument("--suite", help="the array-api-tests folder (default: ../shared/array-api-tests)")
    parser.add_argument("--json-report", help="keep pytest-json-report's full report in this file")
    parser.add_argument("--out", help="write the summary (counts, pass percentage, failures, skips) as JSON here")
    parser.add_argument("--failures", help="write the failing test ids, one per line with its reason, here")
    parser.add_argument("--derandomize", action="store_true", help="the same examples every run")
    parser.add_argument("--deadline", action="store_true", help="keep hypothesis' 800 ms deadline per example")
    parser.add_argument("--no-shrink", action="store_true",
                        help="report a failure's first example, not a minimal one (much faster where tests fail)")
    parser.add_argument("--test-timeout", type=float, default=300.0, help="seconds per test (pytest-timeout)")
    parser.add_argument("--tb", default="line", help="pytest's traceback style for failures (line, short, long)")
    parser.add_argument("pytest_args", nargs="*", help="after --: pytest arguments (files, ids, -k EXPR)")
    args = parser.parse_args(argv)
    result = run_suite(mode=args.mode, backend=args.backend, transport=args.transport,
                       max_examples=args.max_examples, pytest_args=args.pytest_args or None, suite=args.suite,
                       json_report=args.json_report, derandomize=args.derandomize, deadline=args.deadline,
                       test_timeout=args.test_timeout, traceback=args.tb, shrink=not args.no_shrink)
    print(format_summary(result))
    if args.out:
        Path(args.out).write_text(json.dumps(asdict(result), indent=2) + "\n")
    if args.failures:
        Path(args.failures).write_text("".join(f"{k}  # {v}\n" for k, v in sorted(result.failures.items())))
    return 0 if result.totals.get("failed", 0) + result.totals.get("errors", 0) == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
