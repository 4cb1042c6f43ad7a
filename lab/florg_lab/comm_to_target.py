"""Communication to a target score: the parameters a method sends before its held-out test
score reaches a target, from a grid's published runs.

The measure, per method, over its runs at the chosen learning rate (every seed):

- **parameters sent** are counted *per client*, uplink + downlink: each round's
  ``up-params`` + ``down-params`` (the metrics row's totals over the round's clients)
  divided by the clients the round sent a training message to (``clients`` + ``screened``
  + ``rejected`` + ``failures``), summed over the rounds up to and including the test
  round, round 0 included (nothing travels there, except a method that initialises its
  adapter from its clients, such as Fed-SB); the counts are exact, so seeds agree and
  the mean over seeds is the count;
- **the score** at a test round is the mean over seeds of each run's held-out test score
  (its ``test-score-key``: FedSA-LoRA's personalised models), at the rounds every seed
  was tested;
- **the target** is FedIT's final seed-mean test score, or a fraction of it;
- **parameters to the target** are the cumulative parameters per client at the first test
  round where the seed-mean score reaches the target (>=); a method that never reaches it
  is *not reached*, with its best seed-mean score; per seed, the first test round where
  that seed's own score reaches the target, and how many seeds did.

The verdict page's blocks and figures (``python -m florg_lab.results_doc``)
call :func:`chosen_runs` then :func:`curves` (protocol v2's grids, read by their
``summary.json``) or :func:`from_long_budget` (the long-budget grid, read by its
``tuning.json``), then :func:`markdown` and :func:`plot`. (One run's totals over all
clients, to a target of one's choosing: :mod:`florg_lab.communication`.)
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from florg_lab import long_budget as lb
from florg_lab.long_budget import Run
from florg_lab.page_text import Evidence, method_name, task_name
from florg_lab.page_v2 import EXACT, V2, exact_methods, task_folders

__all__ = [
    "BYTES",
    "PARAMS",
    "TARGET_METHOD",
    "Curve",
    "Reach",
    "Source",
    "Unit",
    "chosen_runs",
    "cumulative_params",
    "curve",
    "curves",
    "first_reach",
    "from_long_budget",
    "markdown",
    "plot",
    "targets",
]

TARGET_METHOD = "fedit"  # the target is this method's final seed-mean test score


# --- counting ----------------------------------------------------------------------------


def participants(row: dict[str, Any]) -> int:
    """The clients a round sent a training message to: those aggregated (``clients``) plus
    those screened out, rejected or failed (a failed client received the model, a rejected
    or screened one sent its update too)."""
    return sum(int(row.get(key) or 0) for key in ("clients", "screened", "rejected", "failures"))


@dataclass(frozen=True)
class Unit:
    """What is counted: the metrics rows' keys (uplink, downlink; the round's totals over
    its clients) and the words the table and the figure use for it."""

    keys: tuple[str, str]
    noun: str  # in a sentence: "Parameters are counted per client"
    short: str  # in a column's head: "params per client per round"
    axis: str  # the figure's x label


PARAMS = Unit(("up-params", "down-params"), "Parameters", "params",
              "parameters sent per client, uplink + downlink, cumulative")  # fmt: skip
# the serialised content of every message, as it travelled (its encoding's bytes)
BYTES = Unit(("uplink-bytes", "downlink-bytes"), "Bytes", "bytes",
             "bytes sent per client (message content), uplink + downlink, cumulative")  # fmt: skip


def cumulative_params(rows: Sequence[dict[str, Any]], unit: Unit = PARAMS) -> dict[int, float]:
    """round -> parameters (``unit``: what is counted) per client, uplink + downlink, summed
    over the rounds up to and including it (rows taken in round order; round 0 counts what
    it sent, usually 0)."""
    up, down = unit.keys
    total, out = 0.0, {}
    for row in sorted(rows, key=lambda r: int(r["round"])):
        sent = int(row.get(up) or 0) + int(row.get(down) or 0)
        if sent:
            clients = participants(row)
            if clients == 0:
                raise ValueError(f"round {row['round']}: {up} sent but no client counted")
            total += sent / clients
        out[int(row["round"])] = total
    return out


def first_reach(scores: Mapping[int, float], target: float) -> int | None:
    """The first round (in round order) whose score is at least ``target``; None if none."""
    return next((t for t in sorted(scores) if scores[t] >= target), None)


# --- per method --------------------------------------------------------------------------


@dataclass(frozen=True)
class Reach:
    """Where a method's seed-mean test score first reaches ``target``."""

    target: float
    round: int | None  # None: not reached
    params: float | None  # cumulative parameters per client at that round
    best: float  # the best seed-mean test score, and its round
    best_round: int
    seed_rounds: dict[int, int | None]  # seed -> its own first round at the target

    @property
    def seeds_reached(self) -> int:
        return sum(r is not None for r in self.seed_rounds.values())


@dataclass(frozen=True)
class Curve:
    """One method's seed-mean test score against its cumulative parameters per client."""

    method: str
    seeds: tuple[int, ...]
    rounds: tuple[int, ...]  # the test rounds every seed has
    params: tuple[float, ...]  # cumulative parameters per client at each of them
    scores: tuple[float, ...]  # mean test score over seeds at each of them
    per_seed: dict[int, dict[int, float]]  # seed -> test round -> test score
    per_round: float  # parameters per client per round: the last round's cumulative / rounds

    @property
    def final(self) -> float:
        return self.scores[-1]

    def best(self) -> int:
        """The index of the best seed-mean score (the earliest, on a tie)."""
        return max(range(len(self.scores)), key=lambda i: self.scores[i])

    def reach(self, target: float) -> Reach:
        index = next((i for i, s in enumerate(self.scores) if s >= target), None)
        best = self.best()
        return Reach(
            target=target,
            round=None if index is None else self.rounds[index],
            params=None if index is None else self.params[index],
            best=self.scores[best],
            best_round=self.rounds[best],
            seed_rounds={s: first_reach(self.per_seed[s], target) for s in self.seeds},
        )


def curve(method: str, runs: Mapping[int, Run], unit: Unit = PARAMS) -> Curve:
    """``method``'s curve over its runs (seed -> run; at least one), counting ``unit``."""
    if not runs:
        raise ValueError(f"{method}: no run")
    seeds = tuple(sorted(runs))
    per_seed = {s: runs[s].series(runs[s].test_key) for s in seeds}
    cumulative = {s: cumulative_params(runs[s].rows, unit) for s in seeds}
    rounds = sorted(set.intersection(*(set(per_seed[s]) & set(cumulative[s]) for s in seeds)))
    if not rounds:
        raise ValueError(f"{method}: no test round that every seed has")
    last = {s: max(cumulative[s]) for s in seeds}
    return Curve(
        method=method,
        seeds=seeds,
        rounds=tuple(rounds),
        params=tuple(statistics.fmean(cumulative[s][t] for s in seeds) for t in rounds),
        scores=tuple(statistics.fmean(per_seed[s][t] for s in seeds) for t in rounds),
        per_seed=per_seed,
        per_round=statistics.fmean(cumulative[s][last[s]] / max(last[s], 1) for s in seeds),
    )


def curves(runs: Mapping[str, Mapping[int, Run]]) -> dict[str, Curve]:
    """method -> its curve, for every method with runs (in ``runs``' order)."""
    return {method: curve(method, by_seed) for method, by_seed in runs.items() if by_seed}


def targets(found: Mapping[str, Curve], fractions: Sequence[float]) -> list[float]:
    """Each fraction of FedIT's final seed-mean test score; empty without FedIT."""
    reference = found.get(TARGET_METHOD)
    return [] if reference is None else [f * reference.final for f in fractions]


# --- reading protocol v2's grids ---------------------------------------------------------


@dataclass(frozen=True)
class Source:
    """One grid's published evidence: its ``summary.json`` (per task and method, the chosen
    learning rate ``lr`` and the ``seeds``), its run folders, and the methods expected of it
    (None: every method its summary names)."""

    summary: str
    folders: tuple[str, ...]
    methods: tuple[str, ...] | None = None


def chosen_runs(
    root: Path, sources: Sequence[Source], task: str
) -> tuple[dict[str, dict[int, Run]], list[str]]:
    """(method -> seed -> its finished run of ``task`` at the summary's chosen learning rate,
    the methods expected but not published: no summary, no entry, or no such run). A method
    already found in an earlier source is not read again."""
    found: dict[str, dict[int, Run]] = {}
    missing: list[str] = []
    for source in sources:
        path = root / source.summary
        entries = json.loads(path.read_text())["tasks"].get(task, {}) if path.is_file() else {}
        entries = entries.get("methods", {}) if entries else {}
        expected = source.methods if source.methods is not None else tuple(entries)
        wanted = [m for m in expected if m not in found]
        runs = [
            run
            for folder in source.folders
            if (root / folder).is_dir()
            for run in lb.runs_in(root / folder)
            if run.task == task and run.method in wanted
        ]
        for method in wanted:
            entry = entries.get(method)
            mine = {
                run.seed: run
                for run in runs
                if entry is not None
                and run.method == method
                and run.seed in entry["seeds"]
                and run.learning_rate is not None
                and math.isclose(run.learning_rate, entry["lr"], rel_tol=1e-9)
            }
            if mine:
                found[method] = dict(sorted(mine.items()))
            else:
                missing.append(method)
    return found, missing


def from_long_budget(results: Path, methods: Sequence[str]) -> tuple[dict[str, Curve], list[str]]:
    """The curves of ``methods``' chosen runs in a long-budget grid's results folder (read by
    :func:`florg_lab.long_budget.chosen_runs`, by its ``tuning.json``), and
    the methods with none yet."""
    runs = lb.chosen_runs(results)
    found = curves({m: runs[m] for m in methods if m in runs})
    return found, [m for m in methods if m not in runs]


# --- the page's text and figure ----------------------------------------------------------


def _count(value: float) -> str:
    return f"{value:,.0f}"


def markdown(
    found: Mapping[str, Curve],
    missing: Sequence[str],
    fractions: Sequence[float] = (1.0,),
    name: Callable[[str], str] = str,
    unit: Unit = PARAMS,
) -> str:
    """The target and the counting in words, then the table, one row per target and
    method: parameters per client per round, the target, the first test round where the
    seed-mean score reaches it, the cumulative parameters per client there and their ratio
    to FedIT's, and each seed's own first round; then one line naming the methods expected
    but not published yet."""
    levels = targets(found, fractions)
    reference = found.get(TARGET_METHOD)
    ref_name = name(TARGET_METHOD)
    if reference is None:
        lines = [f"Target: {ref_name}'s final seed-mean test score; {ref_name} is not "
                 "published yet, so there is no target (each method's best instead)."]  # fmt: skip
    else:
        others = [f"{f:.0%} of it, {t:.3f}" for f, t in zip(fractions, levels, strict=True)
                  if f != 1]  # fmt: skip
        lines = [
            f"Target: {ref_name}'s final seed-mean test score, {reference.final:.3f} (round "
            f"{reference.rounds[-1]}, {len(reference.seeds)} seeds)"
            + "".join(f"; {other}" for other in others)
            + f". {unit.noun} are counted per client, uplink + downlink, summed over rounds; "
            "a score is known at the test rounds only ("
            + ", ".join(str(t) for t in reference.rounds)
            + "), so a target is reached at the first of them where the mean over seeds "
            "is at or above it."
        ]
    seeds = sorted({s for c in found.values() for s in c.seeds})
    head = [
        "method", "seeds", f"{unit.short} per client per round", "target",
        "first test round at target (seed mean)", f"{unit.short} per client to target",
        f"/ {ref_name}'s", "seeds at target: first test round, seed "
        + " / ".join(str(s) for s in seeds),
    ]  # fmt: skip
    lines += ["", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for target in levels:
        assert reference is not None  # levels is empty without it
        at_reference = reference.reach(target)
        for method, found_curve in found.items():
            cells = [name(method), str(len(found_curve.seeds)), _count(found_curve.per_round)]
            cells += _reach_cells(found_curve.reach(target), at_reference, seeds)
            lines.append("| " + " | ".join(cells) + " |")
    if not levels:  # no target: each method's best seed-mean score instead
        for method, found_curve in found.items():
            best = found_curve.best()
            cells = [name(method), str(len(found_curve.seeds)), _count(found_curve.per_round),
                     "–", f"– (best {found_curve.scores[best]:.3f}, round "
                     f"{found_curve.rounds[best]})", "–", "–", "–"]  # fmt: skip
            lines.append("| " + " | ".join(cells) + " |")
    if missing:
        lines += ["", ", ".join(name(m) for m in missing) + ": not published yet."]
    return "\n".join(lines)


def _reach_cells(reach: Reach, reference: Reach, seeds: Sequence[int]) -> list[str]:
    """The target, reach and per-seed cells of one row (a seed the method has no run for:
    ``n/a``; a seed that never reaches the target: ``–``)."""
    rounds = reach.seed_rounds
    per_seed = " / ".join(
        "n/a" if s not in rounds else "–" if rounds[s] is None else str(rounds[s]) for s in seeds
    )
    at_seeds = f"{reach.seeds_reached} of {len(rounds)}: {per_seed}"
    if reach.round is None or reach.params is None:
        best = f"not reached (best {reach.best:.3f}, round {reach.best_round})"
        return [f"{reach.target:.3f}", best, "–", "–", at_seeds]
    ratio = "–" if not reference.params else f"{reach.params / reference.params:.3f}"
    return [f"{reach.target:.3f}", str(reach.round), _count(reach.params), ratio, at_seeds]


def plot(
    found: Mapping[str, Curve],
    path: Path,
    fractions: Sequence[float] = (1.0,),
    title: str = "",
    name: Callable[[str], str] = str,
    unit: Unit = PARAMS,
) -> None:
    """Seed-mean test score against cumulative parameters (``unit``) per client (log axis), every
    method on one chart, the targets as dashed lines (once FedIT's curve is in). Round 0 is
    left out where nothing has travelled yet (0 has no place on a log axis)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for method, found_curve in found.items():
        points = [(p, s) for p, s in zip(found_curve.params, found_curve.scores, strict=True)
                  if p > 0]  # fmt: skip
        if points:
            xs, ys = zip(*points, strict=True)
            ax.plot(xs, ys, marker="o", markersize=3,
                    label=f"{name(method)} (n = {len(found_curve.seeds)})")  # fmt: skip
    styles = ("--", ":", "-.")
    levels = targets(found, fractions)  # none until FedIT's curve is in: no target lines yet
    for i, (fraction, target) in enumerate(zip(fractions, levels, strict=bool(levels))):
        ax.axhline(target, linestyle=styles[i % len(styles)], linewidth=0.9, color="grey",
                   label=f"target: {fraction:.0%} of {name(TARGET_METHOD)}'s final")  # fmt: skip
    ax.set_xscale("log")
    ax.set_xlabel(unit.axis)
    ax.set_ylabel("held-out test score, mean over seeds")
    if title:
        ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --- the verdict page's blocks and figures (python -m florg_lab.results_doc) -------------

# The targets (fractions of FedIT's final seed-mean test score) and each task's figure
PAGE_FRACTIONS = (1.0, 0.9)
PAGE_FIGURE = "lab/evidence/evidence-v2/plots/comm-to-target-{task}.png"


@cache
def v2_curves(ev: Evidence, task: str) -> tuple[dict[str, Curve], list[str]]:
    """Protocol v2's chosen runs of ``task``, the exact methods' grid's beside them: each
    method's curve, and the methods not published."""
    v2, exact = task_folders(task)
    sources = (Source(V2, (v2,)), Source(EXACT, (exact,), exact_methods()))
    runs, missing = chosen_runs(ev.root, sources, task)
    return curves(runs), missing


def page_block(task: str) -> Callable[[Evidence], str]:
    """Protocol v2 on ``task``: the parameters each method sends to reach FedIT's final
    score."""

    def make(ev: Evidence) -> str:
        return markdown(*v2_curves(ev, task), PAGE_FRACTIONS, method_name)

    return make


def page_figure(task: str) -> Callable[[Evidence, Path], None]:
    def draw(ev: Evidence, path: Path) -> None:
        title = f"protocol v2, {task_name(task)}: test score against parameters sent"
        plot(v2_curves(ev, task)[0], path, PAGE_FRACTIONS, title, method_name)

    return draw


def long_budget_block(ev: Evidence) -> str:
    """The long-budget grid's chosen runs (its own reader, by tuning.json), as far as they
    are published."""
    found = from_long_budget(ev.root / lb.PUBLISHED, lb.methods())
    return markdown(*found, PAGE_FRACTIONS, method_name)
