"""A worker's stdout and stderr, as the front logs them: untrusted bytes, one tenant's, rate-limited and escaped.

The tenant runs native code in its worker, so every byte the worker writes (its own Python log lines included)
may be forged. The front reads both pipes on its event loop (never blocking it) and logs each line the worker wrote
as one record of its own. It reads no faster than it may log: while the rate limit admits nothing, a pipe is not
read (the worker then blocks in its own write, in its own time and turn), since reading only to drop cost the
front's loop 42 % of a CPU for a kernel writing 1 GiB/s to its stderr, charged to nobody.

- built by the front: the logger ``gpubroker.worker.output``, level WARNING, the tenant, device, worker pid and
  stream, then the content as one quoted field, ``output="..."``, in which every character that is not printable
  (newlines, carriage returns, escapes, Unicode line separators, bidi controls), every quote and backslash, and
  every byte that is not UTF-8 is escaped: nothing a kernel writes can start a line of its own or end the field;
  in JSON lines the text (escaped the same, but for quotes, which JSON escapes) is the ``output`` field and the
  tenant a field of the front's;
- cut at ``MAX_LINE_BYTES`` (the rest of a longer line is dropped, counted);
- admitted by two token buckets per worker, bytes and lines per second with a burst; what they refuse is
  dropped, counted, and said in one summary line per ``SUMMARY_SECONDS`` (and when the pipes close).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import IO, cast

__all__ = ["BURST_BYTES", "BURST_LINES", "BYTES_PER_SECOND", "LINES_PER_SECOND", "MAX_LINE_BYTES", "WorkerOutput",
           "escape"]

log = logging.getLogger("gpubroker.worker.output")

# An honest worker writes a few log lines at a time (a warning; a traceback of 30-60 lines when an op fails): the
# burst takes a few tracebacks at once, the rates a steady trickle, and a flood costs the log at most the burst
# plus the rate.
BYTES_PER_SECOND = 8192
LINES_PER_SECOND = 20
BURST_BYTES = 65536
BURST_LINES = 200
MAX_LINE_BYTES = 2048  # of the worker's bytes; escaped, a line is at most 4 x this many characters
SUMMARY_SECONDS = 2.0  # while output is being dropped, one summary line at most this often
_LEVEL = logging.WARNING  # one level for all of it: a worker cannot choose its own line's severity
_MIN_COST = 64  # bytes of the bucket a line takes at least (the record's prefix)
# A pipe paused over the rate limit is read again after at least this long: a flood then costs the front one read
# of a pipe's worth (at most 1 MiB, counted in C) this often, and an honest line waits at most about this long.
_MIN_PAUSE_SECONDS = 0.1

_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t", "\\": "\\\\"}


def escape(text: str, *, quote: bool = True) -> str:
    """``text`` (decoded with ``surrogateescape``) with nothing that could start a line or (``quote``) end a
    quoted field.

    Printable characters stay as they are, so an honest line reads as written; the rest become ``\\n``, ``\\r``,
    ``\\t``, ``\\\\``, ``\\"`` (with ``quote``; a JSON line's field is quoted by JSON), ``\\xNN`` (an ASCII
    control, or a byte that was not UTF-8) or ``\\uNNNN`` / ``\\UNNNNNNNN`` (any other character that is not
    printable, e.g. U+2028 LINE SEPARATOR or a bidi override).
    """
    if text.isprintable() and "\\" not in text and not (quote and '"' in text):
        return text
    out = []
    for c in text:
        if c in _NAMED:
            out.append(_NAMED[c])
        elif c == '"':
            out.append('\\"' if quote else c)
        elif c.isprintable():
            out.append(c)
        else:
            code = ord(c)
            if code < 0x80:
                out.append(f"\\x{code:02x}")
            elif 0xDC80 <= code <= 0xDCFF:  # surrogateescape's mark for a byte that was not UTF-8
                out.append(f"\\x{code - 0xDC00:02x}")
            elif code <= 0xFFFF:
                out.append(f"\\u{code:04x}")
            else:
                out.append(f"\\U{code:08x}")
    return "".join(out)


class _Bucket:
    """Tokens refilled at ``rate`` per second up to ``burst``."""

    def __init__(self, rate: float, burst: float) -> None:
        self.rate, self.burst = rate, burst
        self.tokens = burst
        self._at = time.monotonic()

    def refill(self, now: float) -> None:
        self.tokens = min(self.burst, self.tokens + (now - self._at) * self.rate)
        self._at = now


class WorkerOutput:
    """Both output pipes of one worker process: read, cut into lines, rate-limited, escaped, logged."""

    def __init__(self, tenant: str, device: int, on_dropped: Callable[[int], None] | None = None) -> None:
        self.tenant = tenant
        self.device = device
        self.pid = 0  # set once the process exists
        self.on_dropped = on_dropped  # the bytes dropped, as they are counted (for the tenant's metric)
        self.bytes = _Bucket(BYTES_PER_SECOND, BURST_BYTES)
        self.lines = _Bucket(LINES_PER_SECOND, BURST_LINES)
        self.dropped_bytes = 0  # since the last summary
        self.dropped_lines = 0
        self.dropped_total = 0
        self.last_line = ""  # the last line of stderr, escaped (a start that failed is explained with it)
        self._summary: asyncio.TimerHandle | None = None
        self._streams: list[_Stream] = []
        self._transports: list[asyncio.BaseTransport] = []

    async def attach(self, stdout: IO[bytes], stderr: IO[bytes]) -> None:
        """Start reading the pipes (the read ends; their transports own and close them)."""
        loop = asyncio.get_running_loop()
        for name, pipe in (("stdout", stdout), ("stderr", stderr)):
            stream = _Stream(self, name)
            self._streams.append(stream)
            transport, _ = await loop.connect_read_pipe(_factory(stream), pipe)
            self._transports.append(transport)

    async def closed(self, timeout: float) -> None:
        """Wait up to ``timeout`` for both pipes to reach end-of-file (every writer gone), then close them."""
        pending = [s.done for s in self._streams if not s.done.done()]
        if pending:
            await asyncio.wait(pending, timeout=timeout)
        self.close()

    def close(self) -> None:
        for transport in self._transports:
            transport.close()
        for stream in self._streams:
            stream.finish()
        self._summarize()

    # -- the streams' lines ------------------------------------------------------------------------------------

    def line(self, stream: str, data: bytes, cut: bool) -> None:
        """One line, without its newline (``cut``: the first ``MAX_LINE_BYTES`` of a longer one)."""
        decoded = data.decode("utf-8", "surrogateescape")
        text = escape(decoded)
        if stream == "stderr":
            self.last_line = text[:400]
        now = time.monotonic()
        self.bytes.refill(now)
        self.lines.refill(now)
        cost = len(text) + _MIN_COST
        if self.lines.tokens < 1 or self.bytes.tokens < cost:
            self.drop(len(data) + (0 if cut else 1), 1)
            return
        self.lines.tokens -= 1
        self.bytes.tokens -= cost
        log.log(_LEVEL, 'tenant=%s device=%d pid=%d stream=%s output="%s"%s', self.tenant, self.device, self.pid,
                stream, text, f" (cut at {MAX_LINE_BYTES} bytes)" if cut else "",
                extra={"tenant": self.tenant, "device": self.device, "pid": self.pid, "stream": stream,
                       "output": escape(decoded, quote=False), "json_message": "worker output"})

    def admits(self) -> bool:
        """Whether a line could be logged now (the streams drop whole chunks at once while it could not)."""
        now = time.monotonic()
        self.bytes.refill(now)
        self.lines.refill(now)
        return self.lines.tokens >= 1 and self.bytes.tokens >= _MIN_COST

    def seconds_to_admit(self) -> float:
        """How long until a short line could be logged (0 if it could now)."""
        return max((1 - self.lines.tokens) / LINES_PER_SECOND, (_MIN_COST - self.bytes.tokens) / BYTES_PER_SECOND,
                   0.0)

    def drop(self, nbytes: int, nlines: int) -> None:
        if nbytes <= 0 and nlines <= 0:
            return
        self.dropped_bytes += nbytes
        self.dropped_lines += nlines
        self.dropped_total += nbytes
        if self.on_dropped is not None:
            self.on_dropped(nbytes)
        if self._summary is None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                return  # (closing, off the loop: close() says it)
            self._summary = loop.call_later(SUMMARY_SECONDS, self._summarize)

    def _summarize(self) -> None:
        if self._summary is not None:
            self._summary.cancel()
            self._summary = None
        if not self.dropped_bytes and not self.dropped_lines:
            return
        nbytes, nlines = self.dropped_bytes, self.dropped_lines
        self.dropped_bytes = self.dropped_lines = 0
        log.log(_LEVEL, "tenant=%s device=%d pid=%d dropped %d bytes (%d lines) of the worker's output over its "
                "rate limit (%d bytes and %d lines a second, lines cut at %d bytes)", self.tenant, self.device,
                self.pid, nbytes, nlines, BYTES_PER_SECOND, LINES_PER_SECOND, MAX_LINE_BYTES,
                extra={"tenant": self.tenant, "device": self.device, "pid": self.pid, "dropped_bytes": nbytes,
                       "dropped_lines": nlines, "json_message": "worker output dropped over its rate limit"})


def _factory(stream: _Stream) -> Callable[[], _Stream]:
    return lambda: stream


class _Stream(asyncio.Protocol):
    """One pipe: bytes into lines for ``WorkerOutput.line``; while nothing could be logged, whole chunks are only
    counted (in C: a flood costs the front a read and a count per chunk, not a Python step per line)."""

    def __init__(self, output: WorkerOutput, name: str) -> None:
        self.output = output
        self.name = name
        self.partial = bytearray()  # the line being read, up to MAX_LINE_BYTES
        self.skipping = False  # the line being read was longer: logged cut, the rest dropped up to its newline
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.transport: asyncio.ReadTransport | None = None
        self._resume: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # (a read pipe's: asyncio's or uvloop's, which is no asyncio.ReadTransport subclass but has its methods)
        self.transport = cast(asyncio.ReadTransport, transport)

    def _pause(self) -> None:
        """Read nothing more until a line could be logged again."""
        if self.transport is None or self._resume is not None or self.done.done():
            return
        self.transport.pause_reading()
        self._resume = asyncio.get_running_loop().call_later(
            max(self.output.seconds_to_admit(), _MIN_PAUSE_SECONDS), self._resume_reading)

    def _resume_reading(self) -> None:
        self._resume = None
        if self.transport is not None and not self.transport.is_closing():
            self.transport.resume_reading()

    def data_received(self, data: bytes) -> None:
        dropped = self.output.dropped_total
        self._lines(data)
        if self.output.dropped_total != dropped or not self.output.admits():
            self._pause()  # over the rate limit: read on once it may log again

    def _lines(self, data: bytes) -> None:
        out = self.output
        start, end = 0, len(data)
        while start < end:
            if not self.partial and not self.skipping and not out.admits():
                # Nothing can be logged now: count this chunk's whole lines, keep only the start of its last.
                last = data.rfind(b"\n", start)
                if last >= 0:
                    out.drop(last + 1 - start, data.count(b"\n", start, last + 1))
                    start = last + 1
                self._take(data[start:end])
                return
            newline = data.find(b"\n", start)
            self._take(data[start:end if newline < 0 else newline])
            if newline < 0:
                return
            self._end_line()
            start = newline + 1

    def _take(self, piece: bytes) -> None:
        if self.skipping:
            self.output.drop(len(piece), 0)
            return
        room = MAX_LINE_BYTES - len(self.partial)
        if len(piece) <= room:
            self.partial += piece
            return
        # Logged now, cut, rather than when (if ever) its newline comes.
        self.partial += piece[:room]
        self.output.line(self.name, bytes(self.partial), cut=True)
        self.partial.clear()
        self.skipping = True
        self.output.drop(len(piece) - room, 0)

    def _end_line(self) -> None:
        if self.skipping:
            self.skipping = False
        elif self.partial:
            self.output.line(self.name, bytes(self.partial), cut=False)
            self.partial.clear()

    def eof_received(self) -> bool | None:
        self.finish()
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        self.finish()

    def finish(self) -> None:
        if self._resume is not None:
            self._resume.cancel()
            self._resume = None
        if not self.done.done():
            self._end_line()  # a last line with no newline
            self.done.set_result(None)
