"""What the benchmarks' command lines share."""

from __future__ import annotations

import argparse
from collections.abc import Callable

__all__ = ["comma_list"]


def comma_list(choices: tuple[str, ...]) -> Callable[[str], tuple[str, ...]]:
    """An argparse ``type`` for ``--only``: a comma list of some of ``choices`` (none unknown, at least one)."""
    def parse(text: str) -> tuple[str, ...]:
        picked = tuple(part.strip() for part in text.split(",") if part.strip())
        if not picked or any(part not in choices for part in picked):
            raise argparse.ArgumentTypeError(f"a comma list of {', '.join(choices)} (got {text!r})")
        return picked
    return parse
