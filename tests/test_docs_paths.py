"""The README and every page under docs/ point only at paths a clone has: no `../shared` (a folder beside the
development checkout, which a user's clone lacks) and no relative Markdown link to a file that does not exist."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
#: `[text](target)` with a relative target (no scheme, not an in-page anchor).
LINK = re.compile(r"\[[^\]]*\]\((?!https?:|mailto:|#)([^)\s#]+)(?:#[^)]*)?\)")


def test_no_page_sends_readers_outside_the_clone() -> None:
    outside = [
        f"{p.relative_to(ROOT)}:{n}"
        for p in PAGES
        for n, line in enumerate(p.read_text().splitlines(), 1)
        if "../shared" in line
    ]
    assert not outside, f"these lines name ../shared, which a clone does not have: {outside}"


def test_every_relative_link_resolves() -> None:
    broken = [
        f"{page.relative_to(ROOT)}: {target}"
        for page in PAGES
        for target in LINK.findall(page.read_text())
        if not (page.parent / target).exists()
    ]
    assert not broken, f"relative links to files that do not exist: {broken}"
