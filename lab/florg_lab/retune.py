"""What the tuning stage would choose on several seeds: re-score finished runs.

The evidence grids choose each (task, method)'s learning rate on one seed's validation
score (the paper's protocol, ``florg_lab.tuning``). Where that seed's
partition is unlike the others, the choice may not carry over. This reads finished runs
from any grid folders, scores each run as the tuning stage does (the validation score
named by the run's ``val-score-key``, mean of its last three rounds), and chooses each
combination's value on the mean over ``--seeds`` instead. Test scores are not looked at
for the choice; they are printed afterwards for the value chosen on the first seed alone
(the grids' choice) and for the value chosen on the mean, over every seed found, with
their paired difference when the two differ.

    python -m florg_lab.retune \
        lab/evidence/evidence/runs/evidence-snli lab/evidence/evidence-snli-seed-tuning/runs \
        --seeds 0 1 2 [--key learning-rate] [--per task method] [--chance 0.361] \
        [--only method=florg]

A run is a folder holding ``config.json`` (the resolved run config: the ``per`` axes,
``key`` and ``seed``), ``summary.json`` (``status: finished``) and ``metrics.jsonl``. The
same (combination, value, seed) found in two folders must agree on its validation score;
otherwise the command stops and names both.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from florg_lab.communication import load_metrics
from florg_lab.runs import finished_runs_under
from florg_lab.stats import mean_interval, paired_difference
from florg_lab.tuning import selection_score

__all__ = ["Choice", "RunScore", "choose", "find_runs", "main"]


@dataclass(frozen=True)
class RunScore:
    """One finished run: its combination, candidate value, seed and scores."""

    combo: str
    value: Any
    seed: int
    validation: float | None  # tuning's selection score; None when rounds are missing
    test: float | None  # the final round's test score (the run's ``test-score-key``)
    folder: Path


@dataclass(frozen=True)
class Choice:
    """A combination's candidates scored on ``seeds``, and the choice (None when a
    candidate lacks a seed)."""

    combo: str
    seeds: tuple[int, ...]
    scores: dict[Any, list[float | None]]  # value -> validation score per seed
    chosen: Any | None

    def mean(self, value: Any) -> float | None:
        scores = self.scores[value]
        if any(s is None for s in scores):
            return None
        return sum(scores) / len(scores)  # type: ignore[arg-type]


def _run_score(
    folder: Path, summary: dict[str, Any], config: dict[str, Any], key: str, per: Sequence[str]
) -> RunScore:
    """The finished run in ``folder``, scored."""
    missing = [k for k in (*per, key, "seed") if k not in config]
    if missing:
        raise ValueError(f"{folder}: config.json has no {', '.join(missing)}")
    rows = load_metrics(folder / "metrics.jsonl")
    validation = selection_score(rows, key=summary.get("val-score-key", "score"))
    test = summary.get("final-test-score")
    combo = ",".join(f"{k}={config[k]}" for k in per)
    return RunScore(combo, config[key], int(config["seed"]), validation, test, folder)


def find_runs(roots: Sequence[Path], key: str, per: Sequence[str]) -> list[RunScore]:
    """Every finished run directly under ``roots``; a run found twice is kept once."""
    found: dict[tuple[str, Any, int], RunScore] = {}
    for folder, summary, config in finished_runs_under(roots):
        run = _run_score(folder, summary, config, key, per)
        ident = (run.combo, run.value, run.seed)
        if ident in found and found[ident].validation != run.validation:
            raise ValueError(
                f"{found[ident].folder} and {folder} are the same run "
                f"({run.combo}, {key}={run.value}, seed {run.seed}) with different "
                f"validation scores ({found[ident].validation} vs {run.validation})"
            )
        found.setdefault(ident, run)
    return list(found.values())


def choose(runs: Sequence[RunScore], seeds: Sequence[int]) -> list[Choice]:
    """Per combination: each candidate's validation score at ``seeds`` and the value with
    the best mean (ties to the smaller value); no choice while any score is missing."""
    by_combo: dict[str, dict[Any, dict[int, float | None]]] = {}
    for run in runs:
        by_combo.setdefault(run.combo, {}).setdefault(run.value, {})[run.seed] = run.validation
    choices = []
    for combo, values in sorted(by_combo.items()):
        scores = {v: [values[v].get(s) for s in seeds] for v in sorted(values)}
        choice = Choice(combo, tuple(seeds), scores, None)
        means = [(choice.mean(v), v) for v in scores]
        if all(m is not None for m, _ in means):
            best = max(means, key=lambda t: t[0])[0]
            chosen = next(v for m, v in means if m == best)
            choice = Choice(combo, tuple(seeds), scores, chosen)
        choices.append(choice)
    return choices


def _cell(score: float | None) -> str:
    return "–" if score is None else f"{score:.3f}"


def _tests(runs: Sequence[RunScore], combo: str, value: Any) -> list[tuple[int, float]]:
    return sorted(
        (r.seed, float(r.test))
        for r in runs
        if r.combo == combo and r.value == value and r.test is not None
    )


def _test_line(runs: Sequence[RunScore], combo: str, value: Any, chance: float | None) -> str:
    tests = _tests(runs, combo, value)
    if not tests:
        return f"{value:g}: no test scores"
    per_seed = ", ".join(f"{s}: {t:.3f}" for s, t in tests)
    interval = mean_interval([t for _, t in tests])
    line = f"{value:g}: seeds {per_seed}; mean {interval}"
    if chance is not None and not math.isnan(interval.low):
        line += (
            f"; above chance {interval.mean - chance:+.3f} "
            f"[{interval.low - chance:+.3f}, {interval.high - chance:+.3f}]"
        )
    return line


def _paired_line(runs: Sequence[RunScore], combo: str, value: Any, other: Any) -> str:
    """The paired test difference value − other over the seeds both have."""
    a, b = dict(_tests(runs, combo, value)), dict(_tests(runs, combo, other))
    shared = sorted(set(a) & set(b))
    if len(shared) < 2:
        return f"{value:g} − {other:g}: fewer than two shared seeds"
    paired = paired_difference([a[s] for s in shared], [b[s] for s in shared])
    return (
        f"{value:g} − {other:g}, paired over seeds {', '.join(map(str, shared))}: "
        f"{paired.difference}, ahead on {paired.wins} of {len(shared)}"
    )


def report(runs: Sequence[RunScore], seeds: Sequence[int], key: str, chance: float | None) -> str:
    """The markdown table of validation scores and, per combination, the test scores of
    the one-seed and the mean-over-seeds choices."""
    choices = choose(runs, seeds)
    head = ["combination", key, *[f"seed {s}" for s in seeds], "mean", "chosen on"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    notes = []
    one_seed = {c.combo: c.chosen for c in choose(runs, seeds[:1])}
    for choice in choices:
        first = one_seed[choice.combo]
        for value, scores in choice.scores.items():
            marks = [
                m for m, v in ((f"seed {seeds[0]}", first), ("mean", choice.chosen)) if v == value
            ]
            cells = [choice.combo, f"{value:g}", *map(_cell, scores), _cell(choice.mean(value))]
            lines.append("| " + " | ".join([*cells, " and ".join(marks) or ""]) + " |")
        notes.append(f"{choice.combo}, final-round test:")
        for label, value in (
            (f"chosen on seed {seeds[0]}", first),
            ("chosen on the mean", choice.chosen),
        ):
            if value is None:
                notes.append(f"  {label}: no choice (a validation score is missing)")
            else:
                notes.append(f"  {label}: {_test_line(runs, choice.combo, value, chance)}")
        if None not in (first, choice.chosen) and first != choice.chosen:
            notes.append(f"  {_paired_line(runs, choice.combo, choice.chosen, first)}")
    return "\n".join([*lines, "", *notes])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folders", nargs="+", type=Path, help="folders holding run folders")
    parser.add_argument("--seeds", nargs="+", type=int, required=True, help="tuning seeds")
    parser.add_argument("--key", default="learning-rate", help="the tuned run-config key")
    parser.add_argument("--per", nargs="+", default=["task", "method"], help="one choice per")
    parser.add_argument("--chance", type=float, default=None, help="print scores above this")
    parser.add_argument(
        "--only", nargs="+", default=None, help="combinations containing one of these"
    )
    args = parser.parse_args(argv)
    if len(set(args.seeds)) != len(args.seeds):
        parser.error("--seeds repeats a seed")
    try:
        runs = find_runs(args.folders, args.key, args.per)
    except (OSError, ValueError) as err:
        print(f"retune: {err}")
        return 2
    if args.only:
        runs = [r for r in runs if any(text in r.combo for text in args.only)]
    if not runs:
        print(f"retune: no finished runs under {', '.join(map(str, args.folders))}")
        return 2
    print(report(runs, args.seeds, args.key, args.chance))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
