"""Parameters transmitted until a target metric is reached, on hand-made metrics rows."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from florg_lab.communication import (
    communication_table,
    format_params,
    load_metrics,
    params_to_target,
)

PER_ROUND = 1000  # up and down parameters per round in the fixtures below


def _rows(accuracies: list[float | None], per_round: int = PER_ROUND) -> list[dict[str, Any]]:
    """metrics.jsonl-like rows; round r has cum-up = cum-down = r * per_round."""
    return [
        {
            "round": r,
            "accuracy": acc,
            "up-params": per_round if r else 0,
            "down-params": per_round if r else 0,
            "cum-up-params": r * per_round,
            "cum-down-params": r * per_round,
        }
        for r, acc in enumerate(accuracies)
    ]


ACCS = [0.30, 0.50, 0.60, 0.70, 0.75]


def test_reached_exactly_at_a_round() -> None:
    # 0.60 is first met (>=) at round 2: 2 rounds * (1000 up + 1000 down).
    assert params_to_target(_rows(ACCS), 0.60) == 4000


def test_reached_between_values() -> None:
    # first accuracy >= 0.55 is 0.60 at round 2.
    assert params_to_target(_rows(ACCS), 0.55) == 4000


def test_reached_only_at_last_round() -> None:
    assert params_to_target(_rows(ACCS), 0.72) == 8000


def test_never_reached() -> None:
    assert params_to_target(_rows(ACCS), 0.80) is None
    assert params_to_target([], 0.5) is None


def test_reached_at_round_zero_costs_nothing() -> None:
    assert params_to_target(_rows(ACCS), 0.30) == 0
    assert params_to_target(_rows(ACCS), 0.10) == 0


def test_first_round_wins_even_if_metric_drops_later() -> None:
    assert params_to_target(_rows([0.1, 0.9, 0.2, 0.95]), 0.85) == 2000


def test_rows_out_of_order_are_sorted_by_round() -> None:
    rows = _rows(ACCS)
    shuffled = [rows[4], rows[2], rows[0], rows[3], rows[1]]
    assert params_to_target(shuffled, 0.60) == 4000
    assert params_to_target(shuffled, 0.72) == 8000
    assert params_to_target(shuffled, 0.30) == 0


def test_rows_without_metric_are_skipped_and_other_metric() -> None:
    rows = _rows([0.2, None, 0.9])
    assert params_to_target(rows, 0.5) == 4000
    for row, f1 in zip(rows, [10.0, 40.0, 60.0], strict=True):
        row["f1"] = f1
    assert params_to_target(rows, 40.0, metric="f1") == 2000


def test_up_and_down_are_both_counted() -> None:
    rows = [
        {"round": 0, "accuracy": 0.1, "cum-up-params": 0, "cum-down-params": 0},
        {"round": 1, "accuracy": 0.9, "cum-up-params": 300, "cum-down-params": 1200},
    ]
    assert params_to_target(rows, 0.5) == 1500


def test_communication_table() -> None:
    runs = {
        "florg": _rows(ACCS, per_round=100),
        "fedit": _rows([0.30, 0.40, 0.50, 0.55, 0.65], per_round=4_100_000),
    }
    table = communication_table(runs, [0.5, 0.7])
    assert table == [
        {"method": "florg", "target": 0.5, "params": 200},
        {"method": "florg", "target": 0.7, "params": 600},
        {"method": "fedit", "target": 0.5, "params": 2 * 2 * 4_100_000},
        {"method": "fedit", "target": 0.7, "params": None},
    ]
    assert [format_params(e["params"]) for e in table] == [
        "2.00e+02",
        "6.00e+02",
        "1.64e+07",
        "not reached",
    ]


def test_format_params() -> None:
    assert format_params(8_200_000) == "8.20e+06"
    assert format_params(0) == "0.00e+00"
    assert format_params(None) == "not reached"


def test_load_metrics_round_trip_skips_blank_lines(tmp_path: Path) -> None:
    rows = _rows(ACCS)
    path = tmp_path / "metrics.jsonl"
    lines = [json.dumps(r) for r in rows]
    path.write_text("\n".join(lines[:2]) + "\n\n   \n" + "\n".join(lines[2:]) + "\n")
    loaded = load_metrics(path)
    assert loaded == rows
    assert params_to_target(loaded, 0.60) == 4000


def test_load_metrics_bad_line_names_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    good = json.dumps(_rows(ACCS)[0])
    path.write_text(f'{good}\n\n{{"round": 1, "accuracy": \n{good}\n')
    with pytest.raises(ValueError, match=r"metrics\.jsonl: line 3") as info:
        load_metrics(path)
    assert str(path) in str(info.value)


def test_load_metrics_non_object_line(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text("[1, 2]\n")
    with pytest.raises(ValueError, match="line 1"):
        load_metrics(path)
