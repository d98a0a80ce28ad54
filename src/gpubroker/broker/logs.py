"""Log output: the classic text lines, or JSON lines carrying the tenant, session and method of the call."""

from __future__ import annotations

import asyncio
import contextvars
import json
import logging
import re
import sys
import threading
import time
import types
from typing import Any

__all__ = ["CONTEXT_FIELDS", "RECORD_FIELDS", "JsonFormatter", "audit_fields", "bind_log_context", "configure_logging",
           "json_logging", "log_context"]

TEXT_FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"
# The fields a line carries when the code that logs it runs on behalf of a call.
CONTEXT_FIELDS = ("tenant", "session", "method")
# Fields a record may carry of its own (``extra=``), each its own key in JSON lines: a worker's output is logged by
# the front with its tenant, device, pid and stream, and the worker's (escaped) text only ever in ``output``.
RECORD_FIELDS = ("device", "pid", "stream", "output", "dropped_bytes", "dropped_lines")
# What is known of the call being served, set by the RPC wrappers (and whoever else serves tenants' calls).
log_context: contextvars.ContextVar[dict[str, str] | None] = contextvars.ContextVar("log_context", default=None)
# The task that bound them: tasks it spawns inherit its context but not its identity (a scheduler switch started
# by one tenant's call fences another tenant), so their lines carry no call's fields.
_bound_task: contextvars.ContextVar[asyncio.Task[object] | None] = contextvars.ContextVar("bound_task", default=None)
_MAX_FIELD = 128  # a session id comes from the client: never let one bloat every line


def bind_log_context(**fields: str) -> None:
    """Add fields (tenant=, session=, method=) to the current task's log lines; empty values are left out."""
    merged = dict(log_context.get() or {})
    merged.update({k: str(v)[:_MAX_FIELD] for k, v in fields.items() if v})
    log_context.set(merged)
    _bound_task.set(_current_task())


def _current_task() -> asyncio.Task[object] | None:
    try:
        return asyncio.current_task()
    except RuntimeError:  # no event loop in this thread
        return None


class _ContextFilter(logging.Filter):
    """Copies the call's fields onto the record when it is made (an ``extra=`` of the caller wins)."""

    def filter(self, record: logging.LogRecord) -> bool:
        fields = log_context.get()
        if not fields or _bound_task.get() is not _current_task():
            return True
        for key, value in fields.items():
            if not hasattr(record, key):
                setattr(record, key, value)
        return True


# In a log call's format string: a ``key=`` (the start of an audit field), and a %-conversion.
_KEY = re.compile(r"(?<![\w.])([a-z_][a-z0-9_]*)=")
_CONVERSION = re.compile(r"%(?:%|[-#0 +]*\d*(?:\.\d+)?[sdifgeExXr])")
_CORE = frozenset({"time", "level", "logger", "message", "exception"})


def _json_value(value: object) -> Any:
    if isinstance(value, bool | int | float) or value is None:
        return value
    if isinstance(value, list | tuple | set | frozenset):
        return [str(v) for v in value]
    return str(value)


def audit_fields(msg: str, args: tuple[object, ...]) -> tuple[str, dict[str, Any]] | None:
    """An audit line's ``key=value`` data as fields, read from its format string and arguments (not from the
    formatted text, where a value may hold spaces or an ``=``): each ``key=`` takes the text up to the next one; a
    value that is one conversion (``tenant=%s``) is its argument as given (a number stays a number, a list a list),
    one of text (``reason=over the limit (%g a second)``) is that text formatted. The message is what is left: the
    text before the first key (``auth failure``) and after a one-conversion value (``certificate=%s maps to no
    tenant``), or, with none, the action. None when the line has no ``key=`` (or its arguments do not fit)."""
    keys = list(_KEY.finditer(msg))
    if not keys:
        return None
    conversions = [m for m in _CONVERSION.finditer(msg) if m.group() != "%%"]
    if len(conversions) != len(args):
        return None
    arg_at = {m.start(): i for i, m in enumerate(conversions)}

    def formatted(start: int, end: int) -> str:
        text = msg[start:end]
        used = tuple(args[i] for pos, i in arg_at.items() if start <= pos < end)
        try:
            return (text % used).strip()
        except (TypeError, ValueError):
            return text.strip()

    fields: dict[str, Any] = {}
    rest = [msg[:keys[0].start()].strip().rstrip(":")]
    for n, key in enumerate(keys):
        start, end = key.end(), keys[n + 1].start() if n + 1 < len(keys) else len(msg)
        name = f"audit_{key.group(1)}" if key.group(1) in _CORE else key.group(1)
        single = _CONVERSION.match(msg, start)
        if single is not None and single.group() != "%%" and single.start() in arg_at and (
                single.end() == end or msg[single.end()].isspace()):
            fields[name] = _json_value(args[arg_at[single.start()]])
            rest.append(formatted(single.end(), end))
        else:
            fields[name] = formatted(start, end)
    if not rest[0] and "action" in fields:
        rest[0] = str(fields["action"])  # (a line that starts with its action= says it first)
    return " ".join(part for part in rest if part), fields


class JsonFormatter(logging.Formatter):
    """One JSON object a line: time (UTC, ISO 8601), level, logger, message, then the call's and the record's fields.

    A record with a ``json_message`` has that as its message here: its fields say the rest (a worker's output: the
    text line repeats them, the JSON line need not). An audit record (``gpubroker.audit``) has its ``key=value``
    data as fields of their own (``audit_fields``), its text line unchanged.
    """

    def format(self, record: logging.LogRecord) -> str:
        json_message = getattr(record, "json_message", None)
        audit = None
        if record.name == "gpubroker.audit" and isinstance(record.msg, str) and isinstance(record.args, tuple):
            audit = audit_fields(record.msg, record.args)
        if audit is not None:
            json_message = audit[0]
        line: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": json_message if isinstance(json_message, str) else record.getMessage(),
        }
        for key in CONTEXT_FIELDS:
            value = getattr(record, key, None)
            if value:
                line[key] = str(value)
        for key in RECORD_FIELDS:
            value = getattr(record, key, None)
            if value is not None:
                line[key] = value if isinstance(value, int | float | bool) else str(value)
        if audit is not None:
            line.update(audit[1])  # (its own tenant= or method= over the call's)
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        elif record.exc_text:
            line["exception"] = record.exc_text
        return json.dumps(line, ensure_ascii=False, default=str)


def configure_logging(log_format: str = "text", verbose: bool = False, text_format: str = TEXT_FORMAT) -> None:
    """Replace the root handler: text lines as before, or JSON lines (``log_format = "json"``) on stderr.

    With JSON, whatever else Python would write to stderr goes through the log too, so that every line is JSON:
    warnings (``warnings.warn``, on ``py.warnings``) and exceptions nobody caught, in the main thread or another
    (on ``gpubroker``, at CRITICAL, with the traceback in ``exception``)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(_ContextFilter())
    handler.setFormatter(JsonFormatter() if log_format == "json" else logging.Formatter(text_format))
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, handlers=[handler], force=True)
    if log_format == "json":
        logging.captureWarnings(True)
        sys.excepthook = _log_uncaught
        threading.excepthook = _log_uncaught_in_thread


def json_logging() -> bool:
    """Whether the root handler writes JSON lines (``configure_logging("json")``): then a line meant for stderr
    goes through the log instead."""
    return any(isinstance(h.formatter, JsonFormatter) for h in logging.getLogger().handlers)


def _log_uncaught(kind: type[BaseException], exc: BaseException, tb: types.TracebackType | None) -> None:
    if issubclass(kind, KeyboardInterrupt):
        sys.__excepthook__(kind, exc, tb)
        return
    logging.getLogger("gpubroker").critical("uncaught %s: %s", kind.__name__, exc, exc_info=(kind, exc, tb))


def _log_uncaught_in_thread(args: threading.ExceptHookArgs) -> None:
    if args.exc_value is None or issubclass(args.exc_type, SystemExit):
        return
    name = args.thread.name if args.thread is not None else "?"
    logging.getLogger("gpubroker").critical("uncaught %s in thread %s: %s", args.exc_type.__name__, name,
                                            args.exc_value, exc_info=(args.exc_type, args.exc_value,
                                                                      args.exc_traceback))
