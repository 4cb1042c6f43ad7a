"""The server update of buffered asynchronous rounds (``round-mode=async``; the loop:
strategies/server/buffered_rounds.py), FedBuff's (Nguyen et al., AISTATS 2022) with each
method's own rule.

A reply that trained from version v and is applied at update t + 1 has staleness
τ = t − v and enters as what it changed since v, scaled by cₙ = (1 + τ)^-a
(``async-staleness-exponent``):

- a method whose rule is a weighted mean of its shared parts (``Method.async_update ==
  'mean'``): the rule over each reply moved onto the current model, x_t + cₙ (xₙ − x_vₙ),
  so the update is x_t + Σ wₙ cₙ (xₙ − x_vₙ), FedBuff's with a server rate of 1;
- a Gram-average method (``'gram'``): the Gram average moved by each reply's Gram delta,
  Q = A_tᵀ A_t + Σ wₙ cₙ (AₙᵀAₙ − A_vₙᵀ A_vₙ), decomposed and aligned as in sync
  (its folder's ``aggregate_buffered``, strategies/florg/buffered_rule.py).

A buffer whose replies all trained from the current version is the synchronous round: the
common strategy then runs its synchronous step on it (``aggregate_replies``), bit for bit,
so with ``async-buffer-size`` = ``async-concurrency`` = every node the run is the
synchronous run.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

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


class BufferedUpdate:
    """Mixed into the common strategy: the update over a buffer holding stale replies.
    Reads the strategy's ``global_state``, ``aggregate_adapter`` and ``head_keys``."""

    async_settings: AsyncSettings | None = None

    def staleness_factors(self, kept: list[Reply]) -> list[float]:
        exponent = self.async_settings.staleness_exponent if self.async_settings else 0.0
        return [staleness_factor(r.staleness, exponent) for r in kept]

    def moved_replies(self, kept: list[Reply], keys: list[str] | None = None) -> list[dict]:
        """Each reply read from the current model, x_t + cₙ (xₙ − x_vₙ), over ``keys``
        (None: every array it sent)."""
        current = self.global_state
        return [
            {k: current[k] + c * (np.asarray(r.arrays[k], np.float64) - r.start[k])
             for k in (r.arrays if keys is None else keys)}
            for r, c in zip(kept, self.staleness_factors(kept), strict=True)
        ]  # fmt: skip

    def aggregate_buffered(
        self, server_round: int, kept: list[Reply], weights: np.ndarray
    ) -> tuple[dict[str, np.ndarray], dict[str, float]]:
        """A buffer holding stale replies ('mean' methods): the method's rule over the
        moved replies (``moved_replies``), so the update is x_t + Σ wₙ cₙ (xₙ − x_vₙ); the
        head likewise. A Gram-average method overrides it in its folder."""
        moved = self.moved_replies(kept)
        new_state, info = self.aggregate_adapter(server_round, moved, weights)
        for key in self.head_keys():
            new_state[key] = weighted_average([m[key] for m in moved], weights, key)
        return new_state, info
