"""What native code in the front writes to its stderr (gRPC core above all), logged rate-limited and escaped.

gRPC core logs its own errors straight to file descriptor 2, one line per event, and many of those events are a
peer's doing before any token is checked: a call whose ``grpc-encoding`` is unknown ("Error parsing 'grpc-encoding'
metadata"), or disabled, and others. One local user sending such calls put 50,159 lines (5.3 MB) into the broker's
log in 3 s. So the front's descriptor 2 becomes a pipe that a thread of the front reads: each line it carries is
logged through ``gpubroker.native`` at the level gRPC gave it, escaped as worker output is (``workers.escape``: a
peer's bytes in it cannot start a line of their own), at most ``BURST`` lines per ``WINDOW`` seconds for each source
location (then one line saying how many were left out; lines without gRPC's prefix, a traceback of a process the
front started, at most ``OTHER_BURST``). Python's own writes to ``sys.stderr`` (the log handler, the ``serving on``
line of text logs) go to the real stderr, as before. A process the front starts with its stderr (the acceptor, which
writes only a traceback on a bug) goes through the pipe too; the workers have pipes of their own (workers/_output.py).
"""

from __future__ import annotations

import logging
import os
import re
import sys
import threading

from gpubroker.broker.front.auth import RateLimitedLog
from gpubroker.broker.front.workers import escape

__all__ = ["capture_native_stderr"]

log = logging.getLogger("gpubroker.native")
BURST = 20
OTHER_BURST = 200
WINDOW = 10.0
MAX_LINE = 2000  # characters of a line logged (the rest cut)
_READ = 65536
# gRPC core's (absl's) prefix: severity letter, date, time, thread, source location.
_PREFIX = re.compile(r"^([IWEF])\d{4} [\d:.]+\s+\d+ ([\w./-]+:\d+)\] ?")
_LEVELS = {"I": logging.INFO, "W": logging.WARNING, "E": logging.ERROR, "F": logging.CRITICAL}


def _log_line(limited: RateLimitedLog, other: RateLimitedLog, raw: bytes) -> None:
    text = raw.decode("utf-8", "surrogateescape").rstrip("\r")
    if not text:
        return
    match = _PREFIX.match(text)
    if match:
        limited.log(_LEVELS[match.group(1)], match.group(2), "%s", escape(text[:MAX_LINE], quote=False))
    else:
        other.log(logging.WARNING, "native stderr", "%s", escape(text[:MAX_LINE], quote=False))


def _pump(fd: int, limited: RateLimitedLog, other: RateLimitedLog) -> None:
    pending = b""
    while True:
        try:
            chunk = os.read(fd, _READ)
        except InterruptedError:
            continue
        except OSError:
            return
        if not chunk:
            if pending:
                _log_line(limited, other, pending)
            return
        lines = (pending + chunk).split(b"\n")
        pending = lines.pop()
        if len(pending) > 4 * MAX_LINE:  # (a line that never ends: logged in pieces rather than held)
            lines.append(pending)
            pending = b""
        for line in lines:
            _log_line(limited, other, line)


def capture_native_stderr() -> None:
    """Make the process's descriptor 2 a pipe read by a daemon thread that logs what comes (see the module's doc),
    and ``sys.stderr`` the real stderr. Call it before logging is configured (its handler takes ``sys.stderr``)."""
    real = os.dup(2)
    read_fd, write_fd = os.pipe()
    os.dup2(write_fd, 2)
    os.close(write_fd)
    os.set_inheritable(2, True)
    sys.stderr = os.fdopen(real, "w", buffering=1, errors="backslashreplace")
    limited = RateLimitedLog(log, burst=BURST, window=WINDOW)
    other = RateLimitedLog(log, burst=OTHER_BURST, window=WINDOW)
    threading.Thread(target=_pump, args=(read_fd, limited, other), name="gpubroker native stderr",
                     daemon=True).start()
