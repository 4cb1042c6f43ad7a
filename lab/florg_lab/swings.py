"""Round-to-round behaviour of a grid's runs: the per-round validation accuracy, the rounds
whose global model predicts one class, and the largest change between consecutive rounds.

    python -m florg_lab.swings lab/evidence/evidence/runs/evidence \
        [--one-class 0.47] [--seed 0] [--florg]

prints a markdown table, one row per finished run (learning rate, method), as in
lab/evidence/evidence/NOTES.md ("Round-to-round swings: a first diagnosis"). With
``--florg`` it prints, per finished FLoRG run, whether the server step moves with the
swings: the range of the round's Gram error of the rank-r factor (``gram_rel_error``) and
of the drift of A (``drift``), their correlation over rounds with the absolute change of
validation accuracy, and their mean in the rounds where accuracy fell by more than 0.1
against the other rounds.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from itertools import pairwise
from pathlib import Path

import numpy as np

from florg_lab.communication import load_metrics
from florg_lab.runs import finished_run

HEADER = (
    "| lr | method | validation accuracy, rounds 0-T | rounds at one class | largest swing "
    "| test, final |\n|---|---|---|---|---|---|"
)


def swing_row(folder: Path, one_class: float, tolerance: float = 0.005) -> str | None:
    """The table row of a finished run folder, or None when it has not finished."""
    found = finished_run(folder)
    if found is None:
        return None
    summary, config = found
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


FLORG_HEADER = (
    "| lr | seed | method | gram_rel_error, range | drift, range | corr(abs change, Gram "
    "error) | corr(abs change, drift) | Gram error: drops / other rounds | drift: drops / "
    "other rounds |\n|---|---|---|---|---|---|---|---|---|"
)
DROP = 0.1  # a fall in validation accuracy between consecutive rounds worth the name


def _corr(a: np.ndarray, b: np.ndarray) -> str:
    if len(a) < 3 or np.std(a) == 0 or np.std(b) == 0:
        return "–"
    return f"{np.corrcoef(a, b)[0, 1]:+.2f}"


def _split_means(values: np.ndarray, drops: np.ndarray) -> str:
    if not drops.any() or drops.all():
        return "–"
    return f"{values[drops].mean():.3f} / {values[~drops].mean():.3f}"


def florg_row(folder: Path) -> str | None:
    """The ``--florg`` row of a finished FLoRG run folder (None otherwise)."""
    found = finished_run(folder)
    if found is None:
        return None
    config = found[1]
    if not str(config["method"]).startswith("florg"):
        return None
    metrics = [r for r in load_metrics(folder / "metrics.jsonl") if r.get("accuracy") is not None]
    by_round = {int(r["round"]): float(r["accuracy"]) for r in metrics}
    # The change of round t is measured from round t-1 (both validated).
    rows = [
        r
        for r in metrics
        if r.get("gram_rel_error") is not None and int(r["round"]) - 1 in by_round
    ]
    if not rows:
        return None
    change = np.array([by_round[int(r["round"])] - by_round[int(r["round"]) - 1] for r in rows])
    gram = np.array([float(r["gram_rel_error"]) for r in rows])
    drift = np.array([float(r["drift"]) for r in rows])
    drops = change < -DROP
    variant = "" if config.get("rank-mismatch", "procrustes") == "procrustes" else (
        f" rank-mismatch={config['rank-mismatch']}")  # fmt: skip
    return (
        f"| {config['learning-rate']:g} | {config['seed']} | {config['method']}{variant} | "
        f"{gram.min():.3f}-{gram.max():.3f} | {drift.min():.3f}-{drift.max():.3f} | "
        f"{_corr(np.abs(change), gram)} | {_corr(np.abs(change), drift)} | "
        f"{_split_means(gram, drops)} | {_split_means(drift, drops)} |"
    )


def florg_table(runs: Path, seed: int | None = None) -> str:
    rows = []
    for folder in sorted(p for p in Path(runs).iterdir() if p.is_dir()):
        try:
            config = json.loads((folder / "config.json").read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if seed is not None and config.get("seed") != seed:
            continue
        row = florg_row(folder)
        if row is not None:
            key = (float(config["learning-rate"]), int(config["seed"]), str(config["method"]))
            rows.append((key, row))
    return "\n".join([FLORG_HEADER, *(row for _, row in sorted(rows))])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m florg_lab.swings", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    parser.add_argument("runs", type=Path, help="a grid's runs folder (one folder per run)")
    parser.add_argument(
        "--one-class", type=float, default=0.47,
        help="the validation accuracy of a model predicting one class (movie sentiment: 0.47)",
    )  # fmt: skip
    parser.add_argument("--seed", type=int, default=None, help="only runs of this seed")
    parser.add_argument(
        "--florg", action="store_true",
        help="FLoRG's server step against the swings (Gram error, drift) instead",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.florg:
        print(florg_table(args.runs, args.seed))
    else:
        print(swing_table(args.runs, args.one_class, args.seed))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
