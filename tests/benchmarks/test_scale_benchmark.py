"""benchmarks/scale (docs/benchmarks.md, "The cost of scale"): the per-round arithmetic on
hand-made rows, the cells' syntax, and the --quick run through the real simulation."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.scale.measure import Cell, round_measurements
from benchmarks.scale.scale_benchmark import parse_cells, summary_row, table

ROOT = Path(__file__).resolve().parents[2]


def test_a_round_is_split_into_training_and_everything_else():
    """W = the rows' elapsed difference minus the server's evaluation; a client's time is
    W A / K, of which T trained; the training-only bound K T / A."""
    rows = [
        {"round": 0, "elapsed-seconds": 5.0, "eval-seconds": 1.0},
        {"round": 1, "elapsed-seconds": 30.0, "eval-seconds": 1.0, "client-train-seconds": 0.5,
         "agg-seconds": 0.02, "clients": 10},
        {"round": 2, "elapsed-seconds": 40.0, "eval-seconds": 1.0, "test-seconds": 1.0,
         "client-train-seconds": 0.4, "agg-seconds": 0.03, "clients": 10},
    ]  # fmt: skip
    out = round_measurements(rows, Cell(100, 10), actors=2)
    assert [r["round"] for r in out] == [1, 2]
    second = out[1]
    assert second["round-seconds"] == pytest.approx(8.0)
    assert second["client-seconds"] == pytest.approx(8.0 * 2 / 10)
    assert second["other-seconds"] == pytest.approx(1.6 - 0.4)
    assert second["overhead-ratio"] == pytest.approx(1.2 / 0.4)
    assert second["training-bound-seconds"] == pytest.approx(10 * 0.4 / 2)
    result = {"nodes": 100, "per-round": 10, "rounds": out, "actors": 2,
              "peak-memory-bytes": 3 * 2**30, "idle-memory-bytes": 2**30}  # fmt: skip
    row = summary_row(result)  # the rounds after the first
    assert row["rounds"] == [2] and row["round-seconds"] == pytest.approx(8.0)
    assert row["above-idle-gib"] == pytest.approx(2.0)
    assert "| 100 | 10 | 8.0 | 2.0 |" in table([row])


def test_cells_are_n_by_k_with_k_at_most_n():
    assert parse_cells("10x10, 1000x500") == (Cell(10, 10), Cell(1000, 500))
    for bad in ("10x20", "10", "0x0", "ax3"):
        with pytest.raises(Exception, match="NxK"):
            parse_cells(bad)


@pytest.mark.integration
def test_the_quick_run_writes_its_table_json_and_plot(tmp_path):
    env = {**os.environ, "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1"}
    out, work = tmp_path / "out", tmp_path / "work"
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.scale.scale_benchmark", "--quick",
         "--out", str(out), "--work", str(work)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "| N | K | round wall (s)" in done.stdout
    (result,) = json.loads((out / "scale.json").read_text())
    assert result["nodes"] == 4 and result["per-round"] == 2 and result["actors"] >= 1
    assert [r["round"] for r in result["rounds"]] == [1, 2]
    for r in result["rounds"]:
        assert r["clients"] == 2 and r["train-seconds"] > 0 and r["round-seconds"] > 0
        assert r["agg-seconds"] > 0
    assert result["peak-memory-bytes"] > result["idle-memory-bytes"] > 0
    assert (out / "scale.png").stat().st_size > 0 and (out / "scale.md").is_file()
