"""Every relative link in README.md, docs/ and the published evidence's pages resolves.

A link's file must exist (relative to the page) and, for a markdown target with a
``#fragment``, the target must have a heading whose GitHub anchor is that fragment, so a
moved page or a renamed section shows up here instead of as a dead link."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# [text](target) and ![alt](target), target without spaces; external schemes are skipped
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"```.*?```", re.S)


def _pages() -> list[Path]:
    """README.md, docs/**/*.md, lab/README.md and lab/evidence/**/*.md outside the per-run
    folders."""
    found = [ROOT / "README.md", ROOT / "lab" / "README.md", *(ROOT / "docs").rglob("*.md")]
    found += [p for p in (ROOT / "lab" / "evidence").rglob("*.md") if "runs" not in p.parts]
    return sorted(found)


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but ``-`` and ``_`` dropped,
    spaces to hyphens."""
    text = heading.replace("`", "").strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every heading anchor of ``page`` (a repeated heading gets ``-1``, ``-2``, ...)."""
    seen: dict[str, int] = {}
    for line in FENCE.sub("", page.read_text()).splitlines():
        heading = re.match(r"^#{1,6} (.*)", line)
        if heading:
            slug = anchor(heading.group(1))
            seen[slug] = seen.get(slug, -1) + 1
    return {slug if n == 0 else f"{slug}-{n}" for slug, count in seen.items()
            for n in range(count + 1)}  # fmt: skip


def broken_links(page: Path) -> list[str]:
    problems = []
    for target in LINK.findall(FENCE.sub("", page.read_text())):
        if re.match(r"^[a-z][a-z+.-]*:", target):  # http:, https:, mailto:
            continue
        path, _, fragment = target.partition("#")
        dest = (page.parent / path) if path else page
        if not dest.exists():
            problems.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
        elif fragment and dest.suffix == ".md" and fragment not in anchors(dest):
            problems.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    return problems


def test_anchor_follows_github():
    assert anchor("Privacy–utility (issue 29)") == "privacyutility-issue-29"
    assert anchor("FLoRG's server step") == "florgs-server-step"
    assert anchor("The `florg` command") == "the-florg-command"


def test_every_relative_link_resolves():
    problems = [line for page in _pages() for line in broken_links(page)]
    assert not problems, "\n".join(problems)
