"""Every relative link on the landing page and the docs pages points at a file that exists, and at a
heading of it where the link names one (#anchor), so a reader who follows one lands where it says.

Anchors are GitHub's heading slugs: lower case, punctuation other than '-' and '_' dropped, spaces to
'-', and '-1', '-2', ... for a repeated heading."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# The landing page and every docs page; docs/results/ holds generated records, not pages.
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

FENCE = re.compile(r"^\s*(```|~~~)")
# [text](target) and [text](target "title"); an image's ![alt](target) matches too.
INLINE_LINK = re.compile(r"\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_DEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$")
HEADING = re.compile(r"^\s{0,3}#{1,6}\s+(.*?)\s*#*\s*$")
HTML_ANCHOR = re.compile(r"<a\s+(?:name|id)=\"([^\"]+)\"")
INLINE_CODE = re.compile(r"`[^`]*`")


def _prose_lines(page: Path) -> list[tuple[int, str]]:
    """(line number, line) of the page's lines outside fenced code (a link in a code sample is not a link)."""
    lines, fenced = [], False
    for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            lines.append((number, line))
    return lines


def github_slug(heading: str) -> str:
    """GitHub's anchor for a heading's text."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading keeps its text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every anchor a link may name on ``page``: its headings' slugs and its explicit HTML anchors."""
    seen: Counter[str] = Counter()
    found: set[str] = set()
    for _, line in _prose_lines(page):
        found.update(HTML_ANCHOR.findall(line))
        m = HEADING.match(line)
        if not m:
            continue
        slug = github_slug(m.group(1))
        found.add(slug if seen[slug] == 0 else f"{slug}-{seen[slug]}")
        seen[slug] += 1
    return found


def relative_links(page: Path) -> list[tuple[int, str]]:
    """(line number, target) of each link on ``page`` that is not an URL or a mail address."""
    links = []
    for number, line in _prose_lines(page):
        prose = INLINE_CODE.sub("", line)
        targets = INLINE_LINK.findall(prose)
        ref = REFERENCE_DEF.match(prose)
        if ref:
            targets.append(ref.group(1))
        links += [(number, t) for t in targets if not re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", t)]
    return links


def _shown(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def broken_links(page: Path) -> list[str]:
    """One line per link on ``page`` whose file or anchor does not exist."""
    problems = []
    for number, target in relative_links(page):
        path_part, _, anchor = target.partition("#")
        dest = (page.parent / path_part).resolve() if path_part else page
        where = f"{_shown(page)}:{number}: ({target})"
        if not dest.exists():
            problems.append(f"{where}: no such file {_shown(dest)}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            problems.append(f"{where}: {dest.name} has no heading with anchor #{anchor}")
    return problems


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path) -> None:
    assert broken_links(page) == []


def test_the_checker_sees_links() -> None:
    """The pages do link to each other: a checker that found no links would pass every page."""
    readme = relative_links(ROOT / "README.md")
    assert ("docs/status.md" in {t for _, t in readme}) and len(readme) > 10


def test_a_bad_link_and_a_bad_anchor_are_reported(tmp_path: Path) -> None:
    (tmp_path / "other.md").write_text("# A heading, with `code`\n\n## A heading, with `code`\n")
    page = tmp_path / "page.md"
    page.write_text(
        "[ok](other.md#a-heading-with-code) [ok2](other.md#a-heading-with-code-1)\n"
        "[gone](missing.md) [bad anchor](other.md#nope)\n```\n[in code](ignored.md)\n```\n"
    )
    assert [t for _, t in relative_links(page)] == [
        "other.md#a-heading-with-code", "other.md#a-heading-with-code-1", "missing.md", "other.md#nope"
    ]
    problems = broken_links(page)
    assert len(problems) == 2
    assert "(missing.md): no such file" in problems[0] and "has no heading with anchor #nope" in problems[1]
