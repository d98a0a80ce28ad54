"""The site builds with warnings as errors, and every internal link and anchor of the built HTML resolves.

MkDocs' strict build already checks the markdown's links and anchors (mkdocs.yml `validation`) and mkdocstrings'
cross-references; this also walks the HTML it wrote, so links made by the theme, the generated parts and the API
reference are checked too. External links are not followed (CI has no network).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

from .pages import DOCS, pages

ROOT = DOCS.parent


class _Links(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.ids: set[str] = set()
        self.links: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        for name, value in attrs:
            if value is None:
                continue
            if name in ("id", "name"):
                self.ids.add(value)
            elif (name == "href" and tag in ("a", "link")) or (name == "src" and tag in ("img", "script")):
                self.links.append(value)


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    result = subprocess.run([str(Path(sys.executable).parent / "mkdocs"), "build", "--strict", "-d", str(out)],
                            cwd=ROOT, capture_output=True, text=True, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
                            timeout=600)
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stderr[-8000:]}"
    return out


def _target(site: Path, page: Path, link: str) -> tuple[Path, str] | None:
    """The file and fragment an internal link points at; None for external links."""
    parts = urlsplit(link)
    if parts.scheme or parts.netloc or link.startswith(("mailto:", "javascript:")):
        return None
    path = unquote(parts.path)
    if not path:
        return page, parts.fragment
    base = site if path.startswith("/") else page.parent
    target = (base / path.lstrip("/")).resolve()
    if target.is_dir() or path.endswith("/"):
        target = target / "index.html"
    return target, parts.fragment


def test_internal_links_and_anchors_resolve(site: Path) -> None:
    parsed: dict[Path, _Links] = {}
    for html in site.rglob("*.html"):
        links = _Links()
        links.feed(html.read_text(errors="replace"))
        parsed[html.resolve()] = links
    broken = []
    for html, links in parsed.items():
        for link in links.links:
            found = _target(site, html, link)
            if found is None:
                continue
            target, fragment = found
            if not target.exists():
                broken.append(f"{html.relative_to(site.resolve())}: {link} (no such file)")
            elif fragment and target.suffix == ".html" and fragment not in parsed[target].ids:
                broken.append(f"{html.relative_to(site.resolve())}: {link} (no anchor #{fragment})")
    assert len(parsed) > 10
    assert not broken, "broken internal links:\n" + "\n".join(sorted(set(broken)))


def test_no_page_is_a_stub() -> None:
    stubs = [str(p.relative_to(ROOT)) for p in pages() if "To be written." in p.read_text()]
    assert not stubs, f"pages still to be written: {stubs}"


class _Paragraphs(HTMLParser):
    """The text of every <p>, inline markup and all."""

    def __init__(self) -> None:
        super().__init__()
        self.depth = 0
        self.text: list[str] = []
        self.paragraphs: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "p":
            self.depth += 1
            self.text = []

    def handle_endtag(self, tag: str) -> None:
        if tag == "p" and self.depth:
            self.depth -= 1
            self.paragraphs.append("".join(self.text))

    def handle_data(self, data: str) -> None:
        if self.depth:
            self.text.append(data)


# A line of a paragraph that starts like a list item: the list did not render (Python-Markdown took the items as
# a lazy continuation of the paragraph before them, e.g. after a block indented 4 spaces inside 2-space items).
_RUN_ON_ITEM = re.compile(r"\n[ \t]*(?:[-*+]|\d+[.)])[ \t]+\S")


def test_no_list_renders_as_a_paragraph(site: Path) -> None:
    run_on = []
    for html in sorted(site.rglob("*.html")):
        paragraphs = _Paragraphs()
        paragraphs.feed(html.read_text(errors="replace"))
        for text in paragraphs.paragraphs:
            found = _RUN_ON_ITEM.search(text)
            if found:
                run_on.append(f"{html.relative_to(site)}: ...{text[max(0, found.start() - 60):found.end() + 30]!r}")
    assert not run_on, "list items rendered inside a paragraph (indent the item's blocks, or end the nested " \
                       "block with a blank line):\n" + "\n".join(run_on)


def test_the_site_links_the_repository_the_changelog_and_the_cli_reference(site: Path) -> None:
    home = (site / "index.html").read_text()
    assert 'class="md-source"' in home  # repo_url: the repository's link in the header
    changelog = (site / "changelog" / "index.html").read_text()
    assert "Unreleased" in changelog
    cli = (site / "reference" / "cli" / "index.html").read_text()
    assert 'id="gpubroker-serve"' in cli and 'id="gpubroker-tenant-add"' in cli and "--ready-file" in cli
    assert "stylesheets/extra.css" in home  # 120-column code fits at 1400 px
