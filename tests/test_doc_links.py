"""The docs' links between themselves: every relative link names a file that exists and every
#fragment a heading of that file, as GitHub renders it (a reader who follows one should land
where it says)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *ROOT.glob("*/README.md")])
FENCE = re.compile(r"^\s{0,3}(`{3,}|~{3,})[^`]*$")  # a fence's info string holds no backtick
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$")
LINK = re.compile(r"\]\(([^)\s]*)\)")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but hyphens dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading anchor of a Markdown file; a repeated heading takes -1, -2, ... as on GitHub."""
    seen: dict[str, int] = {}
    out: set[str] = set()
    in_code = False
    for line in path.read_text().splitlines():
        if FENCE.match(line):
            in_code = not in_code
        elif not in_code and (match := HEADING.match(line)):
            base = slug(match.group(1))
            count = seen.get(base, 0)
            out.add(base if count == 0 else f"{base}-{count}")
            seen[base] = count + 1
    return out


def broken_links(doc: Path) -> list[str]:
    """The relative links of `doc` whose file or heading does not exist."""
    broken = []
    for match in LINK.finditer(doc.read_text()):
        target, _, fragment = match.group(1).partition("#")
        if re.match(r"^[a-z]+:", target) or not (target or fragment):
            continue  # http:, https:, mailto: and the like
        path = (doc.parent / target).resolve() if target else doc
        if not path.exists():
            broken.append(f"{match.group(1)}: no such file")
        elif fragment and path.suffix == ".md" and fragment not in anchors(path):
            broken.append(f"{match.group(1)}: no such heading")
    return broken


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_lands(doc):
    assert broken_links(doc) == []


def test_the_checker_sees_a_broken_heading_and_a_missing_file(tmp_path):
    (tmp_path / "a.md").write_text("# Title (2026-12-04, later)\n\n```sh\n# not a heading\n```\n"
                                   "## Title (2026-12-04, later)\n")
    (tmp_path / "b.md").write_text("[ok](a.md#title-2026-12-04-later) [ok](a.md#title-2026-12-04-later-1) "
                                   "[bad](a.md#title) [code](a.md#not-a-heading) [gone](c.md) "
                                   "[web](https://x.org/#y)\n")
    assert broken_links(tmp_path / "b.md") == ["a.md#title: no such heading", "a.md#not-a-heading: no such heading",
                                               "c.md: no such file"]
