"""lab/florg_lab/swings.py on hand-made run folders."""

from __future__ import annotations

import json
from pathlib import Path

from florg_lab.swings import swing_table


def _run(root: Path, name: str, lr: float, method: str, accuracy: list[float], done=True):
    folder = root / name
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(
        json.dumps({"learning-rate": lr, "method": method, "seed": 0})
    )
    rows = [{"round": t, "accuracy": a} for t, a in enumerate(accuracy)]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    status = "finished" if done else "running"
    (folder / "summary.json").write_text(json.dumps({"status": status, "final-test-score": 0.6}))


def test_counts_one_class_rounds_and_the_largest_swing(tmp_path):
    _run(tmp_path, "b", 0.001, "florg", [0.49, 0.47, 0.47, 0.70, 0.47, 0.60])
    _run(tmp_path, "a", 0.0005, "fedit", [0.49, 0.47, 0.55, 0.60, 0.65, 0.66])
    _run(tmp_path, "c", 0.002, "florg", [0.5, 0.5], done=False)
    lines = swing_table(tmp_path, one_class=0.47).splitlines()
    assert len(lines) == 4  # header, separator, two finished runs, ordered by lr
    assert lines[2].startswith("| 0.0005 | fedit | 0.49 0.47 0.55 0.60 0.65 0.66 | 1 | 0.080 |")
    # rounds 1-5: 0.47 0.47 0.70 0.47 0.60 -> three at one class, largest change 0.23
    assert lines[3] == "| 0.001 | florg | 0.49 0.47 0.47 0.70 0.47 0.60 | 3 | 0.230 | 0.600 |"


def test_florg_table_sets_the_server_step_against_the_drops(tmp_path):
    from florg_lab.swings import florg_table

    folder = tmp_path / "florg"
    _run(tmp_path, "florg", 0.001, "florg", [0.5, 0.7, 0.5, 0.7, 0.5])
    _run(tmp_path, "fedit", 0.001, "fedit", [0.5, 0.7, 0.5, 0.7, 0.5])  # not FLoRG: no row
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    gram = [None, 0.1, 0.3, 0.1, 0.3]  # high exactly in the rounds that drop by 0.2
    drift = [None, 0.2, 0.2, 0.4, 0.4]
    for row, g, d in zip(rows, gram, drift, strict=True):
        row |= {"gram_rel_error": g, "drift": d}
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    lines = florg_table(tmp_path).splitlines()
    assert len(lines) == 3
    # |change| is 0.2 every round: no correlation can be computed
    assert lines[2] == (
        "| 0.001 | 0 | florg | 0.100-0.300 | 0.200-0.400 | – | – | 0.300 / 0.100 | 0.300 / 0.300 |"
    )
