"""Collect a grid's finished runs into results.csv and a markdown report of tables.

Final-round values are reported (not the best round), as mean ± sample standard deviation
over the seeds of one setting. A setting is a run's axis values without ``seed``.
"""

from __future__ import annotations

import csv
import json
import math
import statistics
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from florg_lab.communication import format_params, load_metrics, params_to_target
from florg_lab.grid import MAIN_BLOCK, Grid, GridRun
from florg_lab.runs import is_finished, run_dir
from flower_app.environment import describe_environment, environment_label

__all__ = ["RunResult", "collect", "markdown_report", "run_machines", "write_csv"]


@dataclass(frozen=True)
class RunResult:
    run: GridRun
    rows: list[dict[str, Any]]
    summary: dict[str, Any]

    @property
    def setting(self) -> tuple[tuple[str, Any], ...]:
        return tuple((k, v) for k, v in sorted(self.run.axes.items()) if k != "seed")

    def value(self, metric: str) -> float | None:
        """The metric at the final round (None if the final round has no value)."""
        last = max(self.rows, key=lambda r: r["round"], default={})
        value = last.get(metric)
        return None if value is None else float(value)

    def initial(self, metric: str) -> float | None:
        """The metric at round 0: the global model before any federated training."""
        first = min(self.rows, key=lambda r: r["round"], default={})
        value = first.get(metric)
        return None if value is None else float(value)

    def gain(self, metric: str) -> float | None:
        """Final minus round-0 metric: what the federated training changed."""
        final, initial = self.value(metric), self.initial(metric)
        return None if final is None or initial is None else final - initial

    def best(self, metric: str) -> float | None:
        values = [float(r[metric]) for r in self.rows if r.get(metric) is not None]
        return max(values) if values else None


def collect(grid: Grid, out: Path) -> tuple[list[RunResult], list[str]]:
    """Finished runs of ``grid`` under ``out`` and the ids of those not finished."""
    results, missing = [], []
    for run in grid.runs:
        folder = run_dir(out, run)
        if not is_finished(folder, run):
            missing.append(run.run_id)
            continue
        summary = json.loads((folder / "summary.json").read_text())
        results.append(RunResult(run, load_metrics(folder / "metrics.jsonl"), summary))
    return results, missing


def _mean_std(values: list[float]) -> tuple[float, float]:
    mean = statistics.fmean(values)
    return mean, statistics.stdev(values) if len(values) > 1 else 0.0


def _fmt(values: list[float], signed: bool = False) -> str:
    if not values:
        return "–"
    mean, std = _mean_std(values)
    head = f"{mean:+.4f}" if signed else f"{mean:.4f}"
    return f"{head} ± {std:.4f}" if len(values) > 1 else head


def write_csv(results: Iterable[RunResult], grid: Grid, path: Path) -> Path:
    """One row per finished run: its axes, final/best/initial metric and communication."""
    results = list(results)
    axis_keys = sorted({k for r in results for k in r.run.axes})
    metric = grid.metric
    fields = [
        "run_id",
        "blocks",
        *axis_keys,
        f"final_{metric}",
        f"best_{metric}",
        f"initial_{metric}",
        "rounds",
        "total_params",
        "wall_seconds",
        "params_to_target",
    ]
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=fields)
        writer.writeheader()
        for result in results:
            run = result.run
            target = grid.targets.get(str(run.setting("task")))
            writer.writerow({
                "run_id": run.run_id,
                "blocks": "+".join(run.blocks),
                **{k: run.setting(k) for k in axis_keys},
                f"final_{metric}": result.value(metric),
                f"best_{metric}": result.best(metric),
                f"initial_{metric}": result.initial(metric),
                "rounds": result.summary.get("rounds"),
                "total_params": result.summary.get("total-params"),
                "wall_seconds": round(float(result.summary.get("wall-seconds", math.nan)), 1),
                "params_to_target": (
                    None if target is None else params_to_target(result.rows, target, metric)
                ),
            })  # fmt: skip
    return path


def _by_setting(results: Iterable[RunResult]) -> dict[tuple, list[RunResult]]:
    groups: dict[tuple, list[RunResult]] = defaultdict(list)
    for result in results:
        groups[result.setting].append(result)
    return groups


def _pivot_table(
    results: list[RunResult],
    value: Callable[[RunResult], float | None],
    signed: bool = False,
) -> list[str]:
    """Methods as rows, tasks as columns (the main block's shape); ``value`` of each run,
    mean ± std over seeds."""
    tasks = sorted({str(r.run.setting("task")) for r in results})
    methods = list(dict.fromkeys(str(r.run.setting("method")) for r in results))
    lines = ["| method | " + " | ".join(tasks) + " |", "|---|" + "---|" * len(tasks)]
    for method in methods:
        cells = []
        for task in tasks:
            values = [
                v for r in results
                if r.run.setting("method") == method and r.run.setting("task") == task
                and (v := value(r)) is not None
            ]  # fmt: skip
            cells.append(f"{_fmt(values, signed)} (n={len(values)})" if values else "–")
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    return lines


def _long_table(results: list[RunResult], metric: str) -> list[str]:
    """One row per setting: its axis values, final metric over seeds, communication, time."""
    groups = _by_setting(results)
    keys = sorted({k for setting in groups for k, _ in setting})
    lines = [
        "| "
        + " | ".join(keys)
        + f" | final {metric} | change from round 0 | seeds | params per run | wall s |",
        "|" + "---|" * (len(keys) + 5),
    ]
    for setting, members in groups.items():
        values = dict(setting)
        finals = [v for r in members if (v := r.value(metric)) is not None]
        gains = [v for r in members if (v := r.gain(metric)) is not None]
        params = statistics.fmean(float(r.summary.get("total-params", 0)) for r in members)
        wall = statistics.fmean(float(r.summary.get("wall-seconds", 0)) for r in members)
        cells = [str(values.get(k, "")) for k in keys]
        lines.append(
            "| " + " | ".join(cells)
            + f" | {_fmt(finals)} | {_fmt(gains, signed=True)} | {len(members)}"
            + f" | {params:.3g} | {wall:.0f} |"
        )  # fmt: skip
    return lines


def communication_lines(results: list[RunResult], grid: Grid) -> list[str]:
    """Parameters sent (up + down) until the target is first reached, per task and method:
    the mean over seeds when every seed reached it, else how many seeds did."""
    if not grid.targets:
        return []
    lines = [
        "| task | target | method | params to target | reached |",
        "|---|---|---|---|---|",
    ]
    for task, target in grid.targets.items():
        per_method: dict[str, list[int | None]] = defaultdict(list)
        for result in results:
            if str(result.run.setting("task")) != task:
                continue
            per_method[str(result.run.setting("method"))].append(
                params_to_target(result.rows, target, grid.metric)
            )
        for method, counts in per_method.items():
            reached = [c for c in counts if c is not None]
            shown = (
                format_params(round(statistics.fmean(reached)))
                if reached and len(reached) == len(counts)
                else format_params(None)
            )
            lines.append(
                f"| {task} | {target:g} | {method} | {shown} | {len(reached)}/{len(counts)} |"
            )
    return lines


def run_machines(environments: Iterable[dict[str, Any] | None]) -> str:
    """The machines runs recorded (each ``summary.json``'s ``environment``), with how many
    runs each; runs from commits that did not record one are counted apart. Runs repeat
    exactly on one machine type, not necessarily across CPUs (flower_app/environment.py)."""
    counts: Counter[str] = Counter(environment_label(e) if e else "" for e in environments)

    def runs(n: int) -> str:
        return f"{n} run" + ("s" if n != 1 else "")

    parts = [f"{label} ({runs(n)})" for label, n in counts.most_common() if label]
    if counts[""]:
        parts.append(f"not recorded ({runs(counts[''])}, from commits before it was)")
    return "; ".join(parts) or "no runs"


def _wall_time(out: Path, results: list[RunResult]) -> str:
    """Sum of the runs' wall times as the runner measured them (flwr run to final status,
    start-up included), from ``grid.json``. A run finished in another worktree (published,
    then copied into this one and skipped) is not in ``grid.json``: its time is the one its
    ServerApp recorded (``wall-seconds`` in its summary.json, without start-up)."""
    try:
        state = json.loads((out / "grid.json").read_text())
    except (OSError, json.JSONDecodeError):
        state = {}
    timed = {k: float(v.get("seconds", 0)) for k, v in state.items() if v["status"] == "finished"}
    own = [r for r in results if r.run.run_id not in timed and "wall-seconds" in r.summary]
    if not timed and not own:
        return "unknown (no grid.json)"
    seconds = sum(timed.values()) + sum(float(r.summary["wall-seconds"]) for r in own)
    count = len(timed) + len(own)
    text = f"{seconds / 60:.1f} min for {count} runs ({seconds / max(count, 1):.0f} s per run)"
    if own:
        text += f"; {len(own)} of them run elsewhere, timed by their ServerApp"
    return text


def _missing_note(missing: list[str], shown: int = 6) -> str:
    if not missing:
        return ""
    more = f", and {len(missing) - shown} more" if len(missing) > shown else ""
    return f" (not finished: {', '.join(missing[:shown])}{more})"


def markdown_report(
    grid: Grid, results: list[RunResult], missing: list[str], plots: list[Path], out: Path
) -> str:
    metric = grid.metric
    machines = run_machines(r.summary.get("environment") for r in results)
    lines = [f"# Grid `{grid.name}`", ""]
    if grid.description:
        lines += [grid.description, ""]
    lines += [
        f"Produced by `python -m florg_lab run {grid.path.stem}` (grid file "
        f"`lab/grids/{grid.path.name}`).",
        "",
        f"Machines the runs recorded: {machines}. Report written on "
        f"{environment_label(describe_environment())}.",
        "",
        f"Wall time: {_wall_time(out, results)}.",
        "",
        f"Runs finished: {len(results)} of {len(grid.runs)}" + _missing_note(missing) + ".",
        f"Values: final-round `{metric}`, mean ± sample standard deviation over seeds.",
        "",
    ]  # fmt: skip
    for block in grid.blocks:
        members = [r for r in results if block in r.run.blocks]
        if not members:
            continue
        lines += [f"## Block `{block}`", ""]
        varied = set(grid.blocks[block])
        if block == MAIN_BLOCK and {"method", "task"} <= varied and len(varied - {"seed"}) == 2:
            lines += _pivot_table(members, lambda r: r.value(metric))
            lines += [
                "",
                f"Change from round 0 (final minus round-0 `{metric}` of the same "
                "run; near 0 means the federated training did not move the model):",
                "",
            ]
            lines += _pivot_table(members, lambda r: r.gain(metric), signed=True)
        else:
            lines += _long_table(members, metric)
        lines.append("")
    comm = communication_lines([r for r in results if MAIN_BLOCK in r.run.blocks], grid)
    if comm:
        lines += ["## Communication to target", "",
                  "Parameters transmitted (up + down, all clients) until the global "
                  f"`{metric}` first reaches the target.", "", *comm, ""]  # fmt: skip
    if plots:
        lines += ["## Plots", ""]
        lines += [f"![{p.stem}]({p.relative_to(out).as_posix()})" for p in plots]
        lines.append("")
    return "\n".join(lines)
