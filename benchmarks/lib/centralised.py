"""What the centralised benchmarks share (centralized_baseline.py, adapter_growth.py): one
process trains a method's adapter on the whole training split, with the app's own config,
data and tokenisation."""

from __future__ import annotations

import argparse
from typing import Any


def centralised_settings(args: argparse.Namespace, method: str, lr: float) -> dict[str, Any]:
    """The run settings of one centralised run: no partitioning, no weight decay, CPU."""
    return {
        "method": method, "model": args.model, "task": args.task, "partitioner": "iid",
        "seed": args.seed, "rank": args.rank,
        "max-train-examples": args.max_train_examples,
        "max-eval-examples": args.max_eval_examples, "batch-size": args.batch_size,
        "learning-rate": lr, "weight-decay": 0.0, "device": "cpu", "progress-bar": False,
        "max-test-examples": getattr(args, "max_test_examples", 0),
        "projection-sharing": getattr(args, "projection_sharing", "shape"),
    }  # fmt: skip


def centralised_data(config: Any) -> tuple[Any, Any, Any]:
    """(task data, the whole tokenised training split, the validation loader); built once,
    since neither depends on the method. Raises ValueError for extractive QA."""
    from flower_app.task_data import load_task_data, make_loader, tokenized_split

    data = load_task_data(config)
    if data.is_qa:
        raise ValueError("extractive QA is not supported here")
    train_split = tokenized_split(config, "train", 0, 1)
    held_out = make_loader(
        tokenized_split(config, "eval"), config.eval_batch_size, shuffle=False, seed=0
    )
    return data, train_split, held_out
