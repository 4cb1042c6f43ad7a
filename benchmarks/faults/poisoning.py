"""Poisoning measured (issue 15, item 2): one of 5 clients attacks FLoRG, with and without
the server's update screening.

Every run is the real Flower App through the real simulation engine (one private
SuperLink for all runs, 5 SuperNodes): all-MiniLM-L6-v2 on the offline movie-sentiment
task, IID, FLoRG, ``aggregation-weights=num-examples`` (so a claimed example count
matters; with IID shares it equals uniform weighting for honest clients). Partition 1 is
the attacker, through the ClientApp's fault injection:

* ``x10`` / ``x100``: it sends its A matrices scaled by 10 / 100 (``fault-kind=scale``);
* ``claim 1e9``: it trains honestly but claims 10^9 examples (``fault-kind=claim``).

For each attack, ``screen-updates`` on (the default, kappa = ``screen-kappa``) and off (the
paper's plain rule). Reported: the final accuracy and loss of the global model, the
relative distance of its A matrices (all layers stacked) from the clean run's,
||A - A_clean||_F / ||A_clean||_F, and the updates screened / claims clipped over the run.
A clean run with a Dirichlet(0.5) split (seed 1, whose partition sizes differ most) and one
local epoch instead of fixed steps, so a client's number of steps follows its data, measures
the honest spread of update distances (``screen-ratio-max``: the largest distance / median
distance of any round) that the threshold kappa must clear.

With ``--workdir``, a run whose folder already holds a summary.json and whose config.json has
the requested settings is not run again (``--fresh`` runs everything).

    python -m benchmarks.faults.poisoning --workdir W --json W/poisoning.json \
        --plot W/poisoning.png
    python -m benchmarks.faults.poisoning --rounds 2 --quick    # smoke test

Nine runs; each took 4.4-7.4 min on 2 CPU cores shared with other work (load average 15-25),
46 min in all (docs/faults.md); an idle machine should need well under half (not measured).

Prints a Markdown table; ``--json PATH`` also writes the numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import REPO_ROOT

NODES = 5
ATTACKER = 1

# (case, attack settings, screening on)
CASES: list[tuple[str, dict[str, Any], bool]] = [
    ("clean", {}, False),
    ("clean", {}, True),
    ("x10", {"fault-kind": "scale", "fault-scale": 10.0}, False),
    ("x10", {"fault-kind": "scale", "fault-scale": 10.0}, True),
    ("x100", {"fault-kind": "scale", "fault-scale": 100.0}, False),
    ("x100", {"fault-kind": "scale", "fault-scale": 100.0}, True),
    ("claim 1e9", {"fault-kind": "claim", "fault-scale": 1e9}, False),
    ("claim 1e9", {"fault-kind": "claim", "fault-scale": 1e9}, True),
]


def settings(args: argparse.Namespace, name: str, extra: dict[str, Any]) -> dict[str, Any]:
    base = {
        "method": "florg",
        "model": args.model,
        "task": args.task,
        "partitioner": "iid",
        "num-server-rounds": args.rounds,
        "min-train-nodes": NODES,
        "min-available-nodes": NODES,
        "max-train-examples": args.train_examples,
        "max-eval-examples": args.eval_examples,
        "max-seq-length": 64,
        "batch-size": 8,
        "local-steps": args.local_steps,
        "learning-rate": args.lr,
        "aggregation-weights": "num-examples",
        "output-dir": "outputs",
        "run-name": name,
    }
    return {**base, **extra}


def _done(run_dir: Path, wanted: dict[str, Any]) -> bool:
    """A finished run of exactly these settings is already in ``run_dir``."""
    try:
        config = json.loads((run_dir / "config.json").read_text())
        finished = json.loads((run_dir / "summary.json").read_text()).get("status")
    except (OSError, ValueError):
        return False
    return finished == "finished" and all(config.get(k) == v for k, v in wanted.items())


def a_matrices(run_dir: Path):
    import numpy as np
    from safetensors.numpy import load_file

    state = load_file(str(run_dir / "adapter.safetensors"))
    return np.concatenate([state[k].ravel() for k in sorted(state) if k.endswith(".A")])


def summarize(run_dir: Path) -> dict[str, Any]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if r["round"] > 0]
    return {
        "accuracy": rows[-1]["accuracy"],
        "loss": rows[-1]["loss"],
        "initial-accuracy": rows[0]["accuracy"],
        "screened": sum(int(r.get("screened", 0)) for r in trained),
        "clipped": sum(int(r.get("clipped", 0)) for r in trained),
        "screen-ratio-max": max((float(r.get("screen-ratio-max", 0)) for r in trained), default=0),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="all-MiniLM-L6-v2")
    parser.add_argument("--task", default="movie-sentiment")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--local-steps", type=int, default=6)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--train-examples", type=int, default=500)
    parser.add_argument("--eval-examples", type=int, default=200)
    parser.add_argument("--quick", action="store_true", help="only clean and x10")
    parser.add_argument("--kappa", type=float, default=None, help="screen-kappa (default: 10)")
    parser.add_argument("--fresh", action="store_true", help="run again what --workdir holds")
    parser.add_argument("--no-dirichlet", action="store_true", help="skip the Dirichlet run")
    parser.add_argument("--workdir", type=Path, default=None, help="keep runs here")
    parser.add_argument("--json", type=Path, default=None, help="also write the numbers here")
    parser.add_argument("--plot", type=Path, default=None, help="also draw the figure here")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

    from florg_tools.flwr_cli import run_flower_app
    from florg_tools.superlink import local_simulation_superlink
    from flower_app.settings.config import defaults

    work = args.workdir or Path(tempfile.mkdtemp(prefix="florg-poisoning-"))
    work = work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("FLORG_DERIVED_CACHE", str(work / "derived-cache"))
    cases = [c for c in CASES if not args.quick or c[0] in ("clean", "x10")]
    runs: list[dict[str, Any]] = []
    t_all = time.monotonic()
    with local_simulation_superlink(
        work / "superlink", NODES, num_cpus_per_client=1, output_root=work
    ) as sim:
        jobs = [
            (case, {**attack, "screen-updates": screen, "fault-partition": ATTACKER}, screen)
            for case, attack, screen in cases
        ]
        if not args.no_dirichlet:
            dirichlet = {"partitioner": "dirichlet", "seed": 1, "local-steps": 0}
            jobs.append(("clean, Dirichlet 0.5, 1 local epoch", dirichlet, True))
        for case, extra, screen in jobs:
            if case.startswith("clean"):
                extra = {k: v for k, v in extra.items() if not k.startswith("fault")}
            if screen:  # named, so a kept run of another kappa is not reused
                extra = {**extra, "screen-kappa": args.kappa or defaults()["screen-kappa"]}
            name = case.replace(" ", "-").replace(",", "").replace(".", "")
            name = f"{name}-screen-{screen}"
            wanted = settings(args, name, extra)
            run_dir = work / "outputs" / name
            t0 = time.monotonic()
            if args.fresh or not _done(run_dir, wanted):
                outcome = run_flower_app(
                    REPO_ROOT, sim.connection, wanted, sim.flwr_home, timeout=1200, stream=None
                )
                if not outcome.ok:
                    print(f"{name}: FAILED {outcome.message}\n{outcome.log_text[-3000:]}")
                    return 1
            seconds = time.monotonic() - t0
            row = {"case": case, "screen": screen, "seconds": seconds, **summarize(run_dir)}
            row["run-dir"] = str(run_dir)
            runs.append(row)
            print(f"{name}: {row}", flush=True)
    clean = next(r for r in runs if r["case"] == "clean" and not r["screen"])
    reference = a_matrices(Path(clean["run-dir"]))
    import numpy as np

    for row in runs:
        if "Dirichlet" in row["case"]:
            row["a-distance"] = None
            continue
        a = a_matrices(Path(row["run-dir"]))
        row["a-distance"] = float(np.linalg.norm(a - reference) / np.linalg.norm(reference))
    total = time.monotonic() - t_all
    kappa = args.kappa or defaults()["screen-kappa"]
    print()
    print(
        f"FLoRG, {args.model}, {args.task}, {NODES} clients (IID), {args.rounds} rounds, "
        f"{args.local_steps} local steps of batch 8, lr {args.lr:g}, "
        f"{args.train_examples} training / {args.eval_examples} validation examples, "
        f"aggregation-weights=num-examples, screen-kappa {kappa:g}; "
        f"attacker: partition {ATTACKER}; {total / 60:.1f} min"
    )
    print()
    print(
        "| attack | screening | final accuracy | final loss | ‖A − A_clean‖ / ‖A_clean‖ "
        "| screened | clipped | max distance / median |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for row in runs:
        dist = "—" if row["a-distance"] is None else f"{row['a-distance']:.3g}"
        print(
            f"| {row['case']} | {'on' if row['screen'] else 'off'} | {row['accuracy']:.3f} | "
            f"{row['loss']:.4g} | {dist} | {row['screened']} | {row['clipped']} | "
            f"{row['screen-ratio-max']:.2f} |"
        )
    if args.json:
        args.json.write_text(json.dumps({"runs": runs, "minutes": total / 60}, indent=2) + "\n")
    if args.plot:
        plot(runs, args.plot, kappa)
    return 0


def plot(runs: list[dict[str, Any]], path: Path, kappa: float) -> None:
    """Two panels per attack, screening off / on: the global A's relative distance from
    the clean run's (log scale) and the final accuracy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    attacks = [c for c in dict.fromkeys(r["case"] for r in runs) if "Dirichlet" not in c]
    by = {(r["case"], r["screen"]): r for r in runs}
    x = np.arange(len(attacks))
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
    for offset, screen, color in ((-0.2, False, "tab:red"), (0.2, True, "tab:blue")):
        label = f"screening on (kappa {kappa:g})" if screen else "screening off"
        dist = [max(by[(a, screen)]["a-distance"], 1e-6) for a in attacks]
        acc = [by[(a, screen)]["accuracy"] for a in attacks]
        left.bar(x + offset, dist, 0.4, label=label, color=color)
        right.bar(x + offset, acc, 0.4, label=label, color=color)
    left.set_yscale("log")
    left.set_ylabel("||A - A_clean|| / ||A_clean||")
    right.set_ylabel("final accuracy")
    right.axhline(by[("clean", False)]["accuracy"], color="gray", ls="--", lw=1)
    for ax in (left, right):
        ax.set_xticks(x, attacks)
        ax.set_xlabel("partition 1 of 5 sends")
    left.legend(fontsize=8)
    fig.suptitle("FLoRG, one poisoning client of five (benchmarks.faults.poisoning)", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
