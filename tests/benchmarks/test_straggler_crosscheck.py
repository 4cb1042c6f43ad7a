"""The deployment cross-check's arithmetic (benchmarks/overhead/straggler_crosscheck.py): the
two runs do matched work, a round's time leaves out evaluation and aggregation, the fitted
costs come back from rows made with known costs, and the ratios are async over sync."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.overhead.straggler_crosscheck import (
    fitted_costs,
    report,
    run_settings,
    training_seconds,
)


def test_sync_and_async_apply_the_same_client_updates():
    runs = run_settings(8, 3, 2, Path("/tmp/out"), quick=False)
    sync, buffered = runs["sync"], runs["async"]
    assert (
        sync["num-server-rounds"] * 8
        == buffered["num-server-rounds"] * buffered["async-buffer-size"]
    )
    assert sync["slow-partitions"] == buffered["slow-partitions"] == "0,4"
    different = {k for k in sync if sync[k] != buffered.get(k)}
    assert different == {"run-name", "round-mode", "num-server-rounds"}
    assert buffered["num-server-rounds"] == 12 and buffered["async-concurrency"] == 8
    with pytest.raises(ValueError, match="must divide"):
        run_settings(4, 3, 8, Path("/tmp/out"), quick=False)


def rows_with(overhead: float, delay: float, per_example: float, examples: int, rounds: int):
    """A deployed sync run's rows whose rounds took overhead + the slowest training + delay,
    plus evaluation and aggregation the measure must leave out."""
    table = [{"round": 0, "elapsed-seconds": 1.0}]
    for r in range(1, rounds + 1):
        train = per_example * examples * (1 + 0.1 * r)  # the slowest; the mean below
        spent = overhead + train + delay + 0.7 + 0.2  # + eval + agg
        table.append({"round": r, "elapsed-seconds": table[-1]["elapsed-seconds"] + spent,
                      "eval-seconds": 0.7, "agg-seconds": 0.2,
                      "client-train-seconds": per_example * examples,
                      "client-train-seconds-max": train})  # fmt: skip
    return table


def test_the_fit_recovers_the_costs_the_rows_were_made_with():
    table = rows_with(overhead=6.0, delay=20.0, per_example=0.02, examples=120, rounds=4)
    spent = training_seconds(table)
    assert spent == pytest.approx([6.0 + 2.4 * (1 + 0.1 * r) + 20.0 for r in range(1, 5)])
    costs = fitted_costs(table, delay=20.0, examples=120)
    assert costs["seconds-per-example"] == pytest.approx(0.02)
    assert costs["round-overhead"] == pytest.approx(6.0)
    assert costs["latency"] == pytest.approx(3.0)


def test_the_report_gives_async_over_sync_measured_and_predicted():
    lines, result = report(
        {"sync": 100.0, "async": 60.0}, {"sync": 90.0, "async": 45.0},
        {"round-overhead": 6.0, "latency": 3.0, "seconds-per-example": 0.02}, 20.0,
        {"pinned": False, "cores": 2, "nodes": 4},
    )  # fmt: skip
    assert result["ratio"] == {"measured": pytest.approx(0.6), "predicted": pytest.approx(0.5)}
    assert "| deployment, wall clock | 100.0 | 60.0 | 0.600 |" in lines
    assert "| virtual clock's prediction | 90.0 | 45.0 | 0.500 |" in lines
    assert "unpinned" in lines[-1]
