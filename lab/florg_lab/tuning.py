"""The tuning stage of a grid: choose one value per combination on validation.

The paper's protocol ("we select the optimal learning rate from the range ..."), made
explicit: every combination of the tuning's ``per`` axes (task, method) runs every
candidate value at one seed; the value with the best validation ``score``, averaged over
the last three rounds (less round-to-round noise than the final round alone), is chosen.
Ties go to the earlier candidate. Test scores are never looked at here.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from florg_lab.communication import load_metrics
from florg_lab.grid import TUNING_BLOCK, TUNING_FILE, Grid, load_grid
from florg_lab.runs import is_finished, run_dir

__all__ = [
    "SELECT_ROUNDS",
    "best_value",
    "choose_tuned",
    "load_candidates",
    "load_choices",
    "next_candidate",
    "selection_score",
    "tuned_grid",
]

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


def best_value(scores: Mapping[float, float]) -> float:
    """The value with the best score; ties go to the smaller value."""
    return max(sorted(scores), key=lambda v: (scores[v], -v))


def next_candidate(
    scores: Mapping[float, float | None], factor: float, extensions_left: int
) -> float | None:
    """Evidence protocol v2: the next value to try when the best of ``scores`` lies at an
    end of the values tried (``factor`` times the largest, or the smallest divided by it);
    None when the choice is interior, when no extension is left, or while a value is
    unscored (None: it must finish first). ``factor`` <= 1 turns extension off."""
    if factor <= 1 or extensions_left <= 0 or len(scores) < 2:
        return None
    if any(score is None for score in scores.values()):
        return None
    best = best_value({v: float(s) for v, s in scores.items() if s is not None})
    if best == max(scores):
        return best * factor
    if best == min(scores):
        return best / factor
    return None


def choose_tuned(grid: Grid, out: Path) -> dict[str, Any]:
    """Score the finished tuning runs under ``out``, choose where every candidate has
    finished, and write ``<out>/tuning.json``; returns the document.

    With ``extend`` (protocol v2), a combination whose best value lies at an end of the
    values it has tried gets the next value past that end instead of a choice; its
    ``path`` (every value tried, in order) and ``candidates`` go into the document, which
    ``load_grid(path, choices, candidates)`` reads back."""
    tuning = grid.tuning
    if tuning is None:
        raise ValueError(f"grid {grid.name} has no tuning stage")
    table: dict[str, dict[str, Any]] = {}
    for run in grid.runs_in(TUNING_BLOCK):
        combo = tuning.combo(run.axes)
        entry = table.setdefault(combo, {"scores": {}, "runs": {}, "path": []})
        folder = run_dir(out, run)
        value = run.axes[tuning.key]
        score = None
        if is_finished(folder, run):
            summary = json.loads((folder / "summary.json").read_text())
            key = summary.get("val-score-key", "score")
            score = selection_score(load_metrics(folder / "metrics.jsonl"), key=key)
        entry["scores"][repr(value)] = score
        entry["runs"][repr(value)] = run.run_id
        entry["path"].append(value)
    choices, candidates = {}, {}
    for combo, entry in table.items():
        path = entry["path"]
        scores = {v: entry["scores"][repr(v)] for v in path}
        if any(score is None for score in scores.values()):
            if len(path) > len(tuning.values):
                candidates[combo] = path
            continue
        extensions_left = tuning.max_extensions - (len(path) - len(tuning.values))
        extra = next_candidate(scores, tuning.extend, extensions_left)
        if extra is not None:
            candidates[combo] = [*path, extra]
            continue
        if len(path) > len(tuning.values):
            candidates[combo] = path
        if tuning.extend > 1:
            chosen = best_value(scores)
        else:  # v1: ties go to the earlier candidate in the grid's order
            chosen = max(((s, -i, v) for i, (v, s) in enumerate(scores.items())))[2]
        entry["chosen"] = chosen
        entry["at-edge"] = len(path) > 1 and chosen in (min(path), max(path))
        choices[combo] = chosen
    document = {
        "key": tuning.key,
        "values": list(tuning.values),
        "seed": tuning.seed,
        "per": list(tuning.per),
        "select": f"validation score, mean of the last {SELECT_ROUNDS} rounds",
        "choices": choices,
        "table": table,
    }
    if tuning.extend > 1:
        document["extend"] = {"factor": tuning.extend, "max-extensions": tuning.max_extensions}
        document["candidates"] = candidates
    (out / TUNING_FILE).write_text(json.dumps(document, indent=2) + "\n")
    return document


def tuned_grid(grid: Grid, out: Path) -> Grid:
    """``grid`` re-read with the choices and extended candidates its finished tuning runs
    make (repeated while an extension's run has already finished, so a resumed grid
    reaches the same state as an uninterrupted one)."""
    if grid.tuning is None:
        return grid
    seen: dict[str, list[Any]] | None = None
    while True:
        document = choose_tuned(grid, out)
        candidates = document.get("candidates", {})
        grid = load_grid(grid.path, document["choices"], candidates)
        if candidates == seen:
            return grid
        seen = candidates


def load_choices(out: Path) -> dict[str, Any]:
    """The choices recorded in ``<out>/tuning.json`` (empty when there is none yet)."""
    try:
        return dict(json.loads((out / TUNING_FILE).read_text())["choices"])
    except (OSError, json.JSONDecodeError, KeyError, TypeError):
        return {}


def load_candidates(out: Path) -> dict[str, list[Any]]:
    """The extended candidate values recorded in ``<out>/tuning.json`` (empty if none)."""
    try:
        return dict(json.loads((out / TUNING_FILE).read_text()).get("candidates") or {})
    except (OSError, json.JSONDecodeError, AttributeError, TypeError):
        return {}


def tuning_markdown(document: dict[str, Any]) -> list[str]:
    """The tuning table: one row per combination, one column per candidate value (every
    value any combination tried, the extensions of protocol v2 included)."""
    values = list(document["values"])
    for entry in document["table"].values():
        values += [v for v in entry.get("path", []) if v not in values]
    values.sort()
    head = ["combination", *[f"{document['key']} = {v:g}" for v in values], "chosen"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for combo, entry in sorted(document["table"].items()):
        cells = []
        for v in values:
            score = entry["scores"].get(repr(v))
            cells.append("–" if score is None else f"{score:.4f}")
        tried = entry.get("path") or document["values"]
        lines.append(f"| {combo} | " + " | ".join(cells) + f" | {_chosen_cell(entry, tried)} |")
    return lines


def _chosen_cell(entry: dict[str, Any], values: list[Any]) -> str:
    """The chosen value, marked when it sits at an end of the values tried: the best
    value may then lie outside them (the method is possibly under-tuned)."""
    chosen = entry.get("chosen")
    if chosen is None:
        return "–"
    if len(values) > 1 and chosen == max(values):
        return f"{chosen:g} (largest tried)"
    if len(values) > 1 and chosen == min(values):
        return f"{chosen:g} (smallest tried)"
    return f"{chosen:g}"
