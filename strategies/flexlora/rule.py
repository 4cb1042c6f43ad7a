"""FlexLoRA (Bai et al., 2024, "Federated Fine-tuning of Large Language Models under
Heterogeneous Tasks and Client Resources"): clients train LoRA at their own ranks r_n; the
server averages the products and hands each client the truncated SVD at its rank
(``aggregate_flexlora``). Per layer, with B_n (d_out x r_n), A_n (r_n x d_in), R = sum r_n:

    Delta = sum_n w_n B_n A_n = B_s A_s,  B_s = [sqrt(w_1) B_1, ...]  (d_out x R)
                                          A_s = [sqrt(w_1) A_1; ...]  (R x d_in)
    Delta = U S V^T,   B_r = U_r S_r^{1/2},   A_r = S_r^{1/2} V_r^T

Delta is never formed (``strategies.shared.low_rank.truncated_product_svd``). Client n gets
the first r_n columns of B_r / rows of A_r (``flower_app.wire.ranks.truncate_to_rank``), so
the server keeps one pair, at the global rank; with every r_n = r, the product rule of equal ranks.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from strategies.shared.low_rank import truncated_product_svd
from strategies.shared.validation import (
    AggregationInputError,
    check_mixed_rank_pairs,
    normalize_weights,
)

__all__ = ["aggregate_flexlora", "stack_mixed_ranks"]


def stack_mixed_ranks(
    client_Bs: Sequence[np.ndarray],
    client_As: Sequence[np.ndarray],
    weights: Sequence[float] | np.ndarray | None,
) -> tuple[np.ndarray, np.ndarray]:
    """(B_s, A_s) with B_s A_s = sum_n w_n B_n A_n, whatever each r_n; checks the inputs."""
    Bs, As = check_mixed_rank_pairs(client_Bs, client_As, "flexlora")
    sw = np.sqrt(normalize_weights(weights, len(Bs)))
    B_s = np.concatenate([s * b for s, b in zip(sw, Bs, strict=True)], axis=1)
    A_s = np.concatenate([s * a for s, a in zip(sw, As, strict=True)], axis=0)
    return B_s, A_s


def aggregate_flexlora(
    client_Bs: Sequence[np.ndarray],
    client_As: Sequence[np.ndarray],
    weights: Sequence[float] | np.ndarray | None,
    rank: int,
) -> tuple[np.ndarray, np.ndarray, dict[str, float]]:
    """Rank-``rank`` (B, A) nearest sum_n w_n B_n A_n (zero-padded when Delta's rank is
    lower), and ``trunc_rel_error`` = ||Delta - B A||_F / ||Delta||_F."""
    if rank < 1:
        raise AggregationInputError(f"flexlora: rank must be >= 1, got {rank}")
    B_s, A_s = stack_mixed_ranks(client_Bs, client_As, weights)
    B, A, s = truncated_product_svd(B_s, A_s, rank)
    total = float(np.sqrt(np.sum(s**2)))
    error = float(np.sqrt(np.sum(s[rank:] ** 2)) / total) if total > 0 else 0.0
    return B, A, {"trunc_rel_error": error}
