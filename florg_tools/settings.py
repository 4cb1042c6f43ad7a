"""pyproject.toml's ``[tool.flwr.app.config]`` and the reference page docs/settings.md, both
generated from the one declaration of the run settings
(``flower_app.settings.config.RunConfig``): every key with its default, its help and the
cache groups it affects (``generated_table``, ``generated_doc``).

    python -m florg_tools.settings --check     # exit 1 (and a diff) when either differs
    python -m florg_tools.settings --write     # rewrite both from the schema
    python -m florg_tools.settings             # print the generated table
    python -m florg_tools.settings --doc-only  # print the generated page

The table runs from its header to the next table header or the end of the file; the lines
before it are kept. The page's preamble is ``DOC_PREAMBLE`` (edit it here), then the keys.
"""

from __future__ import annotations

import argparse
import difflib
import re
import sys
from pathlib import Path

import tomli_w

import strategies.registry  # noqa: F401  (every method registers: resolve_config reads them)
from flower_app.settings.config import schema

__all__ = [
    "DOC",
    "HEADER",
    "PYPROJECT",
    "generated_doc",
    "generated_table",
    "replace_table",
    "table_in",
]

PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"
DOC = PYPROJECT.parent / "docs" / "settings.md"  # the page, beside pyproject.toml
HEADER = "[tool.flwr.app.config]"
_NEXT_TABLE = re.compile(r"^\[", re.MULTILINE)


def _literal(key: str, value: object) -> str:
    return tomli_w.dumps({key: value}).strip()


def key_sections() -> tuple[tuple[str, list[str]], ...]:
    """The keys in the order both generated files list them, by section: the core's run
    settings (schema order), the methods' own, then the testing-only keys."""
    from flower_app.settings.config import method_setting_owners

    owners = method_setting_owners()
    return (
        ("core", [k for k in schema() if k not in owners and not is_testing_only(k)]),
        ("methods", list(owners)),
        ("testing", [k for k in schema() if is_testing_only(k)]),
    )


TABLE_SECTION_NOTES = {
    "methods": "# Methods' own settings (strategies/<method>/settings.py)",
    "testing": "# Testing only: fault injection (docs/faults.md); never set in a real run",
}


def generated_table() -> str:
    """The table's text: header, a note, then ``key = value  # help [groups]`` per key."""
    lines = [
        HEADER,
        "# Generated from the run settings (flower_app/settings/ and each method's",
        "# strategies/<method>/settings.py) by `python -m florg_tools.settings --write`; edit",
        "# them there, not here. [groups]: the cached artefacts a key changes",
        "# (flower_app/cache/disk.py keys on them). Override with --run-config.",
    ]
    for section, keys in key_sections():
        if section in TABLE_SECTION_NOTES:
            lines.append(TABLE_SECTION_NOTES[section])
        for key in keys:
            spec = schema()[key]
            groups = f" [{', '.join(sorted(spec.affects))}]" if spec.affects else ""
            lines.append(f"{_literal(key, spec.default)}  # {spec.help}{groups}")
    return "\n".join(lines) + "\n"


DOC_PREAMBLE = """\
# Settings

<!-- Generated from RunConfig (flower_app/settings/config.py, flower_app/settings/) by
`python -m florg_tools.settings --write`; edit the schema (or this preamble,
florg_tools/settings.py) there, not here. -->

Every run setting is declared once: the core's as fields of `RunConfig`
(`flower_app/settings/config.py`), each in the group of its concern in `flower_app/settings/`; a
method's own in its folder, `strategies/<method>/settings.py` (the section "Methods' own
settings" below). A declaration holds the setting's default, the check of its values, its
help and the cached artefacts it affects. This page and the
`[tool.flwr.app.config]` table of `pyproject.toml` are generated from it by
`python -m florg_tools.settings --write`; `python -m florg_tools.settings --check` (and
`tests/tooling/test_settings_doc.py`, `tests/runtime/test_config.py`) fail when either is out of
date. A field `data_path` is the key `data-path`.

A run takes the defaults below, then a preset (a flat TOML table of settings,
`conf/<name>.toml`), then explicit values; an explicit value always wins:

```bash
flwr run . local-simulation --stream --run-config "method='fedit' num-server-rounds=10"
flwr run . local-simulation --stream --run-config conf/paper.toml   # a preset as it is
florg launch --preset paper --set batch-size=16                      # preset < --set
```

Unknown keys and bad values fail before any training with a message naming the key.
The presets, tasks and models, and what a run writes: [usage.md](usage.md).

*affects*: the cached artefacts a key changes (`data`: which examples each client gets;
`tokenisation`: how examples become model inputs; `model`: the adapted model before
training). The on-disk caches (`flower_app/cache/disk.py`) key on every setting of the
groups they depend on; a key that affects none changes how a run is carried out only.
"""


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def is_testing_only(key: str) -> bool:
    """A key for the tests only (fault injection): its help starts with 'testing:'."""
    return schema()[key].help.startswith("testing:")


def generated_doc() -> str:
    """docs/settings.md: the preamble, then ``| key | default | help | affects |`` rows: the
    core's run settings in schema order (grouped by concern in flower_app/settings/), the
    methods' own (each row naming the methods that read it), the testing-only keys, then
    the values of ``method`` (``method_table``)."""
    from flower_app.settings.config import method_setting_owners

    lines = [DOC_PREAMBLE.rstrip("\n")]
    owners = method_setting_owners()
    titles = {
        "core": "## Run settings (schema order)",
        "methods": "## Methods' own settings\n\nDeclared in each method's folder "
        "(`strategies/<method>/settings.py`); any run may set them, and only the methods "
        "named before the help read them.",
        "testing": "## Testing only\n\nFault injection for the tests and the poisoning "
        "benchmark ([faults.md](faults.md)); never set in a real run.",
    }
    for section, keys in key_sections():
        title = titles[section]
        lines += ["", title, "", "| key | default | help | affects |", "|---|---|---|---|"]
        for key in keys:
            spec = schema()[key]
            default = tomli_w.dumps({"v": spec.default}).strip().removeprefix("v = ")
            affects = ", ".join(sorted(spec.affects)) or "–"
            readers = ", ".join(f"`{m}`" for m in owners.get(key, ()))
            text = f"{readers}: {_cell(spec.help)}" if readers else _cell(spec.help)
            lines.append(f"| `{key}` | `{_cell(default)}` | {text} | {affects} |")
    lines += ["", *method_table()]
    return "\n".join(lines) + "\n"


def method_table() -> list[str]:
    """The values of ``method``, one row per registered method (strategies/registry.py):
    its adapter, what travels, whether clients may differ in rank, its central-DP
    mechanism."""
    from flower_app.methods.registry import get_method, method_names

    lines = [
        "## Methods (the values of `method`)",
        "",
        "Generated from the method registry (`strategies/registry.py`, one folder each under "
        "`strategies/`); [usage.md](usage.md#methods) cites each method's paper.",
        "",
        "| method | what it does | adapter | travels (besides the head) | client ranks may "
        "differ | `dp=central` mechanism |",
        "|---|---|---|---|---|---|",
    ]
    for name in method_names():
        m = get_method(name)
        travels = "shared: " + ", ".join(m.shared)
        if set(m.trained_parts(1)) != set(m.shared) or set(m.trained_parts(2)) != set(m.shared):
            ups = " / ".join(",".join(m.trained_parts(t)) for t in (1, 2))
            travels += f"; up in rounds 1 / 2: {ups}"
        if m.local:
            travels += "; kept by each client: " + ", ".join(m.local)
        if m.frozen:
            travels += "; frozen: " + ", ".join(m.frozen)
        mechanism = m.dp_mechanism or "refused"
        hetero = "yes" if m.heterogeneous_ranks else "no"
        lines.append(
            f"| `{name}` | {_cell(m.summary)} | {m.adapter} | {travels} | {hetero} | {mechanism} |"
        )
    return lines


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


def _diff(current: str, wanted: str, path: Path, what: str) -> list[str]:
    return list(
        difflib.unified_diff(
            current.splitlines(keepends=True), wanted.splitlines(keepends=True),
            f"{path} (as written)", f"{what} generated from flower_app/settings/config.py",
        )
    )  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m florg_tools.settings", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true", help="fail when either file differs")
    mode.add_argument("--write", action="store_true", help="rewrite pyproject's table and the page")
    mode.add_argument("--doc-only", action="store_true", help="print the generated page")
    parser.add_argument("--pyproject", type=Path, default=PYPROJECT)
    parser.add_argument(
        "--doc",
        type=Path,
        default=None,
        help="the page (default: docs/settings.md beside --pyproject)",
    )
    args = parser.parse_args(argv)
    doc = args.doc if args.doc is not None else args.pyproject.parent / "docs" / "settings.md"
    if args.doc_only:
        sys.stdout.write(generated_doc())
        return 0
    if not (args.check or args.write):
        sys.stdout.write(generated_table())
        return 0
    text = args.pyproject.read_text(encoding="utf-8")
    page = doc.read_text(encoding="utf-8") if doc.is_file() else None
    if args.write:
        new = replace_table(text)
        if new != text:
            args.pyproject.write_text(new, encoding="utf-8")
        print(f"{args.pyproject}: {HEADER} {'rewritten' if new != text else 'up to date'}")
        wanted = generated_doc()
        if page != wanted:
            doc.parent.mkdir(parents=True, exist_ok=True)
            doc.write_text(wanted, encoding="utf-8")
        print(f"{doc}: {'rewritten' if page != wanted else 'up to date'}")
        return 0
    stale = []
    diff = _diff(table_in(text), generated_table(), args.pyproject, HEADER)
    if diff:
        sys.stdout.writelines(diff)
        stale.append(f"{args.pyproject}: {HEADER} is out of date")
    if page is None:
        stale.append(f"{doc}: missing")
    else:
        diff = _diff(page, generated_doc(), doc, "the page")
        if diff:
            sys.stdout.writelines(diff)
            stale.append(f"{doc}: out of date")
    for line in stale:
        print(f"{line}: python -m florg_tools.settings --write")
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
