"""Evidence protocol v2: choose the task head's learning rate once, centrally, for every method.

    python -m benchmarks.centralised.head_learning_rate --task movie-sentiment \
        --steps 300 --eval-every 30 \
        --json lab/evidence/evidence-v2/head-learning-rate-movie-sentiment.json
    python -m benchmarks.centralised.head_learning_rate --task snli --steps 600 \
        --eval-every 60 --json lab/evidence/evidence-v2/head-learning-rate-snli.json

In protocol v1 one learning rate drove both the adapter and the head, so a method whose
adapter needs a small rate (FLoRG) also trained its head slowly. Protocol v2 fixes the
head's rate, the same for every method, chosen here: LoRA (FedIT's adapter) trained
centrally on the grid's training pool at the grid's budget (sequential steps, AdamW
restarted every ``--restart-every`` steps as in a round), its adapter at
``--adapter-learning-rate``, its head at each candidate rate. The candidate with the best
validation accuracy (mean of the last three evaluations; ties go to the smaller rate)
wins; a winner at an end of the rates tried adds the next rate past that end (x or ÷
``--extend``) until the winner is interior or ``--max-extensions`` rates were added. Test
scores are never looked at.

The JSON (one entry per task) records every run as it finishes, so an interrupted call
resumes; ``path`` lists the rates in the order tried, ``chosen`` the winner.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

SETTINGS = (
    "model", "method", "adapter_learning_rate", "steps", "eval_every", "restart_every",
    "batch_size", "max_train_examples", "max_eval_examples", "rank", "seed",
    "projection_sharing",
)  # fmt: skip


def _floats(text: str) -> list[float]:
    return [float(v) for v in text.split(",") if v.strip()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="all-MiniLM-L6-v2")
    parser.add_argument("--task", default="movie-sentiment")
    parser.add_argument("--method", default="fedit", help="whose adapter trains (LoRA)")
    parser.add_argument("--adapter-learning-rate", type=float, default=1e-3)
    parser.add_argument("--head-learning-rates", type=_floats, default=[5e-4, 1e-3, 2e-3],
                        help="the first candidates (the v1 grid's rates)")  # fmt: skip
    parser.add_argument("--extend", type=float, default=2.0)
    parser.add_argument("--max-extensions", type=int, default=4)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--eval-every", type=int, default=30)
    parser.add_argument("--restart-every", type=int, default=15)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-train-examples", type=int, default=2400)
    parser.add_argument("--max-eval-examples", type=int, default=500)
    parser.add_argument("--rank", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--projection-sharing", default="shape", choices=("shape", "module"))
    parser.add_argument("--json", type=Path, required=True, help="merge the choice into this file")
    args = parser.parse_args(argv)
    rates = args.head_learning_rates
    if len(rates) < 2 or min(rates) <= 0 or len(set(rates)) != len(rates):
        parser.error("--head-learning-rates: at least two distinct positive rates")
    if args.extend <= 1 or args.max_extensions < 0:
        parser.error("--extend must be > 1 and --max-extensions >= 0")
    if min(args.steps, args.eval_every, args.restart_every) < 1 or args.adapter_learning_rate <= 0:
        parser.error("--steps, --eval-every, --restart-every and the rates must be positive")
    if args.steps < 3 * args.eval_every:
        parser.error("--steps must allow 3 evaluations: at least 3 x --eval-every")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    from benchmarks.centralised.centralised_reference import (
        load_task_entry,
        save_task_entry,
        selection_score,
    )
    from benchmarks.centralised.training import (
        centralised_data,
        centralised_settings,
        train_centralised,
    )
    from florg_lab.tuning import best_value, next_candidate
    from flower_app.cache.per_process import cached_adapted_model
    from flower_app.settings.config import ConfigError, resolve_config

    torch.set_num_threads(args.threads)
    settings = {name.replace("_", "-"): getattr(args, name) for name in SETTINGS}
    entry = load_task_entry(args.json, args.task, settings)
    runs: dict[str, Any] = entry["runs"]
    print(
        f"head learning rate: {args.method} on {args.task} centrally, adapter lr "
        f"{args.adapter_learning_rate:g}, head lr from {args.head_learning_rates} "
        f"(x/÷ {args.extend:g} past an edge, at most {args.max_extensions} times), "
        f"{args.steps} steps; {len(runs)} runs already in {args.json}",
        flush=True,
    )
    data_cache: list[Any] = []

    def score(head_lr: float) -> float:
        key = f"head-lr={head_lr:g}"
        if key not in runs:
            run_args = argparse.Namespace(**{**vars(args), "head_learning_rate": head_lr})
            config = resolve_config(
                {}, centralised_settings(run_args, args.method, args.adapter_learning_rate)
            )
            if not data_cache:
                data_cache.extend(centralised_data(config, kinds=("classification",)))
            data, train_split, held_out = data_cache
            curve = train_centralised(
                config, cached_adapted_model(config, data.num_labels).model, train_split,
                held_out, None, steps=args.steps, eval_every=args.eval_every, label=key,
                restart_every=args.restart_every,
            )  # fmt: skip
            points = [list(p) for p in curve.points]
            runs[key] = {"head-learning-rate": head_lr, "validation": points,
                         "selection-score": selection_score(points)}  # fmt: skip
            save_task_entry(args.json, args.task, entry)  # nothing finished is lost
        return float(runs[key]["selection-score"])

    try:
        path = list(args.head_learning_rates)
        scores = {lr: score(lr) for lr in path}
        while True:
            left = args.max_extensions - (len(path) - len(args.head_learning_rates))
            nxt = next_candidate(scores, args.extend, left)
            if nxt is None:
                break
            path.append(nxt)
            scores[nxt] = score(nxt)
    except (ConfigError, ValueError) as err:
        print(f"head learning rate: {err}", file=sys.stderr)
        return 2
    chosen = best_value(scores)
    entry.update({
        "path": path,
        "scores": {f"{lr:g}": scores[lr] for lr in path},
        "chosen": chosen,
        "at-edge": chosen in (min(path), max(path)),
        "select": f"validation accuracy, mean of the last 3 evaluations, seed {args.seed}",
        "command": "python -m benchmarks.centralised.head_learning_rate " + " ".join(sys.argv[1:]),
    })  # fmt: skip
    save_task_entry(args.json, args.task, entry)
    print("| head lr | validation (last 3 evaluations) |\n|---|---|")
    for lr in sorted(path):
        print(f"| {lr:g}{' (chosen)' if lr == chosen else ''} | {scores[lr]:.4f} |")
    print(f"head learning rate for {args.task}: {chosen:g} (path {path}); written to {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
