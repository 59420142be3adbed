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


#: A screen of README, as a reader sees it before scrolling (GitHub's rendering shows about this much).
FIRST_SCREEN_LINES = 40


def test_the_readme_s_first_screen_says_what_it_is_which_papers_and_how_to_run_and_test_it() -> None:
    screen = "\n".join((ROOT / "README.md").read_text().splitlines()[:FIRST_SCREEN_LINES])
    assert "control plane for Mixture-of-Experts LLM serving" in screen  # what it is, and for whom next to it
    assert "arXiv:2607.00466" in screen and "arXiv:2606.15177" in screen  # ELDR and Gimbal, cited
    assert "make run " in screen and "make test " in screen  # the two set-up commands, as commands
