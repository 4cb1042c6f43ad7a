"""florg_lab.clipping: C for the private grid from non-private runs' rows."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from florg_lab.clipping import clipping_norms, main, run_norms


def _run(root: Path, name: str, method: str, medians: list[float | None], maxes=None) -> Path:
    run = root / name
    run.mkdir(parents=True)
    (run / "config.json").write_text(json.dumps({"method": method}))
    (run / "summary.json").write_text(json.dumps({"status": "finished"}))
    rows = [{"round": 0, "accuracy": 0.5}]  # round 0 trains nothing: no norms
    for t, m in enumerate(medians, start=1):
        row = {"round": t}
        if m is not None:
            row |= {"update-norm-median": m, "update-norm-max": (maxes or medians)[t - 1] * 2}
        rows.append(row)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run


def test_the_median_over_rounds_and_then_over_a_methods_runs(tmp_path, capsys):
    a = run_norms(_run(tmp_path, "a", "florg", [1.0, 3.0, 2.0, 10.0]))
    b = run_norms(_run(tmp_path, "b", "florg", [4.0, 4.0, 5.0]))
    c = run_norms(_run(tmp_path, "c", "fedit", [0.5, 0.7, 0.6]))
    assert a is not None and b is not None and c is not None
    assert (a.median, a.largest, a.rounds) == (2.5, 20.0, 4)
    assert clipping_norms([a, b, c]) == {"fedit": 0.6, "florg": pytest.approx(3.25)}
    assert main([str(tmp_path / n) for n in ("a", "b", "c")]) == 0
    out = capsys.readouterr().out
    assert "florg: dp-clipping-norm = 3.25" in out and "fedit: dp-clipping-norm = 0.6" in out


def test_runs_without_the_keys_are_named_and_unfinished_runs_are_an_error(tmp_path, capsys):
    old = _run(tmp_path, "old", "fedit", [None, None])
    assert run_norms(old) is None
    assert main([str(old)]) == 1
    assert "skipped" in capsys.readouterr().out
    (tmp_path / "busy").mkdir()
    with pytest.raises(ValueError, match="not a finished run"):
        run_norms(tmp_path / "busy")
    assert main([str(tmp_path / "busy")]) == 2
