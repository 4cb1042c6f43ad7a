"""docs/settings.md is generated from RunConfig (florg_tools/settings.py), like pyproject's
``[tool.flwr.app.config]``: stale when a setting is added, removed or changed."""

from __future__ import annotations

from pathlib import Path

from florg_tools import settings as settings_tool
from flower_app.methods.registry import method_names
from flower_app.settings.config import schema

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "settings.md"


def test_the_settings_page_is_the_generated_one():
    """Regenerate with python -m florg_tools.settings --write."""
    assert DOC.read_text(encoding="utf-8") == settings_tool.generated_doc()


def test_the_page_has_one_row_per_key_with_default_help_and_groups():
    settings, own, methods = settings_tool.generated_doc().split("## Methods")
    rows = [line for line in settings.splitlines() if line.startswith("| `")]
    own_rows = [line for line in own.splitlines() if line.startswith("| `")]
    ordered = [key for _, keys in settings_tool.key_sections() for key in keys]
    assert [row.split("`")[1] for row in rows + own_rows] == ordered
    assert sorted(ordered) == sorted(schema())
    # a method's own key names the methods that read it
    fedex = next(row for row in own_rows if row.startswith("| `fedex-residual` |"))
    assert "| `fedex-lora`: " in fedex
    # then one row per registered method, from its declaration
    method_rows = [line for line in methods.splitlines() if line.startswith("| `")]
    assert [row.split("`")[1] for row in method_rows] == list(method_names())
    rolora = next(row for row in method_rows if row.startswith("| `rolora` |"))
    assert "up in rounds 1 / 2: B / A" in rolora and rolora.endswith("| no | mean |")
    rank = next(row for row in rows if row.startswith("| `rank` |"))
    assert rank == f"| `rank` | `4` | {schema()['rank'].help} | model |"
    rounds = next(row for row in rows if row.startswith("| `num-server-rounds` |"))
    assert rounds.endswith("| – |")  # affects no cached artefact


def _copy(tmp_path: Path) -> tuple[Path, Path]:
    pyproject, doc = tmp_path / "pyproject.toml", tmp_path / "docs" / "settings.md"
    pyproject.write_text((ROOT / "pyproject.toml").read_text(encoding="utf-8"), encoding="utf-8")
    doc.parent.mkdir()
    doc.write_text(DOC.read_text(encoding="utf-8"), encoding="utf-8")
    return pyproject, doc


def test_check_fails_on_a_stale_page_and_write_repairs_it(tmp_path, capsys):
    pyproject, doc = _copy(tmp_path)
    good = doc.read_text(encoding="utf-8")
    assert settings_tool.main(["--check", "--pyproject", str(pyproject)]) == 0
    doc.write_text(good.replace("| `rank` | `4` |", "| `rank` | `8` |"), encoding="utf-8")
    assert settings_tool.main(["--check", "--pyproject", str(pyproject)]) == 1
    out = capsys.readouterr().out
    assert "+| `rank` | `4` |" in out and f"{doc}: out of date" in out
    assert settings_tool.main(["--write", "--pyproject", str(pyproject)]) == 0
    assert doc.read_text(encoding="utf-8") == good
    doc.unlink()
    assert settings_tool.main(["--check", "--pyproject", str(pyproject), "--doc", str(doc)]) == 1
    assert f"{doc}: missing" in capsys.readouterr().out
