"""The local-training sweep's report: score and aggregation error against local steps a round.

    python -m florg_lab.local_steps RUNS [--reference florg] [--plot FILE] [--json FILE]
    python -m florg_lab.local_steps --rates TUNING_JSON  # 'method rate' lines to pin

RUNS holds the sweep's run folders (lab/grids/local-steps-sweep.yaml: equal client compute,
split into rounds of different lengths). Per method and steps a round: the final held-out
test score and the aggregation error (per run, the mean over its training rounds of the
row key ``ERROR_KEYS``), mean and 95% t interval over seeds; the reference minus each other
method, paired by seed. A key no run records is reported as missing. ``--rates`` prints a
tuned grid's choices (its tuning.json) for the runner to write over the CHOSEN-RATE lines.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from florg_lab.runs import finished_runs_under
from florg_lab.stats import Interval, Paired, mean_interval, paired_difference, verdict

__all__ = [
    "ERROR_KEYS",
    "Cell",
    "SweepRun",
    "cells",
    "chosen_rates",
    "load_runs",
    "markdown",
    "paired_rows",
    "plot",
]

# The row key of each method's aggregation error. FLoRG's is recorded (strategies/florg:
# ||A_new^T A_new - Q||_F / ||Q||_F, the rank-r truncation of the exact Gram aggregate);
# product_rel_gap, ||mean(B A) - mean(B) mean(A)||_F / ||mean(B A)||_F per layer (after
# rotation for FedRot-LoRA), mean over layers, is recorded by the server when the run sets
# product-gap = true (strategies/server/product_gap.py; the sweep's FedIT and FedRot-LoRA
# blocks do).
ERROR_KEYS = {
    "florg": "gram_rel_error",
    "florg-no-procrustes": "gram_rel_error",
    "fedit": "product_rel_gap",
    "fedrot-lora": "product_rel_gap",
}
DEFAULT_ERROR_KEY = "product_rel_gap"


@dataclass(frozen=True)
class SweepRun:
    method: str
    steps: int  # local steps a round
    rounds: int
    seed: int
    learning_rate: float
    test: float | None  # the final round's held-out test score
    error: float | None  # the mean over training rounds of the method's error key


@dataclass(frozen=True)
class Cell:
    """One method at one split: its runs' scores and errors over seeds."""

    method: str
    steps: int
    rounds: int
    learning_rate: float
    seeds: tuple[int, ...]
    test: Interval | None
    error: Interval | None
    error_key: str


def error_key(method: str) -> str:
    return ERROR_KEYS.get(method, DEFAULT_ERROR_KEY)


def _mean_over_rounds(rows: list[dict[str, Any]], key: str) -> float | None:
    """The mean of ``key`` over the training rounds (round >= 1) whose row records it."""
    values = [
        float(r[key])
        for r in rows
        if r.get("round", 0) >= 1 and isinstance(r.get(key), int | float) and not math.isnan(r[key])
    ]
    return sum(values) / len(values) if values else None


def _final_test(summary: dict[str, Any], rows: list[dict[str, Any]]) -> float | None:
    """summary.json's final-test-score, else the last row's test score (its test key)."""
    if isinstance(summary.get("final-test-score"), int | float):
        return float(summary["final-test-score"])
    key = str(summary.get("test-score-key") or "test-score")
    scored = [r for r in rows if isinstance(r.get(key), int | float)]
    return float(max(scored, key=lambda r: r["round"])[key]) if scored else None


def load_runs(root: Path) -> list[SweepRun]:
    """Every finished run directly under ``root``."""
    runs = []
    for folder, summary, config in finished_runs_under([root]):
        metrics = folder / "metrics.jsonl"
        lines = metrics.read_text().splitlines() if metrics.exists() else []
        rows = [json.loads(line) for line in lines if line.strip()]
        method = str(config["method"])
        runs.append(
            SweepRun(
                method=method,
                steps=int(config["local-steps"]),
                rounds=int(config.get("num-server-rounds", 0)),
                seed=int(config["seed"]),
                learning_rate=float(config["learning-rate"]),
                test=_final_test(summary, rows),
                error=_mean_over_rounds(rows, error_key(method)),
            )
        )
    return runs


def _interval(values: list[float]) -> Interval | None:
    return mean_interval(values) if values else None


def cells(runs: Sequence[SweepRun]) -> list[Cell]:
    """One cell per (method, steps), in method then steps order. Where a split ran at more
    than one rate (a re-pinned grid), the rate with the most seeds counts (ties: the
    smaller rate)."""
    by_split: dict[tuple[str, int], dict[float, list[SweepRun]]] = {}
    for run in runs:
        split = by_split.setdefault((run.method, run.steps), {})
        split.setdefault(run.learning_rate, []).append(run)
    out = []
    for (method, steps), by_rate in sorted(by_split.items()):
        rate = max(sorted(by_rate), key=lambda r: (len(by_rate[r]), -r))
        chosen = sorted(by_rate[rate], key=lambda r: r.seed)
        out.append(
            Cell(
                method=method,
                steps=steps,
                rounds=chosen[0].rounds,
                learning_rate=rate,
                seeds=tuple(r.seed for r in chosen),
                test=_interval([r.test for r in chosen if r.test is not None]),
                error=_interval([r.error for r in chosen if r.error is not None]),
                error_key=error_key(method),
            )
        )
    return out


def _by_seed(runs: Sequence[SweepRun], cell: Cell) -> dict[int, SweepRun]:
    return {
        r.seed: r
        for r in runs
        if (r.method, r.steps, r.learning_rate) == (cell.method, cell.steps, cell.learning_rate)
    }


def paired_rows(
    runs: Sequence[SweepRun], table: Sequence[Cell], reference: str
) -> list[tuple[int, str, Paired]]:
    """(steps, other method, reference − other test score paired by seed) at every split
    where both ran with at least two shared seeds."""
    by_key = {(c.method, c.steps): c for c in table}
    out = []
    for cell in table:
        ref = by_key.get((reference, cell.steps))
        if cell.method == reference or ref is None:
            continue
        mine, theirs = _by_seed(runs, ref), _by_seed(runs, cell)
        seeds = sorted(
            s for s in set(mine) & set(theirs)
            if mine[s].test is not None and theirs[s].test is not None
        )  # fmt: skip
        if len(seeds) >= 2:
            a = [float(mine[s].test) for s in seeds]  # type: ignore[arg-type]
            b = [float(theirs[s].test) for s in seeds]  # type: ignore[arg-type]
            out.append((cell.steps, cell.method, paired_difference(a, b)))
    return out


def _cell_text(value: Interval | None) -> str:
    return "—" if value is None else str(value)


def markdown(
    table: Sequence[Cell], paired: Sequence[tuple[int, str, Paired]], reference: str
) -> str:
    lines = [
        "| method | local steps a round | rounds | learning rate | seeds | final test score "
        "[95% t] | aggregation error [95% t] | error key |",
        "|---|---:|---:|---:|---:|---|---|---|",
    ]
    for c in table:
        error = _cell_text(c.error) if c.error is not None else "not recorded"
        lines.append(
            f"| {c.method} | {c.steps} | {c.rounds} | {c.learning_rate:g} | {len(c.seeds)} | "
            f"{_cell_text(c.test)} | {error} | `{c.error_key}` |"
        )
    missing = dict.fromkeys((c.method, c.error_key) for c in table if c.error is None)
    for method, key in missing:
        lines += ["", f"No run of {method} records `{key}` (its aggregation error)."]
    if paired:
        lines += [
            "",
            f"| local steps a round | {reference} − | difference [95% t] | wins / losses "
            "| verdict |",
            "|---:|---|---|---|---|",
        ]
        for steps, other, p in paired:
            lines.append(
                f"| {steps} | {other} | {p.difference} | {p.wins} / {p.losses} | "
                f"{verdict(p.difference)} |"
            )
    return "\n".join(lines) + "\n"


def plot(table: Sequence[Cell], path: Path) -> None:
    """Two panels against local steps a round (log axis): the final test score and the
    aggregation error, every method's mean with its 95% t interval as error bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (score_ax, error_ax) = plt.subplots(1, 2, figsize=(10, 4.2))
    methods = list(dict.fromkeys(c.method for c in table))
    for index, method in enumerate(methods):
        mine = [c for c in table if c.method == method]
        color = f"C{index % 10}"  # one colour per method in both panels
        for ax, attr in ((score_ax, "test"), (error_ax, "error")):
            points = [(c.steps, getattr(c, attr)) for c in mine if getattr(c, attr) is not None]
            if not points:
                continue
            xs = [s for s, _ in points]
            means = [i.mean for _, i in points]
            # no bar where an interval is undefined (a single seed)
            low = [0.0 if math.isnan(i.low) else i.mean - i.low for _, i in points]
            high = [0.0 if math.isnan(i.high) else i.high - i.mean for _, i in points]
            key = f", {mine[0].error_key}" if attr == "error" else ""
            ax.errorbar(
                xs, means, yerr=[low, high], marker="o", capsize=3, color=color,
                label=f"{method}{key}",
            )  # fmt: skip
    score_ax.set_ylabel("final held-out test score")
    error_ax.set_ylabel("aggregation error (mean over rounds)")
    steps = sorted({c.steps for c in table})
    for ax in (score_ax, error_ax):
        ax.set_xscale("log")
        # the splits themselves as ticks (log axes' minor labels overlap)
        ax.set_xticks(steps, [str(s) for s in steps])
        ax.minorticks_off()
        ax.set_xlabel("local steps a round (equal client compute)")
        if ax.has_data():
            ax.legend(fontsize=8)
    if not error_ax.has_data():
        error_ax.text(
            0.5, 0.5, "no run records an error key", ha="center", transform=error_ax.transAxes
        )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def chosen_rates(tuning: Path) -> dict[str, float]:
    """method -> its chosen learning rate in a tuned grid's tuning.json (choices keyed like
    ``method=florg,task=snli``)."""
    document = json.loads(tuning.read_text())
    rates = {}
    for combo, value in document.get("choices", {}).items():
        axes = dict(part.split("=", 1) for part in combo.split(","))
        rates[axes["method"]] = float(value)
    return rates


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", type=Path, nargs="?")
    parser.add_argument("--reference", default="florg")
    parser.add_argument("--plot", type=Path, default=None)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--rates", type=Path, default=None, metavar="TUNING_JSON")
    args = parser.parse_args(argv)
    if args.rates is not None:
        for method, rate in sorted(chosen_rates(args.rates).items()):
            # plain decimals: YAML reads 1e-05 (no dot) as a string, 0.00001 as a float
            print(method, format(rate, ".12f").rstrip("0").rstrip("."))
        return 0
    if args.runs is None:
        parser.error("give RUNS (or --rates TUNING_JSON)")
    runs = load_runs(args.runs)
    if not runs:
        parser.error(f"{args.runs}: no finished run")
    table = cells(runs)
    paired = paired_rows(runs, table, args.reference)
    print(markdown(table, paired, args.reference), end="")
    if args.plot:
        plot(table, args.plot)
    if args.json:
        document = {
            "cells": [asdict(c) for c in table],
            "paired": [
                {"steps": s, "other": m, "reference": args.reference, **asdict(p)}
                for s, m, p in paired
            ],
        }
        args.json.write_text(json.dumps(document, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
