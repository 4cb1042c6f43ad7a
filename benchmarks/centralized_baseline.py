"""Centralised reference: each method's adapter trained on ALL the training data in one
process (no federation, no partitioning), evaluated every few steps.

    python benchmarks/centralized_baseline.py                           # movie sentiment
    python benchmarks/centralized_baseline.py --task snli --steps 240 --methods florg,fedit
    python benchmarks/centralized_baseline.py --steps 300 --eval-every 15 \
        --max-train-examples 2400 --max-test-examples 1000 \
        --json results/evidence/centralised.json          # the evidence grid's reference

It answers the question a federated grid cannot: does this model, task, learning rate and
step budget learn at all?  A federated run whose clients together take S local steps per
round for R rounds cannot beat a centralised run of about R x (local steps) steps of the
same batch size, so when this script shows chance-level accuracy after that many steps,
a grid at that size measures noise, not methods.

Everything is the app's own code: ``resolve_config`` with the grid's settings,
``cached_adapted_model`` (so FLoRG's L, R and A and the LoRA baselines' seeded A are built
exactly as a client builds them), ``tokenized_split`` of the whole training split,
a client round's ``train_steps`` (``flower_app.client_round``: AdamW with the run's
settings, fresh per chunk as in a round) and ``evaluate`` on the validation
split the ServerApp uses.  Methods that differ only in aggregation (FedIT, FeDeRA without
``lora-init=federa-svd``, FedEx-LoRA, FedSA-LoRA) are the same model here.  One torch
thread, as a simulation actor uses.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="all-MiniLM-L6-v2")
    parser.add_argument("--task", default="movie-sentiment")
    parser.add_argument("--methods", default="florg,fedit,ffa-lora")
    parser.add_argument("--steps", type=int, default=120, help="total AdamW steps")
    parser.add_argument("--eval-every", type=int, default=30, help="steps between evaluations")
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    parser.add_argument("--head-learning-rate", type=float, default=0.0,
                        help="the task head's learning rate (0: --learning-rate)")  # fmt: skip
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-train-examples", type=int, default=1600)
    parser.add_argument("--max-eval-examples", type=int, default=200)
    parser.add_argument("--rank", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--max-test-examples",
        type=int,
        default=0,
        help="also score the held-out test split after the last step (0 = no test)",
    )
    parser.add_argument(
        "--json",
        type=Path,
        default=None,
        help="merge the test scores into this file ({'tasks': {TASK: {'test-score': best "
        "method's, 'methods': {...}}}}; the evidence report reads results/<grid>/"
        "centralised.json)",
    )
    parser.add_argument(
        "--projection-sharing",
        default="shape",
        choices=("shape", "module"),
        help="FLoRG's L, R: one pair per layer shape (default) or per module",
    )
    args = parser.parse_args(argv)
    if args.steps < 1 or args.eval_every < 1:
        parser.error("--steps and --eval-every must be >= 1")
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    if not args.methods:
        parser.error("--methods names no method")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sys.path.insert(0, str(REPO))
    sys.path.insert(0, str(REPO / "benchmarks"))
    import torch
    from lib.centralised import (
        centralised_data,
        centralised_settings,
        held_out_test_loader,
        train_centralised,
    )

    from flower_app.config import ConfigError, resolve_config
    from flower_app.runtime import cached_adapted_model

    torch.set_num_threads(args.threads)
    print(
        f"centralised: {args.model} on {args.task}, {args.max_train_examples} training / "
        f"{args.max_eval_examples} validation examples, batch {args.batch_size}, "
        f"lr {args.learning_rate:g}, r = {args.rank}, {args.steps} steps, seed {args.seed}, "
        f"projection-sharing {args.projection_sharing}",
        flush=True,
    )
    try:
        configs = {
            m: resolve_config({}, centralised_settings(args, m, args.learning_rate))
            for m in args.methods
        }
    except ConfigError as err:
        print(f"centralised: {err}", file=sys.stderr)
        return 2
    first = next(iter(configs.values()))
    try:
        data, train_split, held_out = centralised_data(first)
    except ValueError as err:
        print(f"centralised: {err}", file=sys.stderr)
        return 2
    tested = held_out_test_loader(first) if args.max_test_examples > 0 else None
    test_scores: dict[str, float] = {}
    table: dict[str, list[tuple[int, float, float]]] = {}
    for method, config in configs.items():
        curve = train_centralised(
            config, cached_adapted_model(config, data.num_labels).model, train_split,
            held_out, tested, steps=args.steps, eval_every=args.eval_every, label=method,
        )  # fmt: skip
        table[method] = curve.points
        if curve.test is not None:
            test_scores[method] = curve.test
    steps = [s for s, _, _ in next(iter(table.values()))]
    print("\n| method | " + " | ".join(f"step {s}" for s in steps) + " |")
    print("|---|" + "---|" * len(steps))
    for method, rows in table.items():
        print(f"| {method} | " + " | ".join(f"{acc:.3f}" for _, acc, _ in rows) + " |")
    if args.json is not None and test_scores:
        write_json(args, test_scores, {m: rows[-1][1] for m, rows in table.items()})
    return 0


def write_json(
    args: argparse.Namespace, test_scores: dict[str, float], validation: dict[str, float]
) -> None:
    """Merge this task's centralised test scores into ``args.json``."""
    import json

    try:
        document = json.loads(args.json.read_text())
    except (OSError, ValueError):
        document = {"tasks": {}}
    document.setdefault("tasks", {})[args.task] = {
        "test-score": max(test_scores.values()),
        "methods": {
            m: {"test-score": test_scores[m], "validation-score": validation[m]}
            for m in test_scores
        },
        "steps": args.steps,
        "learning-rate": args.learning_rate,
        "batch-size": args.batch_size,
        "max-train-examples": args.max_train_examples,
        "test-examples": args.max_test_examples,
        "command": "python benchmarks/centralized_baseline.py " + " ".join(sys.argv[1:]),
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(document, indent=2) + "\n")
    print(f"centralised: test scores written to {args.json}")


if __name__ == "__main__":
    raise SystemExit(main())
