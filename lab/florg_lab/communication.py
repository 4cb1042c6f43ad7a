"""Communication cost to reach a target metric, from a run's metrics.jsonl."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

__all__ = ["communication_table", "format_params", "load_metrics", "params_to_target"]


def load_metrics(path: str | Path) -> list[dict[str, Any]]:
    """Read a metrics.jsonl file: one JSON object per line, blank lines skipped."""
    path = Path(path)
    rows: list[dict[str, Any]] = []
    with path.open(encoding="utf-8") as handle:
        for line_no, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}: line {line_no}: invalid JSON ({exc.msg})") from exc
            if not isinstance(row, dict):
                raise ValueError(f"{path}: line {line_no}: expected a JSON object")
            rows.append(row)
    return rows


def _total_params(row: dict[str, Any]) -> int:
    """Cumulative parameters transmitted up to and including this row's round."""
    return int(row.get("cum-up-params", 0)) + int(row.get("cum-down-params", 0))


def params_to_target(
    rows: Iterable[dict[str, Any]], target: float, metric: str = "accuracy"
) -> int | None:
    """Cumulative up + down parameters at the first round whose ``metric`` >= ``target``.

    Rows are taken in ``round`` order; rows with no value for ``metric`` are skipped.
    Round 0 (before training) counts with 0 parameters. Returns None if never reached.
    """
    for row in sorted(rows, key=lambda r: r["round"]):
        value = row.get(metric)
        if value is None or value < target:
            continue
        return 0 if row["round"] == 0 else _total_params(row)
    return None


def communication_table(
    runs: dict[str, list[dict[str, Any]]], targets: list[float], metric: str = "accuracy"
) -> list[dict[str, Any]]:
    """One entry per method and target: ``{"method", "target", "params"}`` (None: not reached)."""
    return [
        {"method": name, "target": target, "params": params_to_target(rows, target, metric)}
        for name, rows in runs.items()
        for target in targets
    ]


def format_params(n: int | None) -> str:
    """Render a parameter count as e.g. ``8.20e+06``, or ``not reached`` for None."""
    return "not reached" if n is None else f"{n:.2e}"
