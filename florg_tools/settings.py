"""pyproject.toml's ``[tool.flwr.app.config]``, generated from the one declaration of the
run settings (``flower_app.config.RunConfig``): every key with its default, its help as a
comment and the cache groups it affects.

Command line::

    python -m florg_tools.settings --check   # exit 1 (and a diff) when pyproject differs
    python -m florg_tools.settings --write   # rewrite the table from the schema
    python -m florg_tools.settings           # print the generated table

The table runs from its header to the next table header (or the end of the file); the
lines before the header are kept as they are.
"""

from __future__ import annotations

import argparse
import difflib
import re
import sys
from pathlib import Path

import tomli_w

from flower_app.config import SCHEMA

__all__ = ["HEADER", "PYPROJECT", "generated_table", "replace_table", "table_in"]

PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"
HEADER = "[tool.flwr.app.config]"
_NEXT_TABLE = re.compile(r"^\[", re.MULTILINE)


def _literal(key: str, value: object) -> str:
    return tomli_w.dumps({key: value}).strip()


def generated_table() -> str:
    """The table's text: header, a note, then ``key = value  # help [groups]`` per key."""
    lines = [
        HEADER,
        "# Generated from flower_app/config.py (RunConfig) by `python -m florg_tools.settings",
        "# --write`; edit the schema there, not here. [groups]: the cached artefacts a key",
        "# changes (flower_app/disk_cache.py keys on them). Override with --run-config.",
    ]
    for key, spec in SCHEMA.items():
        groups = f" [{', '.join(sorted(spec.affects))}]" if spec.affects else ""
        lines.append(f"{_literal(key, spec.default)}  # {spec.help}{groups}")
    return "\n".join(lines) + "\n"


def _span(text: str) -> tuple[int, int]:
    start = text.find(f"\n{HEADER}\n")
    if start < 0:
        raise ValueError(f"pyproject.toml has no {HEADER} table")
    start += 1
    following = _NEXT_TABLE.search(text, start + len(HEADER))
    return start, following.start() if following else len(text)


def table_in(text: str) -> str:
    """The ``[tool.flwr.app.config]`` table of a pyproject text, as written."""
    start, end = _span(text)
    return text[start:end].rstrip("\n") + "\n"


def replace_table(text: str) -> str:
    """``text`` with its table replaced by the generated one."""
    start, end = _span(text)
    rest = text[end:]
    return text[:start] + generated_table() + ("\n" + rest if rest else "")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m florg_tools.settings", description=__doc__)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true", help="fail when pyproject differs")
    mode.add_argument("--write", action="store_true", help="rewrite pyproject's table")
    parser.add_argument("--pyproject", type=Path, default=PYPROJECT)
    args = parser.parse_args(argv)
    if not (args.check or args.write):
        sys.stdout.write(generated_table())
        return 0
    text = args.pyproject.read_text(encoding="utf-8")
    if args.write:
        new = replace_table(text)
        if new != text:
            args.pyproject.write_text(new, encoding="utf-8")
        print(f"{args.pyproject}: {HEADER} {'rewritten' if new != text else 'up to date'}")
        return 0
    current, wanted = table_in(text), generated_table()
    if current == wanted:
        return 0
    diff = difflib.unified_diff(
        current.splitlines(keepends=True), wanted.splitlines(keepends=True),
        f"{args.pyproject} (as written)", "generated from flower_app/config.py",
    )  # fmt: skip
    sys.stdout.writelines(diff)
    print(f"{args.pyproject}: {HEADER} is out of date: python -m florg_tools.settings --write")
    return 1


if __name__ == "__main__":
    sys.exit(main())
