"""RoLoRA (Chen et al., NeurIPS 2025, arXiv 2502.01755): alternate which LoRA factor trains.

In an odd round every client trains B with A fixed at the global A, in an even round A with
B fixed at the global B; the server averages the one factor that moved. With the other
factor the same on every client, the mean of the products is the product of the means:

    B-round:  sum_n w_n B_n A = (sum_n w_n B_n) A
    A-round:  sum_n w_n B A_n = B (sum_n w_n A_n)

so each round's aggregation is exact. B trains first because LoRA starts from B = 0, where
the gradient with respect to A is zero.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from strategies.shared.averaging import weighted_average


def rolora_part(server_round: int) -> str:
    """The factor trained in ``server_round`` (1, 2, ...): 'B' in odd rounds, 'A' in even."""
    if server_round < 1:
        raise ValueError(f"training rounds start at 1, got {server_round}")
    return "B" if server_round % 2 == 1 else "A"


def aggregate_rolora(
    client_factors: Sequence[np.ndarray], weights: Sequence[float] | np.ndarray | None
) -> np.ndarray:
    """sum_n w_n X_n of the round's trained factor (B_n d_out x r, or A_n r x d_in)."""
    return weighted_average(client_factors, weights, "factor")
