"""Round-to-round behaviour of a grid's runs: the per-round validation accuracy, the rounds
whose global model predicts one class, and the largest change between consecutive rounds.

    python -m florg_tools.experiments.swings docs/results/evidence/runs/evidence \
        [--one-class 0.47] [--seed 0]

prints a markdown table, one row per finished run (learning rate, method), as in
docs/results.md ("What the tuning runs show so far").
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from itertools import pairwise
from pathlib import Path

from florg_tools.experiments.communication import load_metrics

HEADER = (
    "| lr | method | validation accuracy, rounds 0-T | rounds at one class | largest swing "
    "| test, final |\n|---|---|---|---|---|---|"
)


def swing_row(folder: Path, one_class: float, tolerance: float = 0.005) -> str | None:
    """The table row of a finished run folder, or None when it has not finished."""
    try:
        summary = json.loads((folder / "summary.json").read_text())
        config = json.loads((folder / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None
    if summary.get("status") != "finished":
        return None
    rows = load_metrics(folder / "metrics.jsonl")
    accuracy = [float(r["accuracy"]) for r in rows if r.get("accuracy") is not None]
    trained = accuracy[1:]  # after round 0, the model before any training
    stuck = sum(1 for a in trained if abs(a - one_class) < tolerance)
    swing = max((abs(b - a) for a, b in pairwise(trained)), default=0.0)
    test = summary.get("final-test-score")
    return (
        f"| {config['learning-rate']:g} | {config['method']} | "
        f"{' '.join(f'{a:.2f}' for a in accuracy)} | {stuck} | {swing:.3f} | "
        f"{'–' if test is None else f'{test:.3f}'} |"
    )


def swing_table(runs: Path, one_class: float, seed: int | None = None) -> str:
    rows = []
    for folder in sorted(p for p in Path(runs).iterdir() if p.is_dir()):
        try:
            config = json.loads((folder / "config.json").read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if seed is not None and config.get("seed") != seed:
            continue
        row = swing_row(folder, one_class)
        if row is not None:
            rows.append((float(config["learning-rate"]), str(config["method"]), row))
    return "\n".join([HEADER, *(row for *_, row in sorted(rows))])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m florg_tools.experiments.swings", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    parser.add_argument("runs", type=Path, help="a grid's runs folder (one folder per run)")
    parser.add_argument(
        "--one-class", type=float, default=0.47,
        help="the validation accuracy of a model predicting one class (movie sentiment: 0.47)",
    )  # fmt: skip
    parser.add_argument("--seed", type=int, default=None, help="only runs of this seed")
    args = parser.parse_args(argv)
    print(swing_table(args.runs, args.one_class, args.seed))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
