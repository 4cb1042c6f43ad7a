"""Module docstrings stay API documentation, and the docs name only files that exist.

A module docstring says what the module is and what it offers, in at most twelve lines; the
reasoning, history and measurements belong to the docs pages (docs/). The docs' backticked
repository paths and relative links to markdown pages must resolve, so a moved or deleted
file shows up here. No source file carries an aside about a Flower version the pin
(``flwr>=1.42,<1.43``) excludes."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("flower_app", "client_app", "server_app", "strategies", "florg_tools")
MAX_DOCSTRING_LINES = 12


def _sources() -> list[Path]:
    return sorted(path for package in PACKAGES for path in (ROOT / package).rglob("*.py"))


def _pages() -> list[Path]:
    return [ROOT / "README.md", ROOT / "lab" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_module_docstrings_are_at_most_twelve_lines():
    long = []
    for path in _sources():
        doc = ast.get_docstring(ast.parse(path.read_text(), str(path)), clean=False)
        if doc is not None and (n := len(doc.splitlines())) > MAX_DOCSTRING_LINES:
            long.append(f"{path.relative_to(ROOT)}: {n} lines")
    assert not long, "module docstrings over 12 lines:\n" + "\n".join(long)


FENCE = re.compile(r"```.*?```", re.S)
CODE_SPAN = re.compile(r"`((?:[^`\n]|\n(?!\n))+)`")  # may wrap a line, not a paragraph
REPO_PATH = re.compile(
    r"^(?:flower_app|client_app|server_app|strategies|florg_tools|benchmarks|scripts|tests|lab"
    r"|conf|docker|docs|ci)/"
)
PLACEHOLDER = re.compile(r"[<>*?{}\[\]$]")  # `strategies/<method>/`, `conf/*.toml`, ...
SUFFIX = re.compile(r"(?:::[\w.\[\]-]+)+$|:\d+(?:-\d+)?$")  # `file.py::test_x`, `file.py:12`
# Written at run time, never in the checkout: the Docker demo's certificates (the compose
# stack's one-shot `certs` service writes them; docker/.gitignore ignores the folder).
GENERATED = ("docker/certificates/",)
MD_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def named_paths(text: str) -> list[str]:
    """The repository paths a page names in inline code: a span's first word, when it starts
    with a top-level folder of this repository, without a ``:line`` or ``::test`` suffix;
    spans with a placeholder or a glob are skipped. Fenced blocks (commands) are not read."""
    found = []
    for span in CODE_SPAN.findall(FENCE.sub("", text)):
        word = span.split()[0] if span.split() else ""
        if REPO_PATH.match(word) and not PLACEHOLDER.search(word):
            found.append(SUFFIX.sub("", word))
    return found


def test_named_paths_reads_spans_as_documented():
    text = "`tests/a.py::test_b` `scripts/x.sh up\n--nodes 2` `conf/<name>.toml` `ci/y.py:12`"
    fenced = "\n```\n`docs/z.md`\n```"
    assert named_paths(text + fenced) == ["tests/a.py", "scripts/x.sh", "ci/y.py"]


def test_docs_name_only_paths_that_exist():
    missing = []
    for page in _pages():
        text = page.read_text()
        for path in named_paths(text):
            if not path.startswith(GENERATED) and not (ROOT / path).exists():
                missing.append(f"{page.relative_to(ROOT)}: `{path}`")
        for target in MD_LINK.findall(FENCE.sub("", text)):
            if re.match(r"^[a-z][a-z+.-]*:", target):  # http:, https:, mailto:
                continue
            file = target.partition("#")[0]
            if file.endswith(".md") and not (page.parent / file).exists():
                missing.append(f"{page.relative_to(ROOT)}: link to {target}")
    assert not missing, "\n".join(missing)


# A Flower version below the pin's 1.42: "Flower 1.41", "flwr 1.40.2", "flwr==1.38", or on a
# line that names Flower or flwr, a two-digit 1.10-1.41 within 60 characters after the name
# ("Flower's Strategy.start (..., 1.41 and 1.42)", "flwr.cli.constant in 1.41"), not a
# measurement (a number followed by %, x, s, ms or a byte unit).
_MINOR = r"1\.(\d{1,2})(?!\d)"
DIRECT = re.compile(rf"\b(?:flower|flwr)(?:'s)?\s*(?:v|version\s+|[=<>]=?\s*)?{_MINOR}", re.I)
NEARBY = re.compile(
    r"\b(?:flower|flwr)\b[^\n]{0,60}?(?<![\d.])1\.([1-4]\d)(?![\d.])"
    r"(?!\s*(?:%|x\b|s\b|ms\b|[kMG]i?B\b))",
    re.I,
)


def excluded_versions(text: str) -> list[str]:
    """Each mention once (both patterns may match it), keyed by where its version starts."""
    found = {}
    for pattern in (DIRECT, NEARBY):
        for m in pattern.finditer(text):
            if int(m.group(1)) < 42:
                found.setdefault(m.start(1), m.group(0))
    return [found[start] for start in sorted(found)]


def test_excluded_version_pattern():
    hits = ["Flower 1.41 takes", "flwr 1.40.2", "flwr==1.38", "(flwr/x/a.py, 1.41 and 1.42)"]
    misses = ["Flower 1.42 takes", "flwr>=1.42,<1.43", "flwr took 1.25 s", "Flower, 1.5x faster"]
    assert all(excluded_versions(text) for text in hits), hits
    assert not [text for text in misses if excluded_versions(text)], misses


def test_no_aside_about_an_excluded_flower_version():
    asides = [
        f"{path.relative_to(ROOT)}: {hit!r}"
        for path in _sources()
        for hit in excluded_versions(path.read_text())
    ]
    assert not asides, "asides about Flower versions the pin excludes:\n" + "\n".join(asides)
