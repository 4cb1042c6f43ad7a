"""The server update of buffered asynchronous rounds (``round-mode=async``; the loop:
strategies/server/buffered_rounds.py), FedBuff's (Nguyen et al., AISTATS 2022) with each
method's own rule. A reply that trained from version v and is applied at update t + 1 has
staleness τ = t − v and enters as what it changed since v, scaled by cₙ = (1 + τ)^-a
(``async-staleness-exponent``, ``staleness_factor``); a buffer of fresh replies only is the
synchronous round when η_g = 1 (``aggregate_replies``). The update, per method (docs/async.md):

- a mean method (``Method.async_update == 'mean'``): each reply moved onto the current model,
  x_t + η_g cₙ (xₙ − x_vₙ) (``moved_replies``), so the update is FedBuff's
  x_t + η_g Σ wₙ cₙ (xₙ − x_vₙ), η_g its server rate (``async-server-lr``);
- a Gram-average method (``'gram'``): Q = A_tᵀ A_t + η_g Σ wₙ cₙ (AₙᵀAₙ − A_vₙᵀ A_vₙ),
  decomposed and aligned as in sync (strategies/florg/buffered_rule.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from strategies.server.product_gap import gap_metrics
from strategies.server.replies import Reply
from strategies.shared.averaging import weighted_average


def staleness_factor(staleness: int, exponent: float) -> float:
    """cₙ = (1 + τ)^-a: the share of its delta a reply ``staleness`` versions old keeps."""
    return float((1.0 + staleness) ** (-exponent))


@dataclass(frozen=True)
class AsyncSettings:
    """``round-mode=async``'s settings (flower_app/settings/rounds.py), resolved."""

    concurrency: int = 0  # 0: the synchronous sample size
    buffer_size: int = 0  # 0: the concurrency
    staleness_exponent: float = 0.5
    max_staleness: int = 8
    seed: int = 0  # which idle nodes get work
    server_lr: float = 1.0  # η_g, FedBuff's server learning rate


def staleness_factors(kept: list[Reply], exponent: float, server_lr: float = 1.0) -> list[float]:
    """Each reply's share of its delta, η_g cₙ = η_g (1 + τₙ)^-a (η_g: ``server_lr``)."""
    # η_g = 1 leaves cₙ bit for bit: 1.0 × c is exactly c in IEEE arithmetic
    return [server_lr * staleness_factor(r.staleness, exponent) for r in kept]


def moved_replies(
    current: Mapping[str, np.ndarray],
    kept: list[Reply],
    exponent: float,
    keys: list[str] | None = None,
    server_lr: float = 1.0,
) -> list[dict]:
    """Each reply read from the current model, x_t + η_g cₙ (xₙ − x_vₙ), over ``keys``
    (None: every array it sent); their weighted mean is FedBuff's update (η_g:
    ``server_lr``)."""
    return [
        {k: current[k] + c * (np.asarray(r.arrays[k], np.float64) - r.start[k])
         for k in (r.arrays if keys is None else keys)}
        for r, c in zip(kept, staleness_factors(kept, exponent, server_lr), strict=True)
    ]  # fmt: skip


def mean_buffered_step(
    strategy: Any, server_round: int, kept: list[Reply], weights: np.ndarray
) -> tuple[dict[str, np.ndarray], dict[str, float]]:
    """A mean method's buffered update: its rule (``strategy.aggregate_adapter``) over the
    replies moved onto the current model (``moved_replies``), the head likewise."""
    moved = moved_replies(
        strategy.global_state, kept, strategy.staleness_exponent, server_lr=strategy.server_lr
    )
    new_state, info = strategy.aggregate_adapter(server_round, moved, weights)
    if strategy.product_gap:  # over the replies the rule took
        info |= gap_metrics(strategy, moved, weights, new_state)
    for key in strategy.head_keys():
        new_state[key] = weighted_average([m[key] for m in moved], weights, key)
    return new_state, info
