"""What the centralised benchmarks share (``centralised_reference``, ``head_learning_rate``,
``adapter_growth``): one process trains a method's adapter on the whole training split,
with the app's own config, data and tokenisation, trains as a client's round does
(``flower_app.client.round.train_steps``) and scores a held-out split as the ServerApp
does: ``score`` is the task kind's headline fraction (accuracy for classification, F1 / 100
for extractive QA, gen-F1 / 100 for causal LM with short answers) and ``loss`` its loss."""

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
        **getattr(args, "extra", {}),
    }  # fmt: skip


@dataclass(frozen=True)
class HeldOutScore:
    """A held-out split's headline ``score`` (a fraction) and ``loss``."""

    score: float
    loss: float


class HeldOut:
    """A held-out split (``"eval"``: the validation split the ServerApp scores every round;
    ``"test"``: the held-out test split), scored by ``held_out(model, device)``.

    Classification batches the tokenised split once and scores accuracy and cross-entropy
    with ``flower_app.training.loop.evaluate`` (the numbers every published reference has);
    every other kind scores through the ServerApp's own ``evaluate_task``.
    """

    def __init__(self, config: Any, split: str, kind: str) -> None:
        from flower_app.task_data import make_loader, tokenized_split

        self.config, self.split, self.kind = config, split, kind
        self.loader = None
        if kind == "classification":
            self.loader = make_loader(
                tokenized_split(config, split), config.eval_batch_size, shuffle=False, seed=0
            )

    def __call__(self, model: Any, device: Any) -> HeldOutScore:
        if self.loader is not None:
            from flower_app.training.loop import evaluate

            result = evaluate(model, self.loader, device)
            return HeldOutScore(result.accuracy, result.loss)
        from flower_app.task_eval import evaluate_task

        metrics = evaluate_task(self.config, model, device, split=self.split)
        return HeldOutScore(float(metrics["score"]), float(metrics["loss"]))


def centralised_data(config: Any, kinds: tuple[str, ...] | None = None) -> tuple[Any, Any, HeldOut]:
    """(task data, the whole tokenised training split, the validation split's scorer);
    built once, since neither depends on the method. ``kinds``: the task kinds the caller
    serves (ValueError for another; None: every kind)."""
    from flower_app.task_data import load_task_data, tokenized_split

    data = load_task_data(config)
    if kinds is not None and data.spec.kind not in kinds:
        raise ValueError(f"task kind {data.spec.kind!r}: only {', '.join(kinds)} here")
    train_split = tokenized_split(config, "train", 0, 1)
    return data, train_split, HeldOut(config, "eval", data.spec.kind)


@dataclass
class CentralisedCurve:
    """One centralised run: (step, validation score, validation loss) at step 0 and
    after every chunk, and the held-out test score after the last step (None when no
    test split was given)."""

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
    held_out: HeldOut,
    tested: HeldOut | None,
    *,
    steps: int,
    eval_every: int,
    label: str,
    seed: int | None = None,
    restart_every: int | None = None,
    after_chunk: Callable[[int, Any, Any], None] | None = None,
) -> CentralisedCurve:
    """Train ``model`` for ``steps`` AdamW steps with the run's settings ``config``
    (``flower_app.client.round.train_steps``, what a client's round trains with: batches
    of ``batch-size``, the adapter at ``learning-rate``, the head at its own rate,
    ``weight-decay``) in chunks of ``restart_every`` steps (a fresh optimiser per chunk,
    as in a round; default ``eval_every``), scoring the validation split every
    ``eval_every`` steps and after the last; ``after_chunk(step, train result, validation
    score)`` is called after each scoring. The batches are shuffled with ``seed``
    (default: the run's), so every method at one seed sees the same."""
    from flower_app.client.round import train_steps
    from flower_app.modeling import pick_device
    from flower_app.task_data import make_loader

    device = pick_device(config.device)
    train = make_loader(
        train_split, config.batch_size, shuffle=True, seed=config.seed if seed is None else seed
    )
    start = time.perf_counter()
    initial = held_out(model, device)
    points = [(0, initial.score, initial.loss)]
    done = 0
    for chunk, scored in chunk_schedule(steps, eval_every, restart_every or eval_every):
        trained = train_steps(config, model, train, max_steps=chunk)
        done += chunk
        if not scored:
            continue
        result = held_out(model, device)
        points.append((done, result.score, result.loss))
        print(
            f"[{label}] step {done:>4} | score {result.score:.4f} loss {result.loss:.4f}"
            f" | {time.perf_counter() - start:.0f}s",
            flush=True,
        )
        if after_chunk is not None:
            after_chunk(done, trained, result)
    test = None if tested is None else tested(model, device).score
    if test is not None:
        print(f"[{label}] test score {test:.4f}", flush=True)
    return CentralisedCurve(points, test)
