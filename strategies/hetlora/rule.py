"""HetLoRA (Cho et al., 2024, "Heterogeneous LoRA for Federated Fine-tuning of On-Device
Foundation Models"): clients train LoRA at their own ranks r_n; the server zero-pads
(``aggregate_hetlora``, ``zero_pad``). With r = max(r_max, max_n r_n), r_max the global rank,

    B = sum_n w_n [B_n, 0]      (d_out x r: B_n's columns, zero columns up to r)
    A = sum_n w_n [A_n; 0]      (r x d_in:  A_n's rows, zero rows up to r)

so the i-th rank-one direction averages over the clients that have it, the others counting
as zero. Client n is sent B's first r_n columns and A's top r_n rows
(``flower_app.wire.ranks.truncate_to_rank``). With every r_n equal this is the separate
weighted mean of A and of B. Not implemented: the paper's rank self-pruning on the clients
and its sparsity-weighted aggregation; the weights are the run's (``aggregation-weights``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from strategies.shared.validation import (
    AggregationInputError,
    check_mixed_rank_pairs,
    normalize_weights,
)

__all__ = ["aggregate_hetlora", "zero_pad"]


def zero_pad(matrix: np.ndarray, rank: int, axis: int) -> np.ndarray:
    """``matrix`` with zeros appended along ``axis`` up to ``rank`` entries."""
    missing = rank - matrix.shape[axis]
    if missing < 0:
        raise AggregationInputError(f"rank {matrix.shape[axis]} exceeds the padded rank {rank}")
    if missing == 0:
        return matrix
    pad = [(0, 0), (0, 0)]
    pad[axis] = (0, missing)
    return np.pad(matrix, pad)


def aggregate_hetlora(
    client_Bs: Sequence[np.ndarray],
    client_As: Sequence[np.ndarray],
    weights: Sequence[float] | np.ndarray | None,
    rank: int | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """(B, A) of rank ``rank`` (default: the largest client rank): the weighted average of
    the zero-padded factors.  AggregationInputError names the client on a bad input: no
    clients, B's columns != A's rows, a d_out or d_in that differs, NaN/Inf, bad weights."""
    Bs, As = check_mixed_rank_pairs(client_Bs, client_As, "hetlora")
    r = max(b.shape[1] for b in Bs) if rank is None else int(rank)
    w = normalize_weights(weights, len(Bs))
    B = sum(wn * zero_pad(b, r, axis=1) for wn, b in zip(w, Bs, strict=True))
    A = sum(wn * zero_pad(a, r, axis=0) for wn, a in zip(w, As, strict=True))
    return np.asarray(B), np.asarray(A)
