"""The tuning stage of a grid: choose one value per combination on validation.

The paper's protocol ("we select the optimal learning rate from the range ..."), made
explicit: every combination of the tuning's ``per`` axes (task, method) runs every
candidate value at one seed; the value with the best validation ``score``, averaged over
the last three rounds (less round-to-round noise than the final round alone), is chosen.
Ties go to the earlier candidate. Test scores are never looked at here.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from florg_tools.experiments.communication import load_metrics
from florg_tools.experiments.grid import TUNING_BLOCK, TUNING_FILE, Grid
from florg_tools.experiments.runs import is_finished, run_dir

__all__ = ["SELECT_ROUNDS", "choose_tuned", "load_choices", "selection_score"]

SELECT_ROUNDS = 3


def selection_score(
    rows: list[dict[str, Any]], last: int = SELECT_ROUNDS, key: str = "score"
) -> float | None:
    """Mean validation score ``key`` over the last ``last`` rounds (None if any is
    missing). ``key`` is what the run's summary names as its ``val-score-key``: the global
    model's ``score``, or a personal method's ``personalized-val-score``."""
    scored = sorted((r for r in rows if r.get("round", 0) > 0), key=lambda r: r["round"])
    tail = scored[-last:]
    if len(tail) < last or any(r.get(key) is None for r in tail):
        return None
    return sum(float(r[key]) for r in tail) / len(tail)


def choose_tuned(grid: Grid, out: Path) -> dict[str, Any]:
    """Score the finished tuning runs under ``out``, choose where every candidate has
    finished, and write ``<out>/tuning.json``; returns the document."""
    tuning = grid.tuning
    if tuning is None:
        raise ValueError(f"grid {grid.name} has no tuning stage")
    table: dict[str, dict[str, Any]] = {}
    for run in grid.runs_in(TUNING_BLOCK):
        combo = tuning.combo(run.axes)
        entry = table.setdefault(combo, {"scores": {}, "runs": {}})
        folder = run_dir(out, run)
        value = run.axes[tuning.key]
        score = None
        if is_finished(folder, run):
            summary = json.loads((folder / "summary.json").read_text())
            key = summary.get("val-score-key", "score")
            score = selection_score(load_metrics(folder / "metrics.jsonl"), key=key)
        entry["scores"][repr(value)] = score
        entry["runs"][repr(value)] = run.run_id
    choices = {}
    for combo, entry in table.items():
        scores = [(entry["scores"][repr(v)], i, v) for i, v in enumerate(tuning.values)]
        if any(score is None for score, _, _ in scores):
            continue
        best = max(scores, key=lambda t: (t[0], -t[1]))
        entry["chosen"] = best[2]
        choices[combo] = best[2]
    document = {
        "key": tuning.key,
        "values": list(tuning.values),
        "seed": tuning.seed,
        "per": list(tuning.per),
        "select": f"validation score, mean of the last {SELECT_ROUNDS} rounds",
        "choices": choices,
        "table": table,
    }
    (out / TUNING_FILE).write_text(json.dumps(document, indent=2) + "\n")
    return document


def load_choices(out: Path) -> dict[str, Any]:
    """The choices recorded in ``<out>/tuning.json`` (empty when there is none yet)."""
    try:
        return dict(json.loads((out / TUNING_FILE).read_text())["choices"])
    except (OSError, json.JSONDecodeError, KeyError, TypeError):
        return {}


def tuning_markdown(document: dict[str, Any]) -> list[str]:
    """The tuning table: one row per combination, one column per candidate value."""
    values = document["values"]
    head = ["combination", *[f"{document['key']} = {v:g}" for v in values], "chosen"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for combo, entry in sorted(document["table"].items()):
        cells = []
        for v in values:
            score = entry["scores"].get(repr(v))
            cells.append("–" if score is None else f"{score:.4f}")
        lines.append(f"| {combo} | " + " | ".join(cells) + f" | {_chosen_cell(entry, values)} |")
    return lines


def _chosen_cell(entry: dict[str, Any], values: list[Any]) -> str:
    """The chosen value, marked when it sits at an end of the candidate range: the best
    value may then lie outside the range (the method is possibly under-tuned)."""
    chosen = entry.get("chosen")
    if chosen is None:
        return "–"
    if len(values) > 1 and chosen == max(values):
        return f"{chosen:g} (largest tried)"
    if len(values) > 1 and chosen == min(values):
        return f"{chosen:g} (smallest tried)"
    return f"{chosen:g}"
