"""JSON log lines and their call fields; the metrics_listen and log_format settings."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import sys
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpubroker.broker.cli import main
from gpubroker.broker.config import BrokerConfig, load_config, save_config
from gpubroker.broker.logs import bind_log_context, configure_logging, log_context
from gpubroker.client import InvalidArgument
from gpubroker.wire.addresses import TcpAddress, parse_host_port


@pytest.fixture
def json_lines(monkeypatch: pytest.MonkeyPatch) -> Iterator[io.StringIO]:
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    out = io.StringIO()
    monkeypatch.setattr("sys.stderr", out)
    # (JSON logging takes these over: given back after the test)
    monkeypatch.setattr("sys.excepthook", sys.excepthook)
    monkeypatch.setattr("threading.excepthook", threading.excepthook)
    configure_logging("json")
    yield out
    logging.captureWarnings(False)
    root.handlers[:] = saved[0]
    root.setLevel(saved[1])


def _records(out: io.StringIO) -> list[dict[str, str]]:
    return [json.loads(line) for line in out.getvalue().splitlines()]


def test_json_lines_carry_the_bound_call_but_not_into_spawned_tasks(json_lines: io.StringIO) -> None:
    log = logging.getLogger("gpubroker.test")

    async def call() -> None:
        bind_log_context(method="Allocate", tenant="alice")
        bind_log_context(session="ses_1", tenant="")  # an empty value leaves the bound one
        log.info("in the call")
        await asyncio.create_task(spawned())

    async def spawned() -> None:
        log.info("in a task the call started")

    asyncio.run(call())
    log.warning("outside %s", "any call", extra={"tenant": "bob"})
    inside, spawned_line, outside = _records(json_lines)
    assert inside["message"] == "in the call" and inside["level"] == "INFO" and inside["logger"] == "gpubroker.test"
    assert (inside["tenant"], inside["session"], inside["method"]) == ("alice", "ses_1", "Allocate")
    assert inside["time"].endswith("Z") and "T" in inside["time"]
    assert "tenant" not in spawned_line and "session" not in spawned_line
    assert outside["message"] == "outside any call" and outside["tenant"] == "bob" and "method" not in outside
    assert log_context.get() is None  # asyncio.run kept the call's context to itself


def test_json_lines_carry_exceptions(json_lines: io.StringIO) -> None:
    try:
        raise ValueError("boom")
    except ValueError:
        logging.getLogger("gpubroker.test").exception("it failed")
    (line,) = _records(json_lines)
    assert line["level"] == "ERROR" and "ValueError: boom" in line["exception"]


def test_json_lines_take_warnings_and_uncaught_exceptions(json_lines: io.StringIO) -> None:
    warnings.warn("a deprecated thing", DeprecationWarning, stacklevel=1)
    try:
        raise RuntimeError("nobody caught me")
    except RuntimeError as exc:
        sys.excepthook(type(exc), exc, exc.__traceback__)
    thread = threading.Thread(target=lambda: 1 / 0, name="doomed")
    thread.start()
    thread.join()
    warned, uncaught, in_thread = _records(json_lines)
    assert warned["logger"] == "py.warnings" and "a deprecated thing" in warned["message"]
    assert uncaught["level"] == "CRITICAL" and "RuntimeError: nobody caught me" in uncaught["exception"]
    assert "thread doomed" in in_thread["message"] and "ZeroDivisionError" in in_thread["exception"]


def test_audit_lines_carry_their_data_as_fields(json_lines: io.StringIO) -> None:
    audit = logging.getLogger("gpubroker.audit")
    audit.info("action=reload added=%s removed=%s sessions_ended=%d", ["dave"], [], 2)
    audit.warning("auth failure: peer=%s method=%s certificate=%s maps to no tenant", "unix:/s", "Open", ["cn=x"])
    audit.warning("action=refuse-connection listener=%s peer=%s reason=over the rate (%g a second)", "m", "uid:7", 5.0)
    audit.warning("%s: %d more like this in the last %.0f s (not logged)", "auth failures", 3, 10.0)
    reload, failure, refused, summary = _records(json_lines)
    assert reload == {**reload, "message": "reload", "action": "reload", "added": ["dave"], "removed": [],
                      "sessions_ended": 2}
    assert failure == {**failure, "message": "auth failure maps to no tenant", "peer": "unix:/s", "method": "Open",
                       "certificate": ["cn=x"]}
    assert (refused["listener"], refused["peer"], refused["reason"]) == ("m", "uid:7", "over the rate (5 a second)")
    assert summary["message"] == "auth failures: 3 more like this in the last 10 s (not logged)"


def test_settings_round_trip_and_bad_values_are_refused(tmp_path: Path) -> None:
    path = save_config(BrokerConfig(metrics_listen="[::1]:9464", log_format="json"), tmp_path / "c.toml")
    again = load_config(path)
    assert (again.metrics_listen, again.log_format) == ("[::1]:9464", "json")
    assert parse_host_port("[::1]:9464") == TcpAddress("::1", 9464)
    assert BrokerConfig().metrics_listen == ""  # off unless asked for
    bad = (('metrics_listen = "9464"', "metrics_listen"), ('metrics_listen = "host:99999"', "metrics_listen"),
           ('log_format = "xml"', "log_format"))
    for line, key in bad:
        (tmp_path / "bad.toml").write_text(f"[broker]\n{line}\n")
        with pytest.raises(InvalidArgument, match=f"{key}: expected"):
            load_config(tmp_path / "bad.toml")


def test_serve_refuses_a_bad_metrics_address(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--config", "unused.toml", "--metrics-listen", "localhost"])
    assert exit_info.value.code == 2 and "expected HOST:PORT" in capsys.readouterr().err


def test_serve_with_json_logs_says_a_missing_config_in_json(tmp_path: Path, json_lines: io.StringIO,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    logging.getLogger().handlers[:] = []  # (as main finds it: JSON logging not configured yet)
    assert main(["serve", "--config", str(tmp_path / "missing.toml"), "--log-format", "json"]) == 2
    (line,) = [json.loads(text) for text in capsys.readouterr().err.splitlines()]
    assert line["level"] == "ERROR" and line["message"].startswith("no config file at ")
