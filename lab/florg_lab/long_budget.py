"""The verdict as a curve over rounds: a tuned, seeded grid's held-out test scores at chosen
rounds, the paired differences FLoRG − each baseline, and whether the runs converged.

    python -m florg_lab.long_budget RESULTS [--rounds 20 40 80 160]
        [--baselines fedit federa] [--last 40] [--plot FILE] [--json FILE]

RESULTS is a grid's results folder: ``runs/<run id>/`` (config.json, metrics.jsonl,
summary.json) and ``tuning.json`` (the learning rate chosen per method), such as the
worktree's ``results/evidence-long-snli`` or the published ``lab/evidence/long-snli``. Only a
method's runs at its chosen learning rate count, one per seed; a method or round without
runs is left out and said so.

It prints, as markdown:

- **the curve**: at each of ``--rounds``, every method's mean test score with its 95% t
  interval over seeds, and FLoRG − each baseline paired by seed (mean, interval, wins /
  losses, verdict);
- **per seed**: every chosen run's test score at ``--rounds`` (the seed also draws the
  partition, so a partition on which a method does not learn shows here);
- **convergence**: per method, the slope of the validation score over the last ``--last``
  rounds (least squares per seed, then the mean and 95% t interval over seeds, per 100
  rounds); an interval above 0 says the method is still rising, so its verdict is not final.

``--plot`` draws test score against round, every method's mean with its interval band;
``--json`` writes the numbers.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

from florg_lab.grid import Grid, load_grid
from florg_lab.page_text import TASKS, Evidence, interval, method_name, paired, table
from florg_lab.page_v2 import V2
from florg_lab.runs import finished_run
from florg_lab.stats import Interval, mean_interval, paired_difference, verdict

REFERENCE = "florg"
# The verdict page's long-budget grid: its file in lab/grids/, its published runs and
# tuning.json, the figure the page shows, and the rounds its curve reads
GRID = "evidence-long-snli"
PUBLISHED = "lab/evidence/long-snli"
FIGURE = "lab/evidence/long-snli/curve.png"
PAGE_ROUNDS = (20, 40, 80, 160)
PAGE_LAST = 40  # the convergence check's window, in rounds


@dataclass(frozen=True)
class Run:
    method: str
    seed: int
    rows: list[dict[str, Any]]
    learning_rate: float | None = None
    task: str | None = None
    # the row key of the held-out test score (summary.json's ``test-score-key``): FedSA-LoRA
    # is scored on its clients' personalised models
    test_key: str = "test-score"
    # the run's config.json (its settings beyond method, seed, rate and task: encodings, ...)
    config: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def series(self, key: str) -> dict[int, float]:
        """round -> the value of ``key`` where the row has one."""
        return {
            int(r["round"]): float(r[key])
            for r in self.rows
            if isinstance(r.get(key), int | float) and not math.isnan(float(r[key]))
        }


def chosen_runs(results: Path) -> dict[str, dict[int, Run]]:
    """method -> seed -> its finished run at the method's chosen learning rate
    (``tuning.json``'s learning-rate choices, keyed like ``method=florg,task=snli``)."""
    tuning = json.loads((results / "tuning.json").read_text())
    chosen = {
        dict(p.split("=", 1) for p in combo.split(","))["method"]: value
        for combo, value in tuning["choices"].items()
    }
    runs: dict[str, dict[int, Run]] = {}
    for run in finished_runs(results):
        if run.method in chosen and run.learning_rate == chosen[run.method]:
            runs.setdefault(run.method, {})[run.seed] = run
    return runs


def scores_at(runs: dict[int, Run], round_: int, key: str = "test-score") -> dict[int, float]:
    """seed -> ``key`` at ``round_`` (seeds without it left out)."""
    out = {}
    for seed, run in runs.items():
        series = run.series(key)
        if round_ in series:
            out[seed] = series[round_]
    return out


def curve(
    runs: dict[str, dict[int, Run]], rounds: Sequence[int], baselines: Sequence[str]
) -> list[dict[str, Any]]:
    """One entry per round: each method's mean test score and FLoRG − each baseline."""
    table = []
    for round_ in rounds:
        entry: dict[str, Any] = {"round": round_, "scores": {}, "differences": {}}
        for method, by_seed in runs.items():
            scores = scores_at(by_seed, round_)
            if scores:
                entry["scores"][method] = mean_interval(list(scores.values()))
        reference = scores_at(runs.get(REFERENCE, {}), round_)
        for baseline in baselines:
            other = scores_at(runs.get(baseline, {}), round_)
            seeds = sorted(set(reference) & set(other))
            if seeds:
                entry["differences"][baseline] = paired_difference(
                    [reference[s] for s in seeds], [other[s] for s in seeds]
                )
        table.append(entry)
    return table


def slope(points: dict[int, float]) -> float:
    """Least-squares slope of value against round."""
    xs, ys = list(points), list(points.values())
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        raise ValueError("a slope needs two rounds or more")
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx


def convergence(runs: dict[str, dict[int, Run]], last: int) -> dict[str, Interval]:
    """method -> the validation score's slope per 100 rounds over each run's last ``last``
    rounds, mean and 95% t interval over seeds."""
    out = {}
    for method, by_seed in runs.items():
        slopes = []
        for run in by_seed.values():
            series = run.series("score")
            if not series:
                continue
            end = max(series)
            window = {t: v for t, v in series.items() if t > end - last}
            if len(window) >= 2:
                slopes.append(100 * slope(window))
        if slopes:
            out[method] = mean_interval(slopes)
    return out


def still_rising(interval: Interval) -> bool:
    return not math.isnan(interval.low) and interval.low > 0


def reference_first(runs: dict[str, dict[int, Run]]) -> list[str]:
    """The methods in the tables' column order: FLoRG first, then the rest by name."""
    return sorted(runs, key=lambda m: (m != REFERENCE, m))


def score_cells(run: Run, rounds: Sequence[int]) -> list[str]:
    """``run``'s held-out test score at each of ``rounds`` for a table row ('–' where none)."""
    series = run.series("test-score")
    return [f"{series[t]:.3f}" if t in series else "–" for t in rounds]


def markdown(
    table: list[dict[str, Any]], converged: dict[str, Interval], last: int, methods: list[str]
) -> str:
    baselines = sorted({b for e in table for b in e["differences"]})
    head = ["round", *methods, *(f"{REFERENCE} − {b}" for b in baselines)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for entry in table:
        cells = [str(entry["round"])]
        cells += [str(entry["scores"][m]) if m in entry["scores"] else "–" for m in methods]
        for b in baselines:
            paired = entry["differences"].get(b)
            cells.append(
                f"{paired.difference} ({paired.wins}/{paired.losses}, {verdict(paired.difference)})"
                if paired
                else "–"
            )
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        "Each method's cell: its mean held-out test score over the seeds, with the 95% "
        f"interval. Each difference: {REFERENCE} minus the baseline, paired by seed, with its "
        f"95% interval; in brackets, the seeds on which {REFERENCE} is ahead / behind, and the "
        "verdict (holds: the interval is above 0; does not hold: below 0).",
    ]
    lines += ["", f"Validation score's slope per 100 rounds over the last {last} rounds:", ""]
    lines += ["| method | slope | still rising |", "|---|---|---|"]
    for method in methods:
        if method in converged:
            rising = "yes" if still_rising(converged[method]) else "no"
            lines.append(f"| {method} | {converged[method]} | {rising} |")
    return "\n".join(lines) + "\n"


def per_seed_markdown(runs: dict[str, dict[int, Run]], rounds: Sequence[int]) -> str:
    """Each chosen run's held-out test score at ``rounds``, one row per method and seed: the
    intervals above pool the seeds, and the seed also draws the partition (Dirichlet), so a
    partition on which a method does not learn shows here and not there."""
    lines = [
        "Per seed (the seed also draws the clients' partition), held-out test score:",
        "",
        "| method | seed | " + " | ".join(f"round {t}" for t in rounds) + " |",
        "|---|---|" + "---|" * len(rounds),
    ]
    for method in reference_first(runs):
        for seed, run in sorted(runs[method].items()):
            lines.append(f"| {method} | {seed} | " + " | ".join(score_cells(run, rounds)) + " |")
    return "\n".join(lines) + "\n"


def plot(runs: dict[str, dict[int, Run]], path: Path) -> None:
    """Test score against round: every method's mean with its 95% interval band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for method, by_seed in sorted(runs.items()):
        rounds = sorted({t for run in by_seed.values() for t in run.series("test-score")})
        intervals = [mean_interval(list(scores_at(by_seed, t).values())) for t in rounds]
        means = [i.mean for i in intervals]
        ax.plot(rounds, means, label=f"{method} (n = {len(by_seed)})")
        if all(not math.isnan(i.low) for i in intervals):
            ax.fill_between(rounds, [i.low for i in intervals], [i.high for i in intervals],
                            alpha=0.2)  # fmt: skip
    _save(fig, ax, path)


def _save(fig, ax, path: Path) -> None:
    """Label the score-against-round axes and write the figure. The score axis spans the
    score's range, [0, 1]: a t interval over two or three seeds can reach far past it, and
    would otherwise squash every curve into a sliver of the figure."""
    import matplotlib.pyplot as plt

    ax.set_xlabel("round")
    ax.set_ylabel("held-out test score")
    ax.set_ylim(0.0, 1.0)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --- the verdict page's blocks and figure (python -m florg_lab.results_doc) ----


def finished_runs(results: Path) -> list[Run]:
    """Every finished run of the grid, chosen learning rate or not (the tuning runs too)."""
    return runs_in(results / "runs")


def runs_in(folder: Path) -> list[Run]:
    """Every finished run directly under ``folder`` (one folder per run, as a grid's
    ``runs/`` or a published ``runs/GRID/``), in name order."""
    out = []
    for run in sorted(folder.iterdir()):
        found = finished_run(run)
        if found is not None:
            summary, config = found
            text = (run / "metrics.jsonl").read_text()
            rows = [json.loads(line) for line in text.splitlines() if line.strip()]
            out.append(Run(config["method"], int(config["seed"]), rows,
                           config.get("learning-rate"), config.get("task"),
                           summary.get("test-score-key", "test-score"), config))  # fmt: skip
    return out


def planned_runs(results: Path, grid_runs: int) -> int:
    """The grid's ``grid_runs`` plus one run for each rate tuning added past an end of its
    grid (``tuning.json``'s path per method, beyond its ``values``)."""
    tuning_file = results / "tuning.json"
    if not tuning_file.is_file():
        return grid_runs
    tuning = json.loads(tuning_file.read_text())
    grid_values = set(tuning.get("values", []))
    added = sum(
        sum(1 for value in entry.get("path", []) if value not in grid_values)
        for entry in tuning.get("table", {}).values()
    )
    return grid_runs + added


def progress_markdown(
    results: Path, total_runs: int, rounds: Sequence[int], baselines: Sequence[str], last: int
) -> str:
    """The page's text: how far the grid is; the curve and the convergence check once tuning
    has chosen; before that, each finished tuning run's test score at ``rounds`` (no
    verdict: a learning rate not yet chosen is no method's score). ``total_runs``: the
    grid's runs before tuning extends any rate."""
    done = finished_runs(results)
    lines = [
        f"{len(done)} runs finished, of {planned_runs(results, total_runs)} planned (tuning "
        "adds a run each time it extends a rate past an end)."
    ]
    runs = chosen_runs(results)
    if runs:
        table = curve(runs, rounds, baselines)
        methods = reference_first(runs)
        lines += ["", markdown(table, convergence(runs, last), last, methods).rstrip()]
        lines += ["", per_seed_markdown(runs, rounds).rstrip()]
        return "\n".join(lines)
    lines += [
        "Tuning (seed 0) has chosen no learning rate yet, so there is no verdict. The finished "
        "tuning runs' held-out test scores:",
        "",
        "| method | learning rate | " + " | ".join(f"round {t}" for t in rounds) + " |",
        "|---|---|" + "---|" * len(rounds),
    ]
    for run in done:
        cells = score_cells(run, rounds)
        lines.append(f"| {run.method} | {run.learning_rate} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def progress_plot(results: Path, path: Path) -> None:
    """``plot`` of the chosen runs; before tuning has chosen, each finished tuning run's
    test score against round."""
    runs = chosen_runs(results)
    if runs:
        plot(runs, path)
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for run in finished_runs(results):
        series = run.series("test-score")
        label = f"{run.method}, lr {run.learning_rate} (tuning, seed {run.seed})"
        ax.plot(list(series), list(series.values()), marker="o", label=label)
    ax.set_title("long-budget SNLI grid: tuning runs (no learning rate chosen yet)")
    _save(fig, ax, path)


@cache
def grid() -> Grid:
    """The long-budget grid as its file describes it (no tuning choice applied)."""
    return load_grid(GRID)


def grid_runs() -> int:
    """The grid's runs before tuning extends a rate: per method, each rate its file lists at
    the tuning seed, plus the other seeds at the chosen rate (the grid file's count)."""
    return grid().expected_runs


def methods() -> tuple[str, ...]:
    """The grid's methods, FLoRG first as its file lists them."""
    return tuple(grid().blocks["main"]["method"])


def page_block(ev: Evidence) -> str:
    """docs/results.md: the long-budget grid as far as it has run (:func:`progress_markdown`
    over the published runs), beside protocol v2's round-40 verdict on 2,400 examples."""
    entries = ev.entries(V2, "snli")
    baselines = methods()[1:]
    v2 = {b: paired(entries[REFERENCE], entries[b]).text() for b in ("fedit", "federa")}
    return "\n".join(
        [
            progress_markdown(ev.root / PUBLISHED, grid_runs(), PAGE_ROUNDS, baselines, PAGE_LAST),
            "",
            f"Protocol v2 at round 40 on 2,400 examples (SNLI), for comparison: FLoRG − FedIT "
            f"{v2['fedit']}, FLoRG − FeDeRA {v2['federa']}.",
        ]
    )


def federa_fedit(ev: Evidence) -> str:
    """docs/results.md's advice names FeDeRA and FedIT together: their paired difference,
    FeDeRA − FedIT, on protocol v2's final-round test scores per task and on the long
    budget's at its last round (the chosen runs)."""
    rows = []
    for task, name in TASKS.items():
        entries = ev.entries(V2, task)
        found = paired(entries["federa"], entries["fedit"])
        rows.append([f"protocol v2, {name}", str(found.seeds), found.text(),
                     f"{found.ahead} / {found.behind}"])  # fmt: skip
    last = int(grid().base["num-server-rounds"])
    runs = chosen_runs(ev.root / PUBLISHED)
    federa, fedit = (scores_at(runs[m], last) for m in ("federa", "fedit"))
    common = sorted(set(federa) & set(fedit))
    found = paired_difference([federa[s] for s in common], [fedit[s] for s in common])
    rows.append([f"long budget, SNLI, round {last}", str(len(common)),
                 f"{interval(found.difference, sign=True)} {verdict(found.difference)}",
                 f"{found.wins} / {found.losses}"])  # fmt: skip
    head = ["evidence", "seeds", "FeDeRA − FedIT (test score)", "seeds FeDeRA ahead / behind"]
    return "\n".join(table(head, rows))


def headline_verdicts(
    ev: Evidence, round_: int | None = None
) -> tuple[str, str, list[tuple[str, str]]]:
    """README's headline row, as (evidence, task, [(baseline name, verdict)]): FLoRG − each
    baseline paired by seed at ``round_`` (default: the grid's last), as on the curve."""
    round_ = int(grid().base["num-server-rounds"]) if round_ is None else round_
    baselines = methods()[1:]
    (entry,) = curve(chosen_runs(ev.root / PUBLISHED), (round_,), baselines)
    verdicts = [(method_name(b), verdict(entry["differences"][b].difference)) for b in baselines]
    (task,) = grid().blocks["main"]["task"]
    return f"long budget (`{grid().name}`, round {round_})", task, verdicts


def page_figure(ev: Evidence, path: Path) -> None:
    """The page's figure: :func:`progress_plot` of the published runs."""
    progress_plot(ev.root / PUBLISHED, path)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", type=Path)
    parser.add_argument("--rounds", type=int, nargs="+", default=[20, 40, 80, 160])
    parser.add_argument("--baselines", nargs="+", default=["fedit", "federa"])
    parser.add_argument("--last", type=int, default=40)
    parser.add_argument("--plot", type=Path, default=None)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    runs = chosen_runs(args.results)
    if not runs:
        parser.error(f"{args.results}: no finished run at a chosen learning rate")
    methods = reference_first(runs)
    seeds = {m: sorted(by_seed) for m, by_seed in runs.items()}
    print(f"finished runs at the chosen learning rates, seeds per method: {seeds}\n")
    table = curve(runs, args.rounds, args.baselines)
    converged = convergence(runs, args.last)
    print(markdown(table, converged, args.last, methods), end="")
    print("\n" + per_seed_markdown(runs, args.rounds), end="")
    if args.plot:
        plot(runs, args.plot)
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "seeds": seeds,
                    "curve": [
                        {
                            "round": e["round"],
                            "scores": {m: asdict(i) for m, i in e["scores"].items()},
                            "differences": {b: asdict(p) for b, p in e["differences"].items()},
                        }
                        for e in table
                    ],
                    "convergence": {m: asdict(i) for m, i in converged.items()},
                },
                indent=2,
            )
            + "\n"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
