"""The centralised reference with the evidence grids' protocol: learning rate tuned on
validation at one seed, then five seeds at the chosen rate, held-out test scores with a
95% t interval.

    python -m benchmarks.centralised.centralised_reference --task snli --steps 600 \
        --eval-every 60 --json lab/evidence/evidence/centralised-reference.json
    python -m benchmarks.centralised.centralised_reference --task movie-sentiment \
        --steps 300 --eval-every 30 --json lab/evidence/evidence/centralised-reference.json

One seed and one learning rate make it a single centralised run per method, which tells
whether a model, task, learning rate and step budget learn at all (a federated run of R
rounds of S local steps cannot beat a centralised run of about R x S steps of the same
batch size; chance-level accuracy there means a grid at that size measures noise):

    python -m benchmarks.centralised.centralised_reference --methods florg,fedit \
        --seeds 0 --learning-rates 1e-3 --steps 120 --eval-every 30

Any task kind the app serves: ``--set KEY=VALUE`` passes any other run setting (as
``florg launch --set``), and the scores are the ServerApp's (``score``: accuracy for
classification, F1 / 100 for extractive QA, gen-F1 / 100 for causal LM with short answers;
``benchmarks.centralised.training.HeldOut``). The reference is a test score, so the task
needs a test split (causal LM: ``snli-gen`` or a labelled local task, not ``squad-gen``):

    python -m benchmarks.centralised.centralised_reference --model SmolLM2-135M \
        --task snli-gen --methods fedit,florg --batch-size 2 --set max-seq-length=256 \
        --set max-new-tokens=4 --set eval-batch-size=8 ...

Without ``--json`` nothing is written. A single run is not a reference, though: one test
score on 1,000 examples carries a standard error of about 0.015, and its learning rate is
fixed rather than chosen. With several seeds every method gets what a grid method gets
(``lab/grids/evidence*.yaml``): each candidate learning rate runs at the first seed, the
one with the best validation score averaged over the last three evaluations wins (ties go
to the smaller rate, as in ``florg_lab.tuning``), and the chosen rate runs
every seed. A seed sets the head's and the adapter's initialisation, the training subset
and the batch order. Test scores are never used for a choice.

Everything is the app's own code (``benchmarks.centralised.training``): ``resolve_config``
with the grid's settings, ``cached_adapted_model`` (FLoRG's L, R and A and the LoRA
baselines' seeded A built exactly as a client builds them), ``tokenized_split`` of the
whole training split, a client round's ``train_steps`` (AdamW with the run's settings,
restarted every ``--restart-every`` steps as in a round) and ``evaluate`` on the
validation split the ServerApp uses. Methods that differ only in aggregation (FedIT,
FeDeRA without ``lora-init=federa-svd``, FedEx-LoRA, FedSA-LoRA) are the same model here.

The JSON (merged per task, the schema the evidence report reads from a grid's
``centralised.json``) records every run as it finishes, so an interrupted call resumes
where it stopped when repeated with the same settings. ``test-score`` is the mean test
score of the ``--reference`` method (LoRA, i.e. FedIT's adapter, by default; the first of
``--methods`` when FedIT is not among them).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from florg_tools.run_config import add_set_argument, parse_sets

SELECT_LAST = 3  # evaluations averaged for the choice, as the grids' tuning stage
SETTINGS = (
    "model", "steps", "eval_every", "restart_every", "batch_size", "max_train_examples",
    "max_eval_examples", "max_test_examples", "rank", "projection_sharing",
)  # fmt: skip


def _floats(text: str) -> list[float]:
    return [float(v) for v in text.split(",") if v.strip()]


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="all-MiniLM-L6-v2")
    parser.add_argument("--task", default="movie-sentiment")
    parser.add_argument("--methods", default="fedit,florg", help="comma-separated")
    parser.add_argument("--reference", default=None, help="the method whose mean is the "
                        "task's reference (default: LoRA, FedIT's adapter, when among "
                        "--methods, else the first method)")  # fmt: skip
    parser.add_argument("--learning-rates", type=_floats, default=[5e-4, 1e-3, 2e-3])
    parser.add_argument("--head-learning-rate", type=float, default=0.0,
                        help="the task head's learning rate, the same for every method and "
                        "candidate (default 0: each run's adapter rate)")  # fmt: skip
    parser.add_argument("--seeds", type=_ints, default=[0, 1, 2, 3, 4],
                        help="the first one also tunes")  # fmt: skip
    parser.add_argument("--steps", type=int, default=300, help="AdamW steps per run")
    parser.add_argument("--eval-every", type=int, default=30, help="steps between evaluations")
    parser.add_argument("--restart-every", type=int, default=15,
                        help="AdamW restarts every this many steps (default 15: the grids' "
                        "local steps per round)")  # fmt: skip
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-train-examples", type=int, default=2400)
    parser.add_argument("--max-eval-examples", type=int, default=500)
    parser.add_argument("--max-test-examples", type=int, default=1000)
    parser.add_argument("--rank", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--projection-sharing", default="shape", choices=("shape", "module"))
    add_set_argument(
        parser,
        "any other run setting, as `florg launch --set` takes it (e.g. max-seq-length=256 "
        "for causal LM); repeatable",
    )
    parser.add_argument("--json", type=Path, default=None,
                        help="merge this task's reference into this file (and resume from "
                        "it); without it nothing is written")  # fmt: skip
    args = parser.parse_args(argv)
    try:
        args.extra = parse_sets(args.sets)
    except ValueError as err:
        parser.error(str(err))
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    if not args.methods:
        parser.error("--methods names no method")
    if args.reference is None:
        args.reference = "fedit" if "fedit" in args.methods else args.methods[0]
    if args.reference not in args.methods:
        parser.error(f"--reference {args.reference} is not among --methods {args.methods}")
    if not args.learning_rates or not args.seeds:
        parser.error("--learning-rates and --seeds need at least one value each")
    if len(set(args.seeds)) != len(args.seeds):
        parser.error(f"--seeds repeats a seed: {args.seeds}")
    if min(args.steps, args.eval_every, args.restart_every) < 1:
        parser.error("--steps, --eval-every and --restart-every must be >= 1")
    if len(args.learning_rates) > 1 and args.steps < SELECT_LAST * args.eval_every:
        parser.error(f"--steps must allow {SELECT_LAST} evaluations to choose a learning "
                     f"rate: at least {SELECT_LAST} x --eval-every")  # fmt: skip
    if args.head_learning_rate < 0:
        parser.error("--head-learning-rate must be >= 0 (0: the adapter's rate)")
    if args.max_test_examples < 1:
        parser.error("--max-test-examples must be >= 1: the reference is a test score")
    return args


def selection_score(points: list[list[float]]) -> float:
    """Mean validation score (accuracy for classification) of the last ``SELECT_LAST``
    evaluations (step > 0)."""
    tail = [acc for step, acc, _ in points if step > 0][-SELECT_LAST:]
    return sum(tail) / len(tail)


def choose_rate(scores: dict[float, float]) -> float:
    """The rate with the best selection score; ties go to the smaller rate."""
    return max(sorted(scores), key=lambda lr: (scores[lr], -lr))


def run_key(method: str, lr: float, seed: int) -> str:
    return f"method={method},lr={lr:g},seed={seed}"


def load_task_entry(path: Path | None, task: str, settings: dict[str, Any]) -> dict[str, Any]:
    """This task's entry of ``path`` when it was written with the same settings (its runs
    are reused), else (or without a path) a fresh one."""
    if path is None:
        return {"settings": settings, "runs": {}}
    try:
        entry = json.loads(path.read_text()).get("tasks", {}).get(task, {})
    except (OSError, ValueError):
        entry = {}
    if entry.get("settings") != settings:
        return {"settings": settings, "runs": {}}
    entry.setdefault("runs", {})
    return entry


def save_task_entry(path: Path | None, task: str, entry: dict[str, Any]) -> None:
    """Merge this task's entry into ``path`` (nothing without a path)."""
    if path is None:
        return
    try:
        document = json.loads(path.read_text())
    except (OSError, ValueError):
        document = {}
    document.setdefault("tasks", {})[task] = entry
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(document, indent=2) + "\n")
    tmp.replace(path)


def _bounds(interval: Any) -> list[float | None]:
    """The interval's ends; None (JSON null) with a single seed."""
    if math.isnan(interval.low):
        return [None, None]
    return [interval.low, interval.high]


def summarise(entry: dict[str, Any], args: argparse.Namespace) -> None:
    """Fill the per-method choice and test interval, and the task's reference."""
    from florg_lab.stats import mean_interval, paired_difference

    runs = entry["runs"]
    methods = {}
    for method in args.methods:
        tuning = {
            f"{lr:g}": runs[run_key(method, lr, args.seeds[0])]["selection-score"]
            for lr in args.learning_rates
        }
        chosen = choose_rate({float(k): v for k, v in tuning.items()})
        tests = [runs[run_key(method, chosen, s)]["test"] for s in args.seeds]
        interval = mean_interval(tests)
        methods[method] = {
            "tuning": tuning, "learning-rate": chosen, "seeds": list(args.seeds),
            "test": tests, "test-score": interval.mean,
            "test-interval": _bounds(interval),
        }  # fmt: skip
    reference = methods[args.reference]
    for method, info in methods.items():
        if method != args.reference and len(args.seeds) > 1:
            # the same seed gives both methods the same data, head init and batches
            paired = paired_difference(info["test"], reference["test"])
            info[f"minus-{args.reference}"] = {
                "mean": paired.difference.mean, "interval": _bounds(paired.difference),
                "wins": paired.wins, "seeds": len(args.seeds),
            }  # fmt: skip
    entry.update({
        "reference-method": args.reference,
        "test-score": reference["test-score"],
        "test-interval": reference["test-interval"],
        "seeds": list(args.seeds),
        "methods": methods,
        "steps": args.steps, "learning-rates": list(args.learning_rates),
        "batch-size": args.batch_size, "max-train-examples": args.max_train_examples,
        "test-examples": args.max_test_examples,
        "select": f"validation score, mean of the last {SELECT_LAST} evaluations, seed "
                  f"{args.seeds[0]}",
        "command": "python -m benchmarks.centralised.centralised_reference "
        + " ".join(sys.argv[1:]),
    })  # fmt: skip


def print_curves(entry: dict[str, Any], args: argparse.Namespace) -> None:
    """The validation score by step of every run at the first seed (method x rate)."""
    seed = args.seeds[0]
    rows = {(m, lr): entry["runs"][run_key(m, lr, seed)]["validation"]
            for m in args.methods for lr in args.learning_rates}  # fmt: skip
    steps = [step for step, _, _ in next(iter(rows.values()))]
    print(f"\nvalidation score by step, seed {seed}:")
    print("| method | lr | " + " | ".join(f"step {s}" for s in steps) + " |")
    print("|---|---|" + "---|" * len(steps))
    for (method, lr), points in rows.items():
        print(f"| {method} | {lr:g} | " + " | ".join(f"{acc:.3f}" for _, acc, _ in points) + " |")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    from benchmarks.centralised.training import (
        HeldOut,
        centralised_data,
        centralised_settings,
        train_centralised,
    )
    from flower_app.cache.per_process import cached_adapted_model
    from flower_app.settings.config import ConfigError, resolve_config

    torch.set_num_threads(args.threads)
    settings = {name.replace("_", "-"): getattr(args, name) for name in SETTINGS}
    if args.head_learning_rate:  # keyed only when set, so earlier files stay valid
        settings["head-learning-rate"] = args.head_learning_rate
    if args.extra:  # likewise
        settings["set"] = dict(sorted(args.extra.items()))
    entry = load_task_entry(args.json, args.task, settings)
    runs = entry["runs"]
    print(
        f"centralised reference: {args.model} on {args.task}, methods {args.methods}, "
        f"lr {args.learning_rates} tuned at seed {args.seeds[0]}, seeds {args.seeds}, "
        f"{args.steps} steps of batch {args.batch_size} (AdamW restarted every "
        f"{args.restart_every}); "
        + (f"{len(runs)} runs already in {args.json}" if args.json else "writing no file"),
        flush=True,
    )
    loaded: dict[int, tuple[Any, Any, Any, Any]] = {}  # seed -> data, train, val, test

    def run(method: str, lr: float, seed: int) -> dict[str, Any]:
        key = run_key(method, lr, seed)
        if key in runs:
            return runs[key]
        seeded = argparse.Namespace(**{**vars(args), "seed": seed})
        config = resolve_config({}, centralised_settings(seeded, method, lr))
        if seed not in loaded:
            data, train_split, held_out = centralised_data(config)
            loaded.clear()  # one seed's data at a time
            tested = HeldOut(config, "test", data.spec.kind)  # the task data is loaded
            loaded[seed] = (data, train_split, held_out, tested)
        data, train_split, held_out, tested = loaded[seed]
        model = cached_adapted_model(config, data.num_labels, data.spec.kind).model
        curve = train_centralised(
            config, model, train_split, held_out, tested, steps=args.steps,
            eval_every=args.eval_every, label=key, restart_every=args.restart_every,
        )  # fmt: skip
        points = [list(p) for p in curve.points]
        runs[key] = {"selection-score": selection_score(points), "test": curve.test,
                     "validation": points}  # fmt: skip
        save_task_entry(args.json, args.task, entry)  # nothing finished is lost
        return runs[key]

    try:
        for method in args.methods:
            scores = {lr: run(method, lr, args.seeds[0])["selection-score"]
                      for lr in args.learning_rates}  # fmt: skip
            chosen = choose_rate(scores)
            print(f"[{method}] validation (last {SELECT_LAST} evaluations) "
                  + ", ".join(f"lr {lr:g}: {s:.4f}" for lr, s in scores.items())
                  + f" -> lr {chosen:g}", flush=True)  # fmt: skip
            for seed in args.seeds[1:]:
                run(method, chosen, seed)
    except (ConfigError, ValueError) as err:
        print(f"centralised reference: {err}", file=sys.stderr)
        return 2
    summarise(entry, args)
    save_task_entry(args.json, args.task, entry)
    print_curves(entry, args)
    print(f"\n| method | lr (chosen) | test per seed {args.seeds} | mean [95% CI] |")
    print("|---|---|---|---|")
    for method, info in entry["methods"].items():
        low, high = info["test-interval"]
        bounds = "" if low is None else f" [{low:.4f}, {high:.4f}]"
        print(f"| {method} | {info['learning-rate']:g} | "
              + " ".join(f"{t:.3f}" for t in info["test"])
              + f" | {info['test-score']:.4f}{bounds} |")  # fmt: skip
    for method, info in entry["methods"].items():
        paired = info.get(f"minus-{args.reference}")
        if paired is not None:
            low, high = paired["interval"]
            print(f"{method} − {args.reference}, paired over seeds: {paired['mean']:+.4f} "
                  f"[{low:+.4f}, {high:+.4f}], ahead on {paired['wins']} of "
                  f"{paired['seeds']}")  # fmt: skip
    written = f"; written to {args.json}" if args.json else ""
    print(f"centralised reference ({args.reference}): {entry['test-score']:.4f}{written}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
