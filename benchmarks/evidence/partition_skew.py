"""How label-skewed each seed's client partitions are, beside each method's test score.

    python -m benchmarks.evidence.partition_skew --grid evidence-snli \
        --summary lab/evidence/evidence/summary.json
    python -m benchmarks.evidence.partition_skew --grid evidence \
        --summary lab/evidence/evidence/summary.json

A grid's seed sets the Dirichlet (rho) draw that splits the training pool over the
clients, so two seeds of one grid federate different problems: one seed's clients may
each hold all labels, another's one label each. This prints, per seed of the grid's
main block, every client's label counts (exactly the rows its ClientApp trains on:
``tokenized_split(config, "train", partition_id, num_supernodes)``) and the partition's
**label balance**: the example-weighted mean over clients of the label entropy divided
by ln K (1 = every client holds the K labels in equal shares; 0 = every client holds one
label). With ``--summary`` (the evidence report's ``summary.json``) it adds each method's
final-round test score per seed and the Spearman rank correlation between balance and
score over the seeds; with five seeds that correlation is descriptive, not a test.
``--dirichlet-alpha RHO`` partitions the same training pool with another rho instead of
the grid's (how balanced a milder or harsher split of the same seeds would be; no scores,
since no run trained on it):

    python -m benchmarks.evidence.partition_skew --grid evidence-snli --dirichlet-alpha 5
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from florg_lab.grid import MAIN_BLOCK, Grid, GridError, load_grid


def label_balance(counts: Sequence[Sequence[int]]) -> float:
    """Example-weighted mean over clients of H(client's labels) / ln K; K = len(counts[0])."""
    num_labels = len(counts[0])
    total = sum(sum(client) for client in counts)
    if num_labels < 2 or total == 0:
        raise ValueError("label balance needs at least 2 labels and 1 example")
    weighted = 0.0
    for client in counts:
        size = sum(client)
        entropy = -sum(c / size * math.log(c / size) for c in client if c)
        weighted += size / total * entropy
    return weighted / math.log(num_labels)


def spearman(x: Sequence[float], y: Sequence[float]) -> float | None:
    """Spearman's rank correlation (ties get their mean rank); None if a side is constant."""
    from scipy.stats import spearmanr

    if len(x) != len(y) or len(x) < 2:
        raise ValueError("spearman needs two sequences of the same length, at least 2")
    if len(set(x)) < 2 or len(set(y)) < 2:
        return None
    return float(spearmanr(x, y).statistic)


def seed_settings(grid: Grid) -> dict[int, dict[str, Any]]:
    """The run-config overrides of the main block's runs per seed, method and learning
    rate left out: a partition depends on the seed and the data settings only."""
    axes = grid.blocks.get(MAIN_BLOCK, {})
    tasks = axes.get("task", [grid.base.get("task")])
    if len(tasks) != 1 or tasks[0] is None:
        raise GridError(f"{grid.path}: one task per grid expected, found {tasks}")
    seeds = axes.get("seed", [grid.base.get("seed", 0)])
    return {int(seed): {**grid.base, "task": tasks[0], "seed": int(seed)}
            for seed in sorted(seeds)}  # fmt: skip


def client_label_counts(overrides: dict[str, Any], num_clients: int) -> list[list[int]]:
    """Every client's label counts, from the rows its ClientApp trains on."""
    from flower_app.settings.config import resolve_config
    from flower_app.task_data import load_task_data, tokenized_split

    config = resolve_config({}, overrides)
    data = load_task_data(config)
    if data.spec.kind != "classification":
        raise ValueError(f"task {config.task}: label skew needs a classification task")
    counts = []
    for pid in range(num_clients):
        labels = tokenized_split(config, "train", pid, num_clients).with_format(None)["labels"]
        tally = Counter(int(label) for label in labels)
        counts.append([tally.get(k, 0) for k in range(data.num_labels)])
    return counts


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--grid", required=True, help="a grid file or a name in lab/grids/")
    parser.add_argument("--summary", type=Path, help="the evidence report's summary.json")
    parser.add_argument("--json", type=Path, help="also write the table here")
    parser.add_argument(
        "--dirichlet-alpha",
        type=float,
        default=None,
        metavar="RHO",
        help="partition with this Dirichlet rho instead of the grid's",
    )
    args = parser.parse_args(argv)
    if args.dirichlet_alpha is not None and not args.dirichlet_alpha > 0:
        parser.error(f"--dirichlet-alpha must be > 0, got {args.dirichlet_alpha}")
    if args.dirichlet_alpha is not None and args.summary is not None:
        parser.error("--summary scores the grid's own partitions: leave out --dirichlet-alpha")
    if args.summary is not None and not args.summary.is_file():
        parser.error(f"--summary {args.summary}: no such file")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        grid = load_grid(args.grid)
    except GridError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    try:
        settings = seed_settings(grid)
    except GridError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.dirichlet_alpha is not None:
        if settings[next(iter(settings))].get("partitioner") != "dirichlet":
            print(f"error: {grid.name} does not partition by Dirichlet draws", file=sys.stderr)
            return 2
        for overrides in settings.values():
            overrides["dirichlet-alpha"] = args.dirichlet_alpha
    task = str(settings[next(iter(settings))]["task"])
    scores: dict[str, dict[int, float]] = {}
    if args.summary is not None:
        methods = json.loads(args.summary.read_text())["tasks"].get(task, {}).get("methods", {})
        for method, entry in methods.items():
            scores[method] = dict(zip(entry["seeds"], entry["test_final"], strict=True))
    print(f"{grid.name}: task {task}, {grid.num_supernodes} clients, Dirichlet rho = "
          f"{settings[next(iter(settings))].get('dirichlet-alpha')}")  # fmt: skip
    rows = []
    for seed, overrides in settings.items():
        print(f"  seed {seed}: partitioning ...", file=sys.stderr, flush=True)
        counts = client_label_counts(overrides, grid.num_supernodes)
        rows.append({"seed": seed, "balance": label_balance(counts), "clients": counts})
    methods = [m for m in scores if any(row["seed"] in scores[m] for row in rows)]
    widths = [max(10, len(m)) for m in methods]
    header = "  ".join(f"{m:>{w}}" for m, w in zip(methods, widths, strict=True))
    print(f"seed  balance  {header}  client label counts")
    for row in rows:
        cells = [scores[m].get(row["seed"]) for m in methods]
        text = "  ".join(f"{c:{w}.3f}" if c is not None else f"{'-':>{w}}"
                         for c, w in zip(cells, widths, strict=True))  # fmt: skip
        clients = " ".join("/".join(map(str, c)) for c in row["clients"])
        print(f"{row['seed']:>4}  {row['balance']:7.3f}  {text}  {clients}")
    correlations: dict[str, float | None] = {}
    for method in methods:
        pairs = [(row["balance"], scores[method][row["seed"]]) for row in rows
                 if row["seed"] in scores[method]]  # fmt: skip
        if len(pairs) >= 3:
            correlations[method] = spearman(*zip(*pairs, strict=True))
    if correlations:
        shown = [f"{m} {'n/a' if r is None else f'{r:+.2f}'}" for m, r in correlations.items()]
        print("Spearman(balance, test score) over seeds: " + ", ".join(shown))
    if args.json is not None:
        args.json.write_text(json.dumps(
            {"grid": grid.name, "task": task, "seeds": rows, "spearman": correlations},
            indent=2) + "\n")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
