"""The live progress line on stderr: redrawn in place on a terminal, a plain line every few seconds otherwise."""

from __future__ import annotations

import sys
import time
from typing import TextIO

__all__ = ["Progress"]


class Progress:
    def __init__(self, duration: float, stream: TextIO | None = None, every: float = 5.0, width: int = 24) -> None:
        self.duration, self.every, self.width = duration, every, width
        self.stream = stream if stream is not None else sys.stderr
        self.tty = self.stream.isatty()
        self._last_line = float("-inf")
        self._drawn = False
        self._prev = (0.0, 0)  # (elapsed, ops) at the previous update: the rate shown is the recent one
        self._rate = 0.0

    def update(self, elapsed: float, ops: int, gigabytes: float, errors: int) -> None:
        frac = min(1.0, max(0.0, elapsed / self.duration))
        if elapsed - self._prev[0] >= 0.1:  # too short an interval gives a meaningless rate: keep the last one
            self._rate = (ops - self._prev[1]) / (elapsed - self._prev[0])
            self._prev = (elapsed, ops)
        rate = self._rate
        text = (f"{min(elapsed, self.duration):5.1f}/{self.duration:g} s  {ops:,} ops ({rate:,.0f}/s now)  "
                f"{gigabytes:.2f} GB  {errors} errors")
        if self.tty:
            filled = int(frac * self.width)
            bar = "#" * filled + "-" * (self.width - filled)
            self.stream.write(f"\r\x1b[K[{bar}] {frac:4.0%}  {text}")
            self.stream.flush()
            self._drawn = True
        elif time.monotonic() - self._last_line >= self.every:
            self._last_line = time.monotonic()
            print(f"loadtest: {text}", file=self.stream, flush=True)

    def message(self, text: str) -> None:
        """A line of its own (setup steps), kept clear of the redrawn bar."""
        self.finish()
        print(f"loadtest: {text}", file=self.stream, flush=True)

    def finish(self) -> None:
        if self._drawn:
            self.stream.write("\n")
            self.stream.flush()
            self._drawn = False
