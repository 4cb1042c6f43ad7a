"""florg_tools/experiments/results_doc.py: the report's tables land between the markers."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from florg_tools.experiments.results_doc import fill, sync

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "results-v1.md"

REPORT = """# Evidence: ev

## Tuning of `ev` (validation score, seed 0)

| combination | lr = 1 | chosen |
|---|---|---|
| method=florg | 0.7 | 1 |

## Test scores

### movie-sentiment

Chance (majority class of the 40 test examples): 0.5100; centralised reference: 0.7750

| method | lr |
|---|---|
| florg | 0.001 |

Test score per tested round, mean over seeds:

| method | round 0 |
|---|---|
| florg | 0.500 |

## Verdicts

| claim | verdict |
|---|---|
| FLoRG beats fedit | holds |

## Learning

| task | what | above chance, mean [95% CI] | bar | met |
|---|---|---|---|---|
| movie-sentiment | florg | +0.2000 [+0.1000, +0.3000] | mean ≥ 0.15 | yes |

## FLoRG's server step

### movie-sentiment

| variant | seeds | Gram error, mean over rounds |
|---|---|---|
| florg | 2 | 0.0500 [0.0400, 0.0600] |

![plot](plots/x.png)
"""

DOC = """# Results

<!-- STATUS -->

### Verdicts

<!-- VERDICTS -->

### Test scores

<!-- TESTS -->

<!-- TUNING -->

<!-- SERVER -->

<!-- LEARNING -->

## Appendix
"""


def test_sync_copies_each_table_and_replaces_an_earlier_copy(tmp_path):
    doc, report = tmp_path / "results.md", tmp_path / "README.md"
    doc.write_text(DOC)
    report.write_text(REPORT)
    sync(doc, report, "**Status: 1 of 2 runs.**")
    text = doc.read_text()
    assert "| FLoRG beats fedit | holds |" in text and "plots/x.png" not in text
    assert "#### movie-sentiment" in text and "| florg | 0.001 |" in text
    assert "Test score per tested round, mean over seeds:\n\n| method | round 0 |" in text
    assert "`ev`:\n\n| combination | lr = 1 | chosen |" in text
    assert "<!-- STATUS -->\n**Status: 1 of 2 runs.**\n<!-- /STATUS -->" in text
    server = "#### movie-sentiment\n\n| variant | seeds | Gram error, mean over rounds |"
    assert server in text and "| florg | 2 | 0.0500 [0.0400, 0.0600] |\n<!-- /SERVER -->" in text
    learning = "| movie-sentiment | florg | +0.2000 [+0.1000, +0.3000] | mean ≥ 0.15 | yes |"
    assert f"{learning}\n<!-- /LEARNING -->" in text
    report.write_text(REPORT.replace("| holds |", "| does not hold |"))
    sync(doc, report)  # a second copy replaces the first; the status stays
    text = doc.read_text()
    assert text.count("FLoRG beats fedit") == 1 and "| does not hold |" in text
    assert "**Status: 1 of 2 runs.**" in text and text.endswith("## Appendix\n")


def test_a_missing_marker_is_an_error():
    with pytest.raises(ValueError, match="VERDICTS"):
        fill("# nothing here", "VERDICTS", "x")


def test_the_v1_page_holds_the_published_report_and_leads_with_the_verdicts(tmp_path):
    """docs/results-v1.md takes the published report's tables unchanged (no marker lost or
    duplicated in its prose), and reads verdicts first: v1's verdicts, then the report's
    remaining tables."""
    doc = tmp_path / "results.md"
    doc.write_text(PAGE.read_text())
    sync(doc, ROOT / "evidence" / "evidence" / "README.md")
    assert doc.read_text() == PAGE.read_text()
    text = PAGE.read_text()
    order = [
        "# Protocol v1: the verdicts",
        "### What to conclude",
        "<!-- VERDICTS -->",
        "<!-- LEARNING -->",
        "## The report's tables",
        "<!-- TESTS -->",
        "<!-- TUNING -->",
        "<!-- SERVER -->",
    ]
    assert [text.count(part) for part in order] == [1] * len(order)
    assert [text.index(part) for part in order] == sorted(text.index(part) for part in order)


def test_published_runs_keep_config_metrics_and_summary_only():
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    listed = subprocess.run(
        ["git", "ls-files", "evidence"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.splitlines()
    in_runs = [path for path in listed if "/runs/" in path]
    assert in_runs, "no published run found"
    extra = [
        p for p in in_runs if Path(p).name not in ("config.json", "metrics.jsonl", "summary.json")
    ]
    assert not extra, extra[:5]
