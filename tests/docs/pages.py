"""The docs' pages and their fenced code blocks, as the example tests read them.

A block is a fenced code block (``` or ~~~, indented or not, e.g. inside an admonition or a tab). The line
directly before its opening fence may carry a marker:

- ``<!-- docs-test: gpu -->``: needs an NVIDIA GPU; run only against a CUDA broker (scripts/gpu_check.sh).
- ``<!-- docs-test: skip REASON -->``: never run (a host change, a VM, a container runtime); REASON is required.

``python`` and ``bash`` blocks are examples and run; ``toml`` blocks are checked as broker config; other languages
(text, console, yaml, ...) are shown, not run. The spellings ``py``, ``sh``, ``shell`` ... are refused, so no
example escapes its test by its fence's name.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

__all__ = ["DOCS", "RUN", "Block", "blocks", "pages"]

DOCS = Path(__file__).resolve().parents[2] / "docs"
RUN = ("python", "bash")  # the fence languages that are examples
REFUSED = {"py", "python3", "pycon", "sh", "shell", "zsh", "shell-session"}  # say python or bash (or console)

_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})[ \t]*\{?\.?(?P<lang>[\w+-]*)[^`]*$")
_MARKER = re.compile(r"^\s*<!--\s*docs-test:\s*(?P<kind>\w+)(?:\s+(?P<reason>.*?))?\s*-->\s*$")


@dataclass(frozen=True)
class Block:
    page: Path  # the markdown file
    line: int  # the 1-based line of the block's first line of code
    lang: str
    source: str  # dedented to the fence's indentation
    marker: str = ""  # "", "gpu" or "skip"
    reason: str = ""

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(DOCS.parent)}:{self.line}"


def pages() -> list[Path]:
    """Every markdown page of the site (docs/_hooks is code, not pages)."""
    return sorted(p for p in DOCS.rglob("*.md") if "_hooks" not in p.parts)


def blocks(page: Path) -> list[Block]:
    """The page's fenced blocks in order; ValueError for an unclosed fence or a malformed marker."""
    lines = page.read_text().splitlines()
    found: list[Block] = []
    i = 0
    while i < len(lines):
        match = _FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        indent, fence, lang = match.group("indent"), match.group("fence"), match.group("lang").lower()
        close = re.compile(rf"^{re.escape(indent)}{re.escape(fence[0])}{{{len(fence)},}}\s*$")
        end = next((j for j in range(i + 1, len(lines)) if close.match(lines[j])), None)
        if end is None:
            raise ValueError(f"{page}:{i + 1}: a fence that is never closed")
        body = [line[len(indent):] if line.startswith(indent) else line.lstrip() for line in lines[i + 1:end]]
        marker = reason = ""
        prev = i - 1
        while prev >= 0 and not lines[prev].strip():
            prev -= 1
        if prev >= 0 and "docs-test" in lines[prev]:
            mark = _MARKER.match(lines[prev])
            if not mark or mark.group("kind") not in ("gpu", "skip"):
                raise ValueError(f"{page}:{prev + 1}: expected <!-- docs-test: gpu --> or <!-- docs-test: skip "
                                 f"REASON -->, got {lines[prev].strip()!r}")
            marker, reason = mark.group("kind"), mark.group("reason") or ""
            if marker == "skip" and not reason:
                raise ValueError(f"{page}:{prev + 1}: a skipped example must say why")
        found.append(Block(page, i + 2, lang, "\n".join(body) + "\n", marker, reason))
        i = end + 1
    return found
