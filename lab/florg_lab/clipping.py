"""The clipping norm C for a private run, read from non-private runs (docs/privacy.md,
"Choosing C"; issue 29's privacy-utility grid).

    python -m florg_lab.clipping RUN_DIR [RUN_DIR ...]

Every round's metrics row carries ``update-norm-median`` and ``update-norm-max``:
‖replyₙ − sent‖ over all the arrays a client sends, the unit ``dp=central`` clips for the
mean methods and for FLoRG. Per run this prints the median over the training rounds of
``update-norm-median`` (C there clips about half the clients in a typical round) and the
largest ``update-norm-max``; per method, C = the median of its runs' medians, the value to
put into the private grid's ``dp-clipping-norm``. A run written before these keys existed
is named and skipped (rerun it at a commit that writes them).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from florg_lab.communication import load_metrics
from florg_lab.runs import finished_run

__all__ = ["RunNorms", "clipping_norms", "run_norms"]

MEDIAN_KEY = "update-norm-median"
MAX_KEY = "update-norm-max"


@dataclass(frozen=True)
class RunNorms:
    """One run's update norms over its training rounds."""

    run: str
    method: str
    rounds: int
    median: float  # median over rounds of the round's median client update norm
    largest: float  # the largest client update norm of any round


def run_norms(run_dir: Path) -> RunNorms | None:
    """The update norms of a finished run, or ``None`` when its rows do not carry them;
    ``ValueError`` for a folder that holds no finished run."""
    found = finished_run(run_dir)
    if found is None:
        raise ValueError(f"{run_dir}: not a finished run (summary.json, config.json)")
    _, config = found
    rows = [r for r in load_metrics(run_dir / "metrics.jsonl") if r.get("round", 0) >= 1]
    medians = [float(r[MEDIAN_KEY]) for r in rows if r.get(MEDIAN_KEY) is not None]
    if not medians:
        return None
    largest = max(float(r[MAX_KEY]) for r in rows if r.get(MAX_KEY) is not None)
    return RunNorms(
        run=run_dir.name,
        method=str(config.get("method", "?")),
        rounds=len(medians),
        median=float(np.median(medians)),
        largest=largest,
    )


def clipping_norms(norms: Sequence[RunNorms]) -> dict[str, float]:
    """Per method, C = the median of its runs' median update norms."""
    by_method: dict[str, list[float]] = {}
    for n in norms:
        by_method.setdefault(n.method, []).append(n.median)
    return {m: float(np.median(v)) for m, v in sorted(by_method.items())}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m florg_lab.clipping", description=__doc__.split("\n")[0]
    )
    parser.add_argument("runs", nargs="+", type=Path, help="finished run folders")
    args = parser.parse_args(argv)
    found: list[RunNorms] = []
    for run_dir in args.runs:
        try:
            norms = run_norms(run_dir)
        except ValueError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
        if norms is None:
            print(f"skipped {run_dir}: its rows carry no {MEDIAN_KEY} (an older commit)")
            continue
        found.append(norms)
    if not found:
        print("no run carries update norms", file=sys.stderr)
        return 1
    print("| run | method | rounds | median update norm | largest update norm |")
    print("|---|---|---|---|---|")
    for n in found:
        print(f"| {n.run} | {n.method} | {n.rounds} | {n.median:.4g} | {n.largest:.4g} |")
    print()
    for method, c in clipping_norms(found).items():
        print(f"{method}: dp-clipping-norm = {c:.3g}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
