"""What the centralised benchmarks share (``centralised_reference``, ``head_learning_rate``,
``adapter_growth``): one process trains a method's adapter on the whole training split,
with the app's own config, data and tokenisation, and trains as a client's round does
(``flower_app.client_round.train_steps``)."""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


def centralised_settings(args: argparse.Namespace, method: str, lr: float) -> dict[str, Any]:
    """The run settings of one centralised run: no partitioning, no weight decay, CPU; the
    head's learning rate is ``args.head_learning_rate`` where given (0 = ``lr``)."""
    return {
        "method": method, "model": args.model, "task": args.task, "partitioner": "iid",
        "seed": args.seed, "rank": args.rank,
        "max-train-examples": args.max_train_examples,
        "max-eval-examples": args.max_eval_examples, "batch-size": args.batch_size,
        "learning-rate": lr, "head-learning-rate": getattr(args, "head_learning_rate", 0.0),
        "weight-decay": 0.0, "device": "cpu", "progress-bar": False,
        "max-test-examples": getattr(args, "max_test_examples", 0),
        "projection-sharing": getattr(args, "projection_sharing", "shape"),
    }  # fmt: skip


def centralised_data(config: Any) -> tuple[Any, Any, Any]:
    """(task data, the whole tokenised training split, the validation loader); built once,
    since neither depends on the method. Raises ValueError for any task kind but
    classification (the references score accuracy over ``labels``)."""
    from flower_app.task_data import load_task_data, make_loader, tokenized_split

    data = load_task_data(config)
    if data.spec.kind != "classification":
        raise ValueError(f"task kind {data.spec.kind!r}: only classification is supported here")
    train_split = tokenized_split(config, "train", 0, 1)
    held_out = make_loader(
        tokenized_split(config, "eval"), config.eval_batch_size, shuffle=False, seed=0
    )
    return data, train_split, held_out


@dataclass
class CentralisedCurve:
    """One centralised run: (step, validation accuracy, validation loss) at step 0 and
    after every chunk, and the held-out test accuracy after the last step (None when no
    test loader was given)."""

    points: list[tuple[int, float, float]]
    test: float | None


def chunk_schedule(steps: int, eval_every: int, restart_every: int) -> list[tuple[int, bool]]:
    """(AdamW steps of one fresh optimiser, evaluate after it?) for a run of ``steps``:
    chunks of at most ``restart_every`` steps that never cross an evaluation point (every
    ``eval_every`` steps, and the last step)."""
    schedule, done = [], 0
    while done < steps:
        chunk = min(restart_every, eval_every - done % eval_every, steps - done)
        done += chunk
        schedule.append((chunk, done % eval_every == 0 or done == steps))
    return schedule


def train_centralised(
    config: Any,
    model: Any,
    train_split: Any,
    held_out: Any,
    tested: Any | None,
    *,
    steps: int,
    eval_every: int,
    label: str,
    seed: int | None = None,
    restart_every: int | None = None,
    after_chunk: Callable[[int, Any, Any], None] | None = None,
) -> CentralisedCurve:
    """Train ``model`` for ``steps`` AdamW steps with the run's settings ``config``
    (``flower_app.client_round.train_steps``, what a client's round trains with: batches
    of ``batch-size``, the adapter at ``learning-rate``, the head at its own rate,
    ``weight-decay``) in chunks of ``restart_every`` steps (a fresh optimiser per chunk,
    as in a round; default ``eval_every``), scoring the validation loader every
    ``eval_every`` steps and after the last; ``after_chunk(step, train result, validation
    result)`` is called after each scoring. The batches are shuffled with ``seed``
    (default: the run's), so every method at one seed sees the same."""
    from flower_app.client_round import train_steps
    from flower_app.modeling import pick_device
    from flower_app.task_data import make_loader
    from flower_app.training import evaluate

    device = pick_device(config.device)
    train = make_loader(
        train_split, config.batch_size, shuffle=True, seed=config.seed if seed is None else seed
    )
    start = time.perf_counter()
    initial = evaluate(model, held_out, device)
    points = [(0, initial.accuracy, initial.loss)]
    done = 0
    for chunk, scored in chunk_schedule(steps, eval_every, restart_every or eval_every):
        trained = train_steps(config, model, train, max_steps=chunk)
        done += chunk
        if not scored:
            continue
        result = evaluate(model, held_out, device)
        points.append((done, result.accuracy, result.loss))
        print(
            f"[{label}] step {done:>4} | acc {result.accuracy:.4f} loss {result.loss:.4f}"
            f" | {time.perf_counter() - start:.0f}s",
            flush=True,
        )
        if after_chunk is not None:
            after_chunk(done, trained, result)
    test = None if tested is None else evaluate(model, tested, device).accuracy
    if test is not None:
        print(f"[{label}] test accuracy {test:.4f}", flush=True)
    return CentralisedCurve(points, test)


def held_out_test_loader(config: Any) -> Any:
    """The held-out test split (``max-test-examples`` rows, the same for every seed)."""
    from flower_app.task_data import make_loader, tokenized_split

    return make_loader(tokenized_split(config, "test"), config.eval_batch_size, False, seed=0)
