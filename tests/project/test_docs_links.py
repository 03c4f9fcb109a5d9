"""The README stays short and every relative link in it and in docs/ resolves.

A link resolves when its file exists (relative to the page) and, with a `#fragment`, when
the target page has a heading whose GitHub anchor is that fragment. Links inside code
blocks and to other sites are not checked.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
README_MAX_BYTES = 12 * 1024
# CI runs the README's test command (.ci/run), and users copy the first one.
QUICK_START = (
    "pip install -e . && conveyor serve",
    "pip install -e '.[test]' && python -m pytest -q",
)

_FENCE = re.compile(r"^```.*?^```", re.M | re.S)
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
_HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$", re.M)


def _prose(text: str) -> str:
    """The page without its fenced code blocks."""
    return _FENCE.sub("", text)


def anchors(page: Path) -> set[str]:
    """GitHub's anchors for the page's headings (a repeated one gets -1, -2, ...)."""
    seen: dict[str, int] = {}
    out = set()
    for heading in _HEADING.findall(_prose(page.read_text(encoding="utf-8"))):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def relative_links(page: Path) -> list[str]:
    links = _LINK.findall(_prose(page.read_text(encoding="utf-8")))
    return [t for t in links if not re.match(r"^[a-z][a-z0-9+.-]*:", t)]


def test_anchors_follow_github() -> None:
    page = ROOT / "docs" / "parallelism.md"
    assert "data-parallel-replicas---data-parallel-size-n" in anchors(page)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path) -> None:
    broken = []
    for link in relative_links(page):
        path, _, fragment = link.partition("#")
        target = (page.parent / path).resolve() if path else page
        if not target.exists():
            broken.append(f"{link}: no such file")
        elif fragment and target.suffix == ".md" and fragment not in anchors(target):
            broken.append(f"{link}: no heading with that anchor")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def test_readme_is_short() -> None:
    size = len(README.read_bytes())
    assert size <= README_MAX_BYTES, f"README.md is {size} bytes; move detail to docs/"


def test_readme_keeps_the_quick_start_commands() -> None:
    lines = README.read_text(encoding="utf-8").splitlines()
    for command in QUICK_START:
        assert command in lines, command
