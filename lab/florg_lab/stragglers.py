"""The straggler comparison: synchronous against asynchronous rounds at matched client work
(lab/grids/async-stragglers.yaml; docs/async.md).

For each method and seed, the synchronous run and the asynchronous run of the same seed:

- **time to sync's score**: the wall clock (``elapsed-seconds``) at which the asynchronous
  run's validation score first reaches the synchronous run's final one, over the
  synchronous run's final wall clock (the goal: at most 1/2, counted per seed); a run that
  never reaches it counts as its whole length, marked (so the mean is a lower bound), and
  each seed's target is printed (a synchronous run left at the majority class sets a target
  any run meets at once);
- **test at equal wall clock**: the asynchronous run's test score at its last test round
  no later than the synchronous run's end, minus the synchronous run's final test score.

Each is a mean over the seeds with its 95% t interval (``florg_lab.stats``); a second table
gives each method's and mode's wall clock, how many clients trained at once on average
and the final scores. The plot: validation score
against wall clock, one panel per method, each seed's two runs. ``docs/async.md`` shows the
published runs' tables and plot (``page_block``, ``page_figure``: ``python -m
florg_lab.results_doc``).

    python -m florg_lab.stragglers RUNS_DIR [--plot PATH]
"""

from __future__ import annotations

import argparse
import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from florg_lab.communication import load_metrics
from florg_lab.runs import finished_runs_under
from florg_lab.stats import mean_interval

SCORE = "score"  # the validation score of a row (the task's headline metric in [0, 1])
TEST_SCORE = "test-score"


@dataclass(frozen=True)
class Curve:
    """One run: its method, mode, seed and rows."""

    method: str
    mode: str  # 'sync' or 'async'
    seed: int
    rows: list[dict[str, Any]]

    def validation(self) -> list[tuple[float, float]]:
        """(elapsed seconds, validation score) of each validated row."""
        return [(float(r["elapsed-seconds"]), float(r[SCORE])) for r in self.rows
                if r.get(SCORE) is not None]  # fmt: skip

    def tests(self) -> list[tuple[float, float]]:
        return [(float(r["elapsed-seconds"]), float(r[TEST_SCORE])) for r in self.rows
                if r.get(TEST_SCORE) is not None]  # fmt: skip

    def end(self) -> float:
        return float(self.rows[-1]["elapsed-seconds"])

    def busy(self) -> float:
        """The clients' training seconds (``client-train-seconds-sum``: their local steps'
        time; a straggler's wait comes after it and is not counted) over the run's wall
        clock: how many clients trained at once on average.
        On a machine with fewer cores than nodes, far below the nodes: the clients queue
        for the cores."""
        seconds = sum(float(r.get("client-train-seconds-sum") or 0.0) for r in self.rows)
        return seconds / self.end() if self.end() > 0 else 0.0


@dataclass(frozen=True)
class Pair:
    """A seed's synchronous and asynchronous runs, compared."""

    method: str
    seed: int
    time_ratio: float  # async's time to sync's final validation score / sync's length
    reached: bool
    test_difference: float  # async's test at sync's end - sync's final test
    target: float = math.nan  # sync's final validation score

    @property
    def within_half(self) -> bool:
        """The goal on this seed: sync's final score reached in at most half its time."""
        return self.reached and self.time_ratio <= 0.5


def load_curves(root: Path) -> list[Curve]:
    """Every finished run under ``root`` (a grid's ``runs`` folder)."""
    curves = []
    for folder, _, config in finished_runs_under([root]):
        rows = load_metrics(folder / "metrics.jsonl")
        curves.append(Curve(config["method"], config["round-mode"], int(config["seed"]), rows))
    return curves


def compare(sync: Curve, buffered: Curve) -> Pair:
    """One seed's comparison (the module docstring's two measures)."""
    sync_validation, sync_tests = sync.validation(), sync.tests()
    if not sync_validation or not sync_tests:
        raise ValueError(f"{sync.method} seed {sync.seed}: the sync run has no score or test")
    target, end = sync_validation[-1][1], sync.end()
    reached_at = next((t for t, score in buffered.validation() if score >= target), None)
    before_end = [score for t, score in buffered.tests() if t <= end]
    if not before_end:
        raise ValueError(f"{buffered.method} seed {buffered.seed}: no async test by sync's end")
    return Pair(
        sync.method,
        sync.seed,
        (buffered.end() if reached_at is None else reached_at) / end,
        reached_at is not None,
        before_end[-1] - sync_tests[-1][1],
        target,
    )


def pairs(curves: Sequence[Curve]) -> list[Pair]:
    """Every (method, seed) with both runs finished, in method and seed order."""
    by_key: dict[tuple[str, int], dict[str, Curve]] = defaultdict(dict)
    for curve in curves:
        by_key[(curve.method, curve.seed)][curve.mode] = curve
    return [
        compare(modes["sync"], modes["async"])
        for key, modes in sorted(by_key.items())
        if {"sync", "async"} <= set(modes)
    ]


def table(found: Sequence[Pair]) -> str:
    """A markdown table, one row per method: the seeds, the time ratio and the test
    difference, each a mean with its 95% interval, and the seeds' values."""
    lines = [
        "| method | seeds | async time to sync's final validation score / sync's time "
        "| seeds there in at most half | async test at sync's end − sync's final test "
        "| per seed (sync's final validation score: ratio; difference) |",
        "|---|---|---|---|---|---|",
    ]
    methods: dict[str, list[Pair]] = defaultdict(list)
    for pair in found:
        methods[pair.method].append(pair)
    for method, rows in methods.items():
        per_seed = "; ".join(
            f"{p.seed} ({p.target:.3f}): {p.time_ratio:.2f}"
            f"{'' if p.reached else ' (not reached: its whole length)'}, {p.test_difference:+.3f}"
            for p in rows
        )
        ratio = mean_interval([p.time_ratio for p in rows])
        diff = mean_interval([p.test_difference for p in rows])
        half = sum(p.within_half for p in rows)
        lines.append(
            f"| {method} | {len(rows)} | {_interval(ratio)} | {half} of {len(rows)} | "
            f"{_interval(diff)} | {per_seed} |"
        )
    return "\n".join(lines)


def lengths(curves: Sequence[Curve]) -> str:
    """A markdown table, one row per method and mode: the seeds, the run's wall clock, its
    final validation score and its final test score, each a mean over the seeds."""
    lines = [
        "| method | mode | seeds | wall clock (min) | clients training at once (mean) "
        "| final validation score | final test score |",
        "|---|---|---|---|---|---|---|",
    ]
    groups: dict[tuple[str, str], list[Curve]] = defaultdict(list)
    for curve in curves:
        groups[(curve.method, curve.mode)].append(curve)
    for (method, mode), runs in sorted(
        groups.items(), key=lambda kv: (kv[0][0], kv[0][1] != "sync")
    ):
        minutes = mean_interval([c.end() / 60 for c in runs])
        busy = mean_interval([c.busy() for c in runs])
        validation = mean_interval([c.validation()[-1][1] for c in runs if c.validation()])
        test = mean_interval([c.tests()[-1][1] for c in runs if c.tests()])
        cells = [method, mode, str(len(runs)), _interval(minutes, 1), _interval(busy, 1),
                 _interval(validation), _interval(test)]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _interval(interval: Any, digits: int = 3) -> str:
    if math.isnan(interval.low):
        return f"{interval.mean:.{digits}f}"
    return f"{interval.mean:.{digits}f} [{interval.low:.{digits}f}, {interval.high:.{digits}f}]"


def plot(curves: Sequence[Curve], path: Path) -> Path:
    """Validation score against wall clock, a panel per method, each run a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = sorted({c.method for c in curves})
    first_seed = min(c.seed for c in curves)
    fig, axes = plt.subplots(1, len(methods), figsize=(5 * len(methods), 3.6), squeeze=False)
    for ax, method in zip(axes[0], methods, strict=True):
        for curve in sorted(curves, key=lambda c: (c.mode, c.seed)):
            if curve.method != method:
                continue
            points = curve.validation()
            color = "tab:blue" if curve.mode == "sync" else "tab:orange"
            label = curve.mode if curve.seed == first_seed else None  # one legend entry a mode
            ax.plot([t / 60 for t, _ in points], [s for _, s in points], color=color,
                    alpha=0.8, label=label)  # fmt: skip
        ax.set_title(method)
        ax.set_xlabel("wall clock (min)")
        ax.set_ylabel("validation score")
        ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", type=Path, help="a grid's runs folder")
    parser.add_argument("--plot", type=Path, default=None, help="where to write the plot")
    args = parser.parse_args(argv)
    curves = load_curves(args.runs)
    print(table(pairs(curves)))
    print()
    print(lengths(curves))
    if args.plot is not None:
        print(f"plot: {plot(curves, args.plot)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


# --- docs/async.md's block and figure (python -m florg_lab.results_doc) ----------------------

PUBLISHED = "lab/evidence/async-stragglers"  # runs/<grid>/<run>, published by the runner
RUNS = PUBLISHED + "/runs/async-stragglers"
FIGURE = PUBLISHED + "/stragglers.png"
RUNNER = "bash lab/scripts/evidence_async.sh ROOT"


def _published(ev: Any) -> list[Curve]:
    folder = ev.root / RUNS
    return load_curves(folder) if folder.is_dir() else []


def page_block(ev: Any) -> str:
    """The comparison's tables from the published runs, or how to run it."""
    curves = _published(ev)
    found = pairs(curves)
    if not found:
        return (f"Not measured yet: `{RUNNER}` runs `lab/grids/async-stragglers.yaml`; "
                f"{len(curves)} runs published under {RUNS}.")  # fmt: skip
    return "\n".join([table(found), "", lengths(curves), "", f"![validation score against "
                      f"wall clock, sync and async](../{FIGURE})"])  # fmt: skip


def page_figure(ev: Any, path: Path) -> bool:
    curves = _published(ev)
    if not pairs(curves):
        return False
    plot(curves, path)
    return True


def page_figure_due(ev: Any) -> bool:
    return bool(pairs(_published(ev)))
