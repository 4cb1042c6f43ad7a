"""The per-round learning-rate schedule (``lr-schedule``, ``min-learning-rate``).

``constant``: every round trains at ``learning-rate`` (the paper's protocol, the default).
``cosine``: FlowerTune's ``cosine_annealing`` over Flower's 1-based ``server-round`` t of
T = ``num-server-rounds``, as the flowertune-llm example's client applies it:

    lr_t = lr_min + (lr - lr_min) * (1 + cos(pi * t / T)) / 2

so round 1 trains just below ``learning-rate`` and the last round at ``min-learning-rate``.
The head's rate (``head-learning-rate``, when set) is scaled by the same factor lr_t / lr."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from flower_app.settings.config import RunConfig

SCHEDULES = ("constant", "cosine")


def cosine_annealing(server_round: int, total_rounds: int, lr_max: float, lr_min: float) -> float:
    """FlowerTune's cosine annealing: the rate of 1-based round ``server_round`` of
    ``total_rounds``, from just below ``lr_max`` (round 1) to ``lr_min`` (the last)."""
    if total_rounds < 1:
        raise ValueError(f"total_rounds must be >= 1, got {total_rounds}")
    # Rounds outside 1..T (the initial evaluation's 0, a resumed run past T) clamp.
    t = min(max(server_round, 0), total_rounds)
    return lr_min + 0.5 * (lr_max - lr_min) * (1.0 + math.cos(math.pi * t / total_rounds))


def round_learning_rate(config: RunConfig, server_round: int) -> float:
    """The adapter's learning rate in round ``server_round`` under ``config``'s schedule."""
    if config.lr_schedule == "constant":
        return config.learning_rate
    if config.lr_schedule == "cosine":
        return cosine_annealing(
            server_round, config.num_server_rounds, config.learning_rate, config.min_learning_rate
        )
    raise ValueError(f"lr-schedule: unknown schedule {config.lr_schedule!r}; one of {SCHEDULES}")


def round_lr_factor(config: RunConfig, server_round: int) -> float:
    """``round_learning_rate / learning-rate``: the factor both the adapter's and the
    head's rates are multiplied by in ``server_round`` (1.0 under ``constant``)."""
    return round_learning_rate(config, server_round) / config.learning_rate
