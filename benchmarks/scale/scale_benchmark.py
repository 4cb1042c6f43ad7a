"""The cost of scale: N SuperNodes, K clients per round, tiny local work, through the Flower
simulation (one private SuperLink per cell), on this machine.

    python -m benchmarks.scale.scale_benchmark                       # the full grid
    python -m benchmarks.scale.scale_benchmark --cells 10x10,100x50  # some cells (NxK)
    python -m benchmarks.scale.scale_benchmark --quick               # tiny model, 1 cell

Full grid: N in {10, 100, 1000}, K in {10, 50, 500} with K <= N; FLoRG on all-MiniLM-L6-v2
and movie sentiment (the fetched assets), 2 local steps of batch 8 per client, rank 4,
``--rounds`` rounds (default 3: round 1 pays the actors' model load and imports, the later
rounds are what a long run pays per round). ``--quick``: the tests' tiny BERT and synthetic
sentiment task (made in the output folder), N = 4, K = 2, 2 rounds, in well under a minute.

Per cell and round (``benchmarks/scale/measure.py`` says how each is measured): the round's
wall time, a client's time (round wall x actors / K) split into training (its local steps,
as the ClientApp times them) and everything else, the server's aggregation time, and the
peak memory of all the run's processes. Printed as a table (the rounds after the first,
averaged); written to ``--out`` as ``scale.json``, ``scale.md`` and ``scale.png`` (time per
round against K, with the training-only bound K T / A).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import REPO_ROOT
from benchmarks.scale.measure import Cell, run_cell

FULL_CELLS = (
    Cell(10, 10),
    Cell(100, 10),
    Cell(100, 50),
    Cell(1000, 10),
    Cell(1000, 50),
    Cell(1000, 500),
)
QUICK_CELLS = (Cell(4, 2),)
TARGET_RATIO = 0.25  # everything else at most 0.25 x a client's training, at K = 500


def parse_cells(text: str) -> tuple[Cell, ...]:
    cells = []
    for part in text.split(","):
        n, _, k = part.strip().lower().partition("x")
        if not (n.isdigit() and k.isdigit()) or not 0 < int(k) <= int(n):
            raise argparse.ArgumentTypeError(f"a cell is NxK with 0 < K <= N, got {part!r}")
        cells.append(Cell(int(n), int(k)))
    return tuple(cells)


def real_assets() -> dict[str, str]:
    """MiniLM and movie sentiment, as the CPU default runs them (``florg assets fetch``)."""
    return {"model": "all-MiniLM-L6-v2", "task": "movie-sentiment"}


def tiny_assets(folder: Path) -> dict[str, str]:
    """The tests' tiny BERT and synthetic sentiment task, made in ``folder``."""
    from florg_tools.synthetic import make_sentiment_task, make_tiny_bert

    model, task = folder / "tiny-bert", folder / "sentiment"
    if not (model / "config.json").exists():
        make_tiny_bert(model)
    if not (task / "train.jsonl").exists():
        make_sentiment_task(task)
    return {"model": str(model), "task": "local", "data-path": str(task), "text-fields": "sentence"}


def summary_row(result: dict[str, Any]) -> dict[str, Any]:
    """The cell's rounds after the first, averaged (all rounds when there is only one)."""
    rounds = result["rounds"][1:] or result["rounds"]

    def mean(key: str) -> float:
        values = [r[key] for r in rounds if r.get(key) is not None]
        return statistics.fmean(values) if values else math.nan

    keys = ("round-seconds", "client-seconds", "train-seconds", "other-seconds")
    keys += ("overhead-ratio", "training-bound-seconds", "agg-seconds")
    return {
        "N": result["nodes"],
        "K": result["per-round"],
        "rounds": [r["round"] for r in rounds],
        "actors": result["actors"],
        **{key: mean(key) for key in keys},
        "peak-memory-gib": result["peak-memory-bytes"] / 2**30,
        "above-idle-gib": (result["peak-memory-bytes"] - result["idle-memory-bytes"]) / 2**30,
    }


def table(rows: list[dict[str, Any]]) -> str:
    head = (
        "| N | K | round wall (s) | training-only bound K·T/A (s) | per client (s) | "
        "training T (s) | everything else (s) | else / training | aggregation (s) | "
        "peak memory (GiB) | above idle (GiB) |"
    )
    lines = [head, "|" + "---|" * 11]
    for r in rows:
        lines.append(
            f"| {r['N']:,} | {r['K']} | {r['round-seconds']:.1f} | "
            f"{r['training-bound-seconds']:.1f} | {r['client-seconds']:.3f} | "
            f"{r['train-seconds']:.3f} | {r['other-seconds']:.3f} | {r['overhead-ratio']:.2f} | "
            f"{r['agg-seconds']:.3f} | {r['peak-memory-gib']:.2f} | {r['above-idle-gib']:.2f} |"
        )
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """Time per round against K, one line per N, beside the training-only bound."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for n in sorted({r["N"] for r in rows}):
        mine = sorted((r for r in rows if r["N"] == n), key=lambda r: r["K"])
        ks = [r["K"] for r in mine]
        ax.plot(ks, [r["round-seconds"] for r in mine], "o-", label=f"round wall, N={n:,}")
        ax.plot(
            ks, [r["training-bound-seconds"] for r in mine], "x--", label=f"training only, N={n:,}"
        )
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("K, clients per round")
    ax.set_ylabel("seconds per round")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, N=4, K=2, 2 rounds")
    parser.add_argument("--cells", type=parse_cells, default=None, help="NxK,NxK,...")
    parser.add_argument("--rounds", type=int, default=None, help="rounds per cell (3; quick 2)")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "outputs" / "benchmarks" / "scale")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds per cell")
    parser.add_argument("--work", type=Path, default=None, help="scratch folder (default: temp)")
    args = parser.parse_args(argv)
    cells = args.cells or (QUICK_CELLS if args.quick else FULL_CELLS)
    rounds = args.rounds or (2 if args.quick else 3)
    args.out.mkdir(parents=True, exist_ok=True)
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="florg-scale-") as tmp:
        work = args.work or Path(tmp)
        assets = tiny_assets(work / "assets") if args.quick else real_assets()
        for cell in cells:
            t0 = time.perf_counter()
            print(f"[scale] {cell.label}, {rounds} rounds ...", flush=True)
            result = run_cell(cell, rounds, work / f"n{cell.nodes}-k{cell.per_round}", assets,
                              args.timeout)  # fmt: skip
            results.append(result)
            row = summary_row(result)
            took = time.perf_counter() - t0
            print(f"[scale] {cell.label}: {row['round-seconds']:.1f} s per round, else/train "
                  f"{row['overhead-ratio']:.2f} ({took:.0f} s)", flush=True)  # fmt: skip
            (args.out / "scale.json").write_text(json.dumps(results, indent=1))
    rows = [summary_row(r) for r in results]
    text = table(rows)
    (args.out / "scale.md").write_text(text + "\n")
    plot(rows, args.out / "scale.png")
    print(text)
    at_500 = [r for r in rows if r["K"] == 500]
    for r in at_500:
        verdict = "met" if r["overhead-ratio"] <= TARGET_RATIO else "missed"
        print(f"K=500, N={r['N']}: everything else / training = {r['overhead-ratio']:.2f} "
              f"(target <= {TARGET_RATIO}): {verdict}")  # fmt: skip
    print(f"written: {args.out}/scale.json, scale.md, scale.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
