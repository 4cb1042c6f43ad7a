"""Matplotlib PNGs of a grid's results (headless: the Agg backend).

- ``metric_vs_round.png``: the headline metric per round, one line per method (mean over
  seeds, band = min..max), one panel per task;
- ``metric_vs_communication.png``: the same against cumulative parameters sent (log axis);
- ``final_metric.png``: final-round metric per method and task, mean ± std, seeds as dots;
- ``florg_diagnostics.png``: FLoRG's drift and gram_rel_error per round for the runs of the
  blocks named in ``report.compare`` (e.g. with and without Procrustes);
- ``ablation_<block>.png``: final metric against the block's varied setting.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)

from florg_lab.aggregate import RunResult  # noqa: E402
from florg_lab.grid import MAIN_BLOCK, Grid  # noqa: E402

__all__ = ["write_plots"]


def _curves(
    results: list[RunResult], metric: str, x_of: Callable[[dict[str, Any]], float]
) -> dict[str, tuple[list[float], list[float], list[float], list[float]]]:
    """Per label: x, mean, min, max of ``metric`` over the runs (aligned by round)."""
    by_label: dict[str, dict[int, list[tuple[float, float]]]] = defaultdict(
        lambda: defaultdict(list)
    )
    for result in results:
        label = str(result.run.setting("method"))
        for row in result.rows:
            if row.get(metric) is not None:
                by_label[label][row["round"]].append((x_of(row), float(row[metric])))
    curves = {}
    for label, rounds in by_label.items():
        xs, means, lows, highs = [], [], [], []
        for round_ in sorted(rounds):
            points = rounds[round_]
            values = [v for _, v in points]
            xs.append(statistics.fmean(x for x, _ in points))
            means.append(statistics.fmean(values))
            lows.append(min(values))
            highs.append(max(values))
        curves[label] = (xs, means, lows, highs)
    return curves


def _panels(tasks: list[str]) -> tuple[plt.Figure, list[plt.Axes]]:
    fig, axes = plt.subplots(1, len(tasks), figsize=(5 * len(tasks), 4), squeeze=False)
    return fig, list(axes[0])


def _line_plot(results: list[RunResult], metric: str, path: Path, *, communication: bool) -> Path:
    tasks = sorted({str(r.run.setting("task")) for r in results})
    fig, axes = _panels(tasks)
    for ax, task in zip(axes, tasks, strict=True):
        members = [r for r in results if str(r.run.setting("task")) == task]
        if communication:

            def x_of(row: dict[str, Any]) -> float:
                return float(row.get("cum-up-params", 0) + row.get("cum-down-params", 0))
        else:

            def x_of(row: dict[str, Any]) -> float:
                return float(row["round"])

        for label, (xs, means, lows, highs) in _curves(members, metric, x_of).items():
            if communication:  # round 0 sent nothing: not on a log axis
                keep = [i for i, x in enumerate(xs) if x > 0]
                xs, means, lows, highs = ([s[i] for i in keep] for s in (xs, means, lows, highs))
            (line,) = ax.plot(xs, means, marker="o", markersize=3, label=label)
            ax.fill_between(xs, lows, highs, color=line.get_color(), alpha=0.15)
        if communication:
            ax.set_xscale("log")
            ax.set_xlabel("cumulative parameters sent (up + down)")
        else:
            ax.set_xlabel("round")
        ax.set_title(task)
        ax.set_ylabel(metric)
        ax.grid(alpha=0.3)
    axes[-1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _final_plot(results: list[RunResult], metric: str, path: Path) -> Path:
    tasks = sorted({str(r.run.setting("task")) for r in results})
    methods = list(dict.fromkeys(str(r.run.setting("method")) for r in results))
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(tasks) * len(methods) / 3), 4))
    width = 0.8 / max(1, len(methods))
    for m, method in enumerate(methods):
        for t, task in enumerate(tasks):
            values = [
                v for r in results
                if r.run.setting("method") == method and str(r.run.setting("task")) == task
                and (v := r.value(metric)) is not None
            ]  # fmt: skip
            if not values:
                continue
            x = t + (m - (len(methods) - 1) / 2) * width
            std = statistics.stdev(values) if len(values) > 1 else 0.0
            ax.bar(
                x,
                statistics.fmean(values),
                width,
                yerr=std,
                capsize=3,
                color=f"C{m}",
                label=method if t == 0 else None,
            )
            ax.scatter([x] * len(values), values, color="black", s=8, zorder=3)
    ax.set_xticks(range(len(tasks)), tasks)
    ax.set_ylabel(f"final {metric}")
    ax.legend(fontsize=8, ncol=2)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _diagnostics_plot(results: list[RunResult], path: Path) -> Path | None:
    keys = ("drift", "gram_rel_error")
    if not any(r.rows and any(k in row for row in r.rows for k in keys) for r in results):
        return None
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key in zip(axes, keys, strict=True):
        for label, (xs, means, lows, highs) in _curves(
            results, key, lambda row: float(row["round"])
        ).items():
            (line,) = ax.plot(xs, means, marker="o", markersize=3, label=label)
            ax.fill_between(xs, lows, highs, color=line.get_color(), alpha=0.15)
        ax.set_xlabel("round")
        ax.set_ylabel(key)
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _ablation_plot(results: list[RunResult], block: str, grid: Grid, path: Path) -> Path | None:
    varied = [k for k in grid.blocks[block] if k not in ("seed", "method")]
    if len(varied) != 1:
        return None
    key = varied[0]
    values = list(dict.fromkeys(grid.blocks[block][key]))
    fig, ax = plt.subplots(figsize=(5, 4))
    by_method: dict[str, dict[Any, list[float]]] = defaultdict(lambda: defaultdict(list))
    for r in results:
        if (v := r.value(grid.metric)) is not None:
            by_method[str(r.run.setting("method"))][r.run.setting(key)].append(v)
    for method, points in by_method.items():
        xs = [i for i, value in enumerate(values) if points.get(value)]
        means = [statistics.fmean(points[values[i]]) for i in xs]
        ax.plot(xs, means, marker="o", label=method)
    ax.set_xticks(range(len(values)), [str(v) for v in values])
    ax.set_xlabel(key)
    ax.set_ylabel(f"final {grid.metric}")
    ax.set_title(f"ablation: {block}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_plots(grid: Grid, results: list[RunResult], out: Path) -> list[Path]:
    """Write every plot that the grid's finished runs support; return their paths."""
    folder = out / "plots"
    folder.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    main = [r for r in results if MAIN_BLOCK in r.run.blocks] or results
    if main:
        metric = grid.metric
        written.append(
            _line_plot(main, metric, folder / "metric_vs_round.png", communication=False)
        )
        written.append(
            _line_plot(main, metric, folder / "metric_vs_communication.png", communication=True)
        )
        written.append(_final_plot(main, metric, folder / "final_metric.png"))
    compared = [r for r in results if set(r.run.blocks) & set(grid.compare)]
    if compared and (path := _diagnostics_plot(compared, folder / "florg_diagnostics.png")):
        written.append(path)
    for block in grid.blocks:
        members = [r for r in results if block in r.run.blocks]
        if block != MAIN_BLOCK and members:
            path = _ablation_plot(members, block, grid, folder / f"ablation_{block}.png")
            if path is not None:
                written.append(path)
    return written
