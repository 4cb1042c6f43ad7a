"""The straggler comparisons at matched client work: sync, sync with over-selection and
async (lab/grids/async-stragglers.yaml on the wall clock; stragglers-virtual*.yaml under
the virtual clock; docs/async.md).

Per method and seed, a mode against a reference mode (``compare``): its time to the
reference's final validation score over the reference's length, and its test score at the
reference's end minus the reference's final one. Time is ``virtual-seconds`` where the rows
carry it, else ``elapsed-seconds``. Under the clock also the slow nodes' share of the
applied updates (``slow_partitions``) and async's server rate chosen on seed 0
(``choose_rates``). Means with 95% t intervals, a plot; ``page_block``: docs/async.md's.

    python -m florg_lab.stragglers RUNS_DIR [--plot PATH] [--choose-rate RATE ...]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from florg_lab.communication import load_metrics
from florg_lab.runs import finished_runs_under
from florg_lab.stats import mean_interval
from florg_lab.tuning import SELECT_ROUNDS, best_value, selection_score

SCORE = "score"  # the validation score of a row (the task's headline metric in [0, 1])
TEST_SCORE = "test-score"
ELAPSED = "elapsed-seconds"  # the wall clock, in every row
VIRTUAL = "virtual-seconds"  # the virtual clock's now, in rows of virtual-clock runs
SYNC, OVERSELECT, ASYNC = "sync", "sync-overselect", "async"
MODE_ORDER = {SYNC: 0, OVERSELECT: 1, ASYNC: 2}
SERVER_RATE = "async-server-lr"
TUNING_SEED = 0  # the seed async's server rate is chosen on (the grids' *-async-tuning)
COLORS = {SYNC: "tab:blue", ASYNC: "tab:orange", OVERSELECT: "tab:green"}


@dataclass(frozen=True)
class Curve:
    """One run: its method, mode, seed, rows and config (config.json)."""

    method: str
    mode: str  # 'sync', 'sync-overselect' or 'async'
    seed: int
    rows: list[dict[str, Any]]
    config: Mapping[str, Any] = field(default_factory=dict)

    @property
    def time_key(self) -> str:
        """``virtual-seconds`` where the rows carry it (virtual-clock runs), else the wall
        clock's ``elapsed-seconds``."""
        return VIRTUAL if any(VIRTUAL in r for r in self.rows) else ELAPSED

    def times(self) -> list[float]:
        """Each row's time on the curve's axis. A row without ``virtual-seconds`` (round
        0's evaluation) is at the virtual now of the row before it (0 at the start): the
        clock does not count evaluation."""
        if self.time_key == ELAPSED:
            return [float(r[ELAPSED]) for r in self.rows]
        now, times = 0.0, []
        for row in self.rows:
            now = float(row.get(VIRTUAL, now))
            times.append(now)
        return times

    def validation(self) -> list[tuple[float, float]]:
        """(time, validation score) of each validated row."""
        return [(t, float(r[SCORE])) for t, r in zip(self.times(), self.rows, strict=True)
                if r.get(SCORE) is not None]  # fmt: skip

    def tests(self) -> list[tuple[float, float]]:
        return [(t, float(r[TEST_SCORE])) for t, r in zip(self.times(), self.rows, strict=True)
                if r.get(TEST_SCORE) is not None]  # fmt: skip

    def end(self) -> float:
        return self.times()[-1]

    def busy(self) -> float:
        """The clients' training seconds (``client-train-seconds-sum``: their local steps'
        time; a straggler's wait comes after it and is not counted) over the run's wall
        clock: how many clients trained at once on average.
        On a machine with fewer cores than nodes, far below the nodes: the clients queue
        for the cores."""
        seconds = sum(float(r.get("client-train-seconds-sum") or 0.0) for r in self.rows)
        wall = float(self.rows[-1][ELAPSED])
        return seconds / wall if wall > 0 else 0.0

    def server_rate(self) -> float:
        return float(self.config.get(SERVER_RATE, 1.0))

    def applied(self) -> list[int]:
        """The partitions of the replies the updates took in, one per reply (a row's
        ``partitions``; a failed or rejected reply of an over-selected round is among
        them, counted in the row's ``failures`` / ``rejected``)."""
        return [int(p) for r in self.rows for p in r.get("partitions") or []]

    def nodes(self) -> int:
        """The federation's nodes: ``min-available-nodes`` (the grids wait for all of
        them), at least every partition seen."""
        seen = max(self.applied(), default=-1) + 1
        return max(int(self.config.get("min-available-nodes") or 0), seen)

    def slow_share(self) -> float:
        """The slow nodes' (``slow_partitions``) share of the applied replies."""
        applied = self.applied()
        slow = slow_partitions(self.config, self.nodes())
        return sum(p in slow for p in applied) / len(applied) if applied else math.nan

    def tasks_sent(self) -> int:
        """Client tasks sent: the rows' ``sent`` (sync-overselect, late ones included),
        else the replies applied and those still in flight at the last row (async)."""
        if any("sent" in r for r in self.rows):
            return sum(int(r.get("sent") or 0) for r in self.rows)
        return len(self.applied()) + int(self.rows[-1].get("in-flight") or 0)


def slow_partitions(config: Mapping[str, Any], nodes: int) -> set[int]:
    """A run's slow nodes from its config.json: each partition's compute multiplier as
    the nodes draw it (``compute_multiplier``); ``node-speeds=fixed``, those above 1 (its
    ``slow-partitions``); ``lognormal``, the slowest quarter (ties: the lower partition)."""
    from flower_app.client.node_speed import compute_multiplier
    from flower_app.settings.config import resolve_config

    keys = {"seed": int, "node-speeds": str, "node-speed-sigma": float,
            "slow-partitions": str, "slowdown": float}  # fmt: skip
    own = {k.replace("-", "_"): cast(config[k]) for k, cast in keys.items() if k in config}
    run = replace(resolve_config({}), **own)  # the draw's inputs alone, no cross-checks
    multiplier = {p: compute_multiplier(run, {}, p) for p in range(nodes)}
    if run.node_speeds == "lognormal":
        ranked = sorted(multiplier, key=lambda p: (-multiplier[p], p))
        return set(ranked[: round(nodes / 4)])
    return {p for p, m in multiplier.items() if m > 1}


@dataclass(frozen=True)
class Pair:
    """A seed's run of ``mode`` against its run of ``reference``, compared."""

    method: str
    seed: int
    time_ratio: float  # mode's time to the reference's final validation score / its length
    reached: bool
    test_difference: float  # mode's test at the reference's end - the reference's final test
    target: float = math.nan  # the reference's final validation score
    mode: str = ASYNC
    reference: str = SYNC

    @property
    def within_half(self) -> bool:
        """The goal on this seed: sync's final score reached in at most half its time."""
        return self.within(0.5)

    def within(self, goal: float) -> bool:
        return self.reached and self.time_ratio <= goal


def load_curves(root: Path) -> list[Curve]:
    """Every finished run under ``root`` (a grid's ``runs`` folder)."""
    curves = []
    for folder, _, config in finished_runs_under([root]):
        rows = load_metrics(folder / "metrics.jsonl")
        curves.append(
            Curve(config["method"], config["round-mode"], int(config["seed"]), rows, config)
        )
    return curves


def compare(sync: Curve, buffered: Curve) -> Pair:
    """One seed's comparison of ``buffered`` against the reference ``sync``, on the curves'
    time axis: the time at which ``buffered``'s validation score first reaches the
    reference's final one, over the reference's length (a run that never reaches it counts
    as its whole length, marked, so the mean is a lower bound; the target is kept, since a
    reference left at the majority class sets one any run meets at once), and its test at
    its last test no later than the reference's end minus the reference's final test."""
    sync_validation, sync_tests = sync.validation(), sync.tests()
    if not sync_validation or not sync_tests:
        raise ValueError(
            f"{sync.method} seed {sync.seed}: the {sync.mode} run has no score or test"
        )
    target, end = sync_validation[-1][1], sync.end()
    reached_at = next((t for t, score in buffered.validation() if score >= target), None)
    before_end = [score for t, score in buffered.tests() if t <= end]
    if not before_end:
        raise ValueError(
            f"{buffered.method} seed {buffered.seed}: no {buffered.mode} test by {sync.mode}'s end"
        )
    return Pair(
        sync.method,
        sync.seed,
        (buffered.end() if reached_at is None else reached_at) / end,
        reached_at is not None,
        before_end[-1] - sync_tests[-1][1],
        target,
        buffered.mode,
        sync.mode,
    )


def choose_rates(
    curves: Sequence[Curve], candidates: Sequence[float] = ()
) -> tuple[dict[str, float], dict[str, dict[float, float | None]]]:
    """Async's server rate per method, chosen on seed 0: the best validation score averaged
    over the last three validated updates (``florg_lab.tuning``'s rule; ties: the smaller
    rate; test never read). ``candidates``: the rates that must all have finished (a method
    missing one is left unchosen). The choices and each method's scores."""
    scores: dict[str, dict[float, float | None]] = defaultdict(dict)
    for c in curves:
        if c.mode == ASYNC and c.seed == TUNING_SEED:
            validated = [r for r in c.rows if r.get(SCORE) is not None]
            scores[c.method][c.server_rate()] = selection_score(validated)
    choices = {}
    for method, by_rate in scores.items():
        if any(float(r) not in by_rate for r in candidates) or len(by_rate) < 2:
            continue
        if all(s is not None for s in by_rate.values()):
            choices[method] = best_value({r: float(s or 0.0) for r, s in by_rate.items()})
    return choices, dict(scores)


def main_runs(curves: Sequence[Curve]) -> list[Curve]:
    """The comparison's runs: each method's async runs at the server rate most of its
    seeds ran (the main block's; the tuning's other rates, seed 0 only, left out; a tie:
    the rate ``choose_rates`` picks, then the smaller)."""
    counts: dict[str, Counter[float]] = defaultdict(Counter)
    for c in curves:
        if c.mode == ASYNC:
            counts[c.method][c.server_rate()] += 1
    chosen: dict[str, float] = {}
    if any(len(rates) > 1 for rates in counts.values()):
        chosen = choose_rates(curves)[0]
    keep = {
        method: max(rates, key=lambda r: (rates[r], r == chosen.get(method), -r))
        for method, rates in counts.items()
    }
    return [c for c in curves if c.mode != ASYNC or c.server_rate() == keep[c.method]]


def pairs(curves: Sequence[Curve], mode: str = ASYNC, reference: str = SYNC) -> list[Pair]:
    """Every (method, seed) with both runs finished, in method and seed order (async at
    its main server rate, ``main_runs``)."""
    by_key: dict[tuple[str, int], dict[str, Curve]] = defaultdict(dict)
    for curve in main_runs(curves):
        by_key[(curve.method, curve.seed)][curve.mode] = curve
    return [
        compare(modes[reference], modes[mode])
        for key, modes in sorted(by_key.items())
        if {reference, mode} <= set(modes)
    ]


def table(
    found: Sequence[Pair], mode: str = ASYNC, reference: str = SYNC, goal: float = 0.5
) -> str:
    """A markdown table, one row per method: the seeds, the time ratio and the test
    difference, each a mean with its 95% interval, and the seeds' values; the seeds whose
    ratio is at most ``goal`` (1/2 against sync; 1, sooner, against sync-overselect)."""
    within = "in at most half" if goal == 0.5 else "sooner" if goal == 1 else f"in at most {goal:g}"
    lines = [
        f"| method | seeds | {mode} time to {reference}'s final validation score / "
        f"{reference}'s time | seeds there {within} | {mode} test at {reference}'s end − "
        f"{reference}'s final test | per seed ({reference}'s final validation score: ratio; "
        "difference) |",
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
        half = sum(p.within(goal) for p in rows)
        lines.append(
            f"| {method} | {len(rows)} | {_interval(ratio)} | {half} of {len(rows)} | "
            f"{_interval(diff)} | {per_seed} |"
        )
    return "\n".join(lines)


def _groups(curves: Sequence[Curve]) -> list[tuple[tuple[str, str], list[Curve]]]:
    """The curves by method and mode: sync first, then sync-overselect, then async."""
    groups: dict[tuple[str, str], list[Curve]] = defaultdict(list)
    for curve in curves:
        groups[(curve.method, curve.mode)].append(curve)
    return sorted(groups.items(), key=lambda kv: (kv[0][0], MODE_ORDER.get(kv[0][1], 3)))


def lengths(curves: Sequence[Curve]) -> str:
    """A markdown table, one row per method and mode: the seeds, the run's length, and
    its final validation and test scores, each a mean over the seeds. On the wall clock
    also how many clients trained at once; under the virtual clock the client tasks sent
    and the replies applied (their difference: work discarded or left in flight)."""
    virtual = any(c.time_key == VIRTUAL for c in curves)
    if virtual:
        lines = ["| method | mode | seeds | virtual time (min) | client tasks sent "
                 "| replies applied | final validation score | final test score |",
                 "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    else:
        lines = ["| method | mode | seeds | wall clock (min) | clients training at once (mean) "
                 "| final validation score | final test score |",
                 "|---|---|---|---|---|---|---|"]  # fmt: skip
    for (method, mode), runs in _groups(curves):
        minutes = mean_interval([c.end() / 60 for c in runs])
        validation = mean_interval([c.validation()[-1][1] for c in runs if c.validation()])
        test = mean_interval([c.tests()[-1][1] for c in runs if c.tests()])
        if virtual:
            work = [_interval(mean_interval([c.tasks_sent() for c in runs]), 1),
                    _interval(mean_interval([len(c.applied()) for c in runs]), 1)]  # fmt: skip
        else:
            work = [_interval(mean_interval([c.busy() for c in runs]), 1)]
        cells = [method, mode, str(len(runs)), _interval(minutes, 1), *work,
                 _interval(validation), _interval(test)]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def slow_shares(curves: Sequence[Curve]) -> str:
    """A markdown table, one row per method and mode: the slow nodes' share of the
    applied replies (a mean over the seeds with its 95% interval) and their share of the
    nodes (what a round of every node applies)."""
    lines = ["| method | mode | seeds | slow nodes' share of applied replies "
             "| slow nodes' share of the nodes |", "|---|---|---|---|---|"]  # fmt: skip
    for (method, mode), runs in _groups(curves):
        share = mean_interval([c.slow_share() for c in runs])
        nodes = mean_interval([len(slow_partitions(c.config, c.nodes())) / c.nodes() for c in runs])
        lines.append(f"| {method} | {mode} | {len(runs)} | {_interval(share)} | "
                     f"{_interval(nodes)} |")  # fmt: skip
    return "\n".join(lines)


def rates_table(curves: Sequence[Curve]) -> str:
    """Seed 0's async runs: each server rate's selection score, and the choice."""
    choices, scores = choose_rates(curves)
    rates = sorted({r for by_rate in scores.values() for r in by_rate})
    lines = ["| method | " + " | ".join(f"{SERVER_RATE} = {r:g}" for r in rates) + " | chosen |",
             "|---|" + "---|" * (len(rates) + 1)]  # fmt: skip
    for method, by_rate in sorted(scores.items()):
        cells = ["–" if by_rate.get(r) is None else f"{by_rate[r]:.4f}" for r in rates]
        chosen = f"{choices[method]:g}" if method in choices else "–"
        lines.append(f"| {method} | " + " | ".join(cells) + f" | {chosen} |")
    return "\n".join(lines)


def report(curves: Sequence[Curve]) -> str:
    """The comparison as printed: on the wall clock, async against sync and the lengths;
    under the virtual clock every mode against sync, async against sync-overselect, the
    lengths, the slow nodes' shares and the server rate's choice."""
    if not any(c.time_key == VIRTUAL for c in curves):
        return "\n".join([table(pairs(curves)), "", lengths(curves)])
    main = main_runs(curves)
    parts = []
    for mode, reference, goal in ((ASYNC, SYNC, 0.5), (OVERSELECT, SYNC, 0.5),
                                  (ASYNC, OVERSELECT, 1.0)):  # fmt: skip
        found = pairs(main, mode, reference)
        if found:
            parts += [f"{mode} against {reference}:", "", table(found, mode, reference, goal), ""]
    parts += [lengths(main), "", slow_shares(main), "",
              f"{SERVER_RATE} on seed {TUNING_SEED} (validation, mean of the last "
              f"{SELECT_ROUNDS} validated updates):", "", rates_table(curves)]  # fmt: skip
    return "\n".join(parts)


def _interval(interval: Any, digits: int = 3) -> str:
    if math.isnan(interval.low):
        return f"{interval.mean:.{digits}f}"
    return f"{interval.mean:.{digits}f} [{interval.low:.{digits}f}, {interval.high:.{digits}f}]"


def plot(curves: Sequence[Curve], path: Path) -> Path:
    """Validation score against time (the curves' axis), a panel per method, each run a
    line, a colour per mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = sorted({c.method for c in curves})
    first_seed = min(c.seed for c in curves)
    virtual = any(c.time_key == VIRTUAL for c in curves)
    fig, axes = plt.subplots(1, len(methods), figsize=(5 * len(methods), 3.6), squeeze=False)
    for ax, method in zip(axes[0], methods, strict=True):
        for curve in sorted(curves, key=lambda c: (c.mode, c.seed)):
            if curve.method != method:
                continue
            points = curve.validation()
            color = COLORS.get(curve.mode, "tab:gray")
            label = curve.mode if curve.seed == first_seed else None  # one legend entry a mode
            ax.plot([t / 60 for t, _ in points], [s for _, s in points], color=color,
                    alpha=0.8, label=label)  # fmt: skip
        ax.set_title(method)
        ax.set_xlabel("virtual time (min)" if virtual else "wall clock (min)")
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
    parser.add_argument(
        "--choose-rate", type=float, nargs="+", default=None, metavar="RATE",
        help="print 'METHOD RATE' per method: async's server rate chosen on seed 0 among "
        "these rates (each must have finished; exit 1 if a method has no choice)",
    )  # fmt: skip
    parser.add_argument("--write", type=Path, default=None, help="--choose-rate's JSON record")
    args = parser.parse_args(argv)
    curves = load_curves(args.runs)
    if args.choose_rate is not None:
        return _choose(curves, args.choose_rate, args.write)
    print(report(curves))
    if args.plot is not None:
        print(f"plot: {plot(main_runs(curves), args.plot)}")
    return 0


def _choose(curves: Sequence[Curve], rates: Sequence[float], write: Path | None) -> int:
    """``--choose-rate``: the choices, one 'METHOD RATE' line each, and their record."""
    choices, scores = choose_rates(curves, rates)
    methods = sorted({c.method for c in curves if c.mode == ASYNC})
    if write is not None:
        select = f"validation score, mean of the last {SELECT_ROUNDS} validated updates"
        by_method = {m: {repr(r): s for r, s in by.items()} for m, by in scores.items()}
        record = {"key": SERVER_RATE, "values": list(rates), "seed": TUNING_SEED,
                  "select": select, "choices": choices, "scores": by_method}  # fmt: skip
        write.parent.mkdir(parents=True, exist_ok=True)
        write.write_text(json.dumps(record, indent=2) + "\n")
    for method in methods:
        if method in choices:
            print(f"{method} {choices[method]!r}")
    missing = [m for m in methods if m not in choices]
    if missing or not methods:
        print(f"no server rate chosen for {missing or 'any method'}: seed {TUNING_SEED}'s "
              f"async runs at {list(rates)} have not all finished", file=sys.stderr)  # fmt: skip
        return 1
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
