"""FedEx-LoRA (Singhal et al., 2024): average B and A, and fold the exact residual into W0.

    residual = sum_n w_n B_n A_n - avg(B) avg(A)       (d_out x d_in)

so that  W0 + s (residual + avg(B) avg(A)) = W0 + s sum_n w_n B_n A_n  exactly.

The paper's version sends the residual dense (d_out * d_in numbers per layer).
Our improvement sends it as exact factors of rank <= (N + 1) r:

    residual = P Q,   P = [B_s, -avg(B)]  (d_out x (N+1) r),   Q = [A_s; avg(A)]  ((N+1) r x d_in)

with B_s, A_s the sqrt(w)-weighted stacks of strategies.shared.low_rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import numpy as np

from strategies.shared.averaging import weighted_average
from strategies.shared.folds import Residual
from strategies.shared.low_rank import stacked_lora_factors

ResidualMode = Literal["dense", "factored"]
RESIDUAL_MODES: tuple[str, ...] = ("dense", "factored")


def aggregate_fedex_lora(
    client_Bs: Sequence[np.ndarray],
    client_As: Sequence[np.ndarray],
    weights: Sequence[float] | np.ndarray | None,
    residual_mode: str = "dense",
) -> tuple[np.ndarray, np.ndarray, Residual]:
    """(avg B, avg A, residual) with avg(B) avg(A) + residual = sum_n w_n B_n A_n."""
    if residual_mode not in RESIDUAL_MODES:
        raise ValueError(f"residual_mode {residual_mode!r} unknown; choose one of {RESIDUAL_MODES}")
    B_s, A_s, w = stacked_lora_factors(client_Bs, client_As, weights)
    B_bar, A_bar = weighted_average(client_Bs, w, "B"), weighted_average(client_As, w, "A")
    if residual_mode == "dense":
        residual = Residual(dense=B_s @ A_s - B_bar @ A_bar)
    else:
        residual = Residual(P=np.concatenate([B_s, -B_bar], axis=1), Q=np.concatenate([A_s, A_bar]))
    return B_bar, A_bar, residual


# Under secure aggregation the dense round is a function of three weighted means, avg(B),
# avg(A) and avg(BA) = sum_n w_n B_n A_n, which the server gets from the clients' masked sum;
# the factored residual stacks each client's factors, which no sum gives.
def fedex_from_means(
    B_bar: np.ndarray, A_bar: np.ndarray, mean_product: np.ndarray
) -> tuple[np.ndarray, np.ndarray, Residual]:
    """The dense round from the weighted means: (avg B, avg A, residual) with
    residual = avg(BA) - avg(B) avg(A), ``mean_product`` being avg(BA) = sum_n w_n B_n A_n."""
    B_bar, A_bar = np.asarray(B_bar, np.float64), np.asarray(A_bar, np.float64)
    return B_bar, A_bar, Residual(dense=np.asarray(mean_product, np.float64) - B_bar @ A_bar)
