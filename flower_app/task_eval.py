"""Evaluate the model on the run's validation split (or a client's share): task metrics.

The task's kind (flower_app/task_kinds/) evaluates: classification reports ``accuracy``
and ``loss``; extractive QA ``exact-match`` and ``f1`` (percent, SQuAD v1.1 over all gold
answers) and ``loss`` (mean start/end cross-entropy over the features). Every kind also
reports ``score``, its headline metric as a fraction in [0, 1] (accuracy, or F1 / 100),
and ``num-examples`` (examples, not QA features).
"""

from __future__ import annotations

import torch
from torch import nn

from flower_app.settings.config import RunConfig
from flower_app.task_data import SplitView, load_task_data
from flower_app.training.precision import MixedPrecision


def evaluate_task(
    config: RunConfig,
    model: nn.Module,
    device: torch.device,
    partition_id: int = 0,
    num_partitions: int = 1,
    split: str = "eval",
) -> dict[str, float]:
    """The task's metrics of ``model`` on (a partition of) the validation split, or on
    the held-out test split with ``split="test"``; the forward under the run's
    ``precision`` (a bf16/fp16 base with float32 adapter and head needs its autocast)."""
    view = SplitView(config, split, partition_id, num_partitions)
    with MixedPrecision.for_run(config.precision, device).autocast():
        return load_task_data(config).kind.evaluate(model, view, device)
