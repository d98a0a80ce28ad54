"""`gpubroker bench array-api`'s runner: it runs the offline conformance suite from a writable copy and counts what
its report says (per test file, the pass percentage, failures with reasons, skips with theirs)."""

from __future__ import annotations

from typing import Any

from gpubroker_bench.array_api import format_summary, run_suite, summarize


def _test(nodeid: str, outcome: str, **phases: Any) -> dict[str, Any]:
    return {"nodeid": nodeid, "outcome": outcome, **phases}


def test_summary_counts_per_file_and_the_pass_percentage() -> None:
    report = {
        "tests": [
            _test("array_api_tests/test_a.py::test_one", "passed"),
            _test("array_api_tests/test_a.py::test_two[x]", "failed",
                  call={"outcome": "failed", "crash": {"message": "AssertionError: out=nan\nmore"}}),
            _test("array_api_tests/test_a.py::test_three", "skipped",
                  setup={"outcome": "skipped", "longrepr": "('/x/test_a.py', 3, 'Skipped: flaky')"}),
            _test("array_api_tests/test_b.py::test_four", "error",
                  setup={"outcome": "failed", "longrepr": "fixture boom"}),
            _test("array_api_tests/test_b.py::test_five", "passed"),
        ],
        "collectors": [{"nodeid": "array_api_tests/test_c.py", "outcome": "failed",
                        "longrepr": "Traceback...\nImportError: no xp.fft"}],
    }
    result = summarize(report)
    assert result.per_file == {
        "test_a.py": {"passed": 1, "failed": 1, "errors": 0, "skipped": 1},
        "test_b.py": {"passed": 1, "failed": 0, "errors": 1, "skipped": 0},
        "test_c.py": {"passed": 0, "failed": 0, "errors": 1, "skipped": 0},
    }
    assert result.totals == {"passed": 2, "failed": 1, "errors": 2, "skipped": 1}
    assert result.pass_percent == 40.0  # 2 / (2 + 1 + 2)
    assert result.failures == {
        "array_api_tests/test_a.py::test_two[x]": "AssertionError: out=nan",
        "array_api_tests/test_b.py::test_four": "error: fixture boom",
        "array_api_tests/test_c.py": "collection error: ImportError: no xp.fft",
    }
    assert result.skipped == {"array_api_tests/test_a.py::test_three": "flaky"}
    assert "pass percentage: 40.00 %" in format_summary(result)


def test_the_suite_runs_from_a_writable_copy_against_the_reference() -> None:
    # array-api-strict, the reference, passes the suite's constants tests: the copy, the module's environment and
    # the report's parsing all work (the quick pass, tests/client/array/, runs it against the namespace).
    result = run_suite(mode="strict", max_examples=2, pytest_args=["array_api_tests/test_constants.py"],
                       timeout=120, quiet=True)
    assert result.per_file == {"test_constants.py": {"passed": 5, "failed": 0, "errors": 0, "skipped": 0}}
    assert result.pass_percent == 100.0
    assert result.exit_code == 0
