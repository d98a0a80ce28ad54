"""Log output: the classic text lines, or JSON lines carrying the tenant, session and method of the call."""

from __future__ import annotations

import asyncio
import contextvars
import json
import logging
import sys
import time
from typing import Any

__all__ = ["CONTEXT_FIELDS", "RECORD_FIELDS", "JsonFormatter", "bind_log_context", "configure_logging", "log_context"]

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


class JsonFormatter(logging.Formatter):
    """One JSON object a line: time (UTC, ISO 8601), level, logger, message, then the call's and the record's fields.

    A record with a ``json_message`` has that as its message here: its fields say the rest (a worker's output: the
    text line repeats them, the JSON line need not).
    """

    def format(self, record: logging.LogRecord) -> str:
        json_message = getattr(record, "json_message", None)
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
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        elif record.exc_text:
            line["exception"] = record.exc_text
        return json.dumps(line, ensure_ascii=False, default=str)


def configure_logging(log_format: str = "text", verbose: bool = False, text_format: str = TEXT_FORMAT) -> None:
    """Replace the root handler: text lines as before, or JSON lines (``log_format = "json"``) on stderr."""
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(_ContextFilter())
    handler.setFormatter(JsonFormatter() if log_format == "json" else logging.Formatter(text_format))
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, handlers=[handler], force=True)
