"""Generated blocks in hand-written pages: find a block, fill it, check it.

A page marks each generated block as ``<!-- NAME -->`` ... ``<!-- /NAME -->``. The text
between the two markers belongs to a :class:`Block`: a first line, an HTML comment, names
the command that writes it and the files it is computed from, and the rest is whatever the
block's function returns. The prose around the blocks is by hand. A :class:`Site` is one
command's set of blocks and figures: it rewrites them (``write``), or reports, by page and
block, each that differs from what it would write (``check``), which is what a test or CI
runs on the committed pages.

This module knows nothing of what the blocks say: the functions that write them, and the
object they read (``Site.read``: the evidence under a root), are the caller's. Figures are
written, not compared byte for byte (their pixels depend on the installed plotting
library); the check requires that each one that is due exists.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["Block", "Figure", "Site", "current", "fill"]


@dataclass(frozen=True)
class Block:
    """One generated block: the page it sits in, its marker, the files it is computed from
    (named in its first line) and the function that writes its text from the evidence."""

    page: str
    marker: str
    sources: tuple[str, ...]
    make: Callable[[Any], str]

    def text(self, evidence: Any, command: str) -> str:
        """The block's text as it stands between its markers: the origin line, then what
        ``make`` writes."""
        origin = f"<!-- written by `{command}` from {', '.join(self.sources)}; do not edit -->"
        return f"{origin}\n{self.make(evidence).strip()}"


def _always(_evidence: Any) -> bool:
    return True


@dataclass(frozen=True)
class Figure:
    """A figure a page shows: its path, the function that draws it from the evidence
    (returning False when it had nothing to draw) and whether it is due yet (a figure of a
    grid with nothing published is neither drawn nor required)."""

    path: str
    draw: Callable[[Any, Path], bool | None]
    due: Callable[[Any], bool] = _always


def _block_pattern(marker: str) -> str:
    """A marked block from an earlier write, or a lone opening marker (a new block)."""
    m = re.escape(marker)
    return rf"<!-- {m} -->\n.*?<!-- /{m} -->|<!-- {m} -->"


def fill(doc: str, marker: str, text: str) -> str:
    """``doc`` with its ``marker`` (or earlier marked block) replaced by ``text``."""
    pattern = _block_pattern(marker)
    if re.search(pattern, doc, re.S) is None:
        raise ValueError(f"the document has no <!-- {marker} --> marker")
    filled = f"<!-- {marker} -->\n{text}\n<!-- /{marker} -->"
    return re.sub(pattern, lambda _: filled, doc, count=1, flags=re.S)


def current(doc: str, marker: str) -> str | None:
    """The text of ``marker``'s block in ``doc``; None without a complete block."""
    m = re.escape(marker)
    found = re.search(rf"<!-- {m} -->\n(.*?)\n<!-- /{m} -->", doc, re.S)
    return None if found is None else found.group(1)


@dataclass(frozen=True)
class Site:
    """One command's generated blocks and figures, over the pages they sit in.

    ``command`` is how the blocks' origin lines name the command; ``name`` prefixes what
    ``main`` prints; ``read`` turns a root (a checkout) into the object every block's and
    figure's function reads."""

    command: str
    name: str
    blocks: tuple[Block, ...]
    figures: tuple[Figure, ...]
    read: Callable[[Path], Any]

    def pages(self) -> list[str]:
        """The pages holding a block, in the blocks' order."""
        return list(dict.fromkeys(block.page for block in self.blocks))

    def render(self, page: str, doc: str, evidence: Any) -> str:
        """``doc`` (the text of ``page``) with each of its blocks written from ``evidence``."""
        for block in self.blocks:
            if block.page == page:
                doc = fill(doc, block.marker, block.text(evidence, self.command))
        return doc

    def check(self, pages_root: Path, evidence_root: Path) -> list[str]:
        """One line per page block (and figure) that differs from what :meth:`write` would
        write, naming the page and the block; empty when every one is up to date."""
        evidence = self.read(evidence_root)
        problems = []
        for block in self.blocks:
            found = current((pages_root / block.page).read_text(), block.marker)
            if found is None:
                problems.append(
                    f"{block.page}: block {block.marker} is missing (no <!-- {block.marker} "
                    f"--> ... <!-- /{block.marker} --> pair)"
                )
            elif found != block.text(evidence, self.command):
                problems.append(
                    f"{block.page}: block {block.marker} differs from what `{self.command}` "
                    f"writes (from {', '.join(block.sources)}); run it and commit the page"
                )
        for figure in self.figures:
            if figure.due(evidence) and not (evidence_root / figure.path).is_file():
                problems.append(f"{figure.path}: figure missing; `{self.command}` draws it")
        return problems

    def write(self, pages_root: Path, evidence_root: Path, figures: bool = True) -> list[str]:
        """Rewrite every page's blocks and (unless ``figures`` is false) every figure;
        returns the paths written."""
        evidence = self.read(evidence_root)
        written = []
        for page in self.pages():
            path = pages_root / page
            doc = path.read_text()
            try:
                new = self.render(page, doc, evidence)
            except ValueError as err:
                raise ValueError(f"{page}: {err}") from err
            if new != doc:
                path.write_text(new)
                written.append(page)
        for figure in self.figures if figures else ():
            # a figure whose draw returns False had nothing to draw yet
            if figure.draw(evidence, evidence_root / figure.path) is not False:
                written.append(figure.path)
        return written

    def main(self, argv: Sequence[str] | None, description: str, root: Path) -> int:
        """The command line: rewrite every block and figure, or with ``--check`` write
        nothing and exit 1 naming each stale block; ``--root`` (default ``root``) is the
        checkout whose pages and evidence to use."""
        parser = argparse.ArgumentParser(
            prog=self.command, description=description,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )  # fmt: skip
        parser.add_argument(
            "--check", action="store_true",
            help="write nothing; exit 1 naming each page block that differs",
        )  # fmt: skip
        parser.add_argument(
            "--root", type=Path, default=root, help="the checkout whose pages and evidence to use"
        )
        args = parser.parse_args(argv)
        if args.check:
            problems = self.check(args.root, args.root)
            for line in problems:
                print(line)
            if problems:
                return 1
            blocks, pages = len(self.blocks), len(self.pages())
            print(f"{self.name}: {blocks} blocks in {pages} pages are up to date")
            return 0
        try:
            written = self.write(args.root, args.root)
        except ValueError as err:  # a page lost one of its markers
            print(f"{self.name}: {err}")
            return 2
        for path in written:
            print(f"{self.name}: wrote {path}")
        return 0
