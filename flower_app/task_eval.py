"""Evaluate the model on the run's validation split (or a client's share): task metrics.

Classification: ``accuracy`` and ``loss``. Extractive QA: ``exact-match`` and ``f1``
(percent, SQuAD v1.1 over all gold answers) and ``loss`` (mean start/end cross-entropy
over the features). Every task also reports ``score``, its headline metric as a fraction
in [0, 1] (accuracy, or F1 / 100), and ``num-examples`` (examples, not QA features).
"""

from __future__ import annotations

import torch
from torch import nn

from flower_app.config import ConfigError, RunConfig
from flower_app.qa_eval import evaluate_qa
from flower_app.task_data import load_task_data, make_loader, qa_eval_set, tokenized_split
from flower_app.training import evaluate


def evaluate_task(
    config: RunConfig,
    model: nn.Module,
    device: torch.device,
    partition_id: int = 0,
    num_partitions: int = 1,
    split: str = "eval",
) -> dict[str, float]:
    """The task's metrics of ``model`` on (a partition of) the validation split, or on
    the held-out test split with ``split="test"``."""
    if load_task_data(config).is_qa:
        if split != "eval":
            raise ConfigError(f"extractive-QA tasks are evaluated on 'eval' only, not {split!r}")
        eval_set = qa_eval_set(config, partition_id, num_partitions)
        loader = make_loader(eval_set.features, config.eval_batch_size, shuffle=False, seed=0)
        qa = evaluate_qa(model, eval_set, loader, device)
        return {
            "exact-match": qa.exact_match,
            "f1": qa.f1,
            "loss": qa.loss,
            "score": qa.f1 / 100.0,
            "num-examples": qa.num_examples,
        }
    dataset = tokenized_split(config, split, partition_id, num_partitions)
    result = evaluate(
        model, make_loader(dataset, config.eval_batch_size, shuffle=False, seed=0), device
    )
    return {
        "accuracy": result.accuracy,
        "loss": result.loss,
        "score": result.accuracy,
        "num-examples": result.num_examples,
    }
