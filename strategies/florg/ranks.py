"""FLoRG with heterogeneous client ranks, one layer, the float64 numpy reference
(``aggregate_florg_ranks``): client n sends A_n (r_n x k), r_n = 0 allowed, R = sum_n r_n.

    Q = sum_n w_n A_n^T A_n  (k x k, no common rank needed)          eq. (Gram_agg)
    Q = P^T Lambda P,  A~ = Lambda^{1/2} P  (r' x k, r' <= min(k, R))  eq. (Gram_decompose)

A~ is computed once per layer through the thin stack M = [sqrt(w_1) A_1; ...] (R x k,
``strategies.florg.rule.decompose_stacked_gram``) and serves every requested rank r_t, a
key of ``prev_by_rank``: Theorem 1 against that rank's A_prev under the rank-mismatch
policy (``strategies.florg.rule.factor_for_rank``; 'truncate' by default here). With every
r_n = r and the one rank r this is ``aggregate_florg``. ``strategies.florg.ranks_torch``
batches it over layers; the policies per rank: docs/architecture.md.
"""

from __future__ import annotations

import logging
import numbers
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from strategies.florg.rule import (
    RankInfo,
    check_rank_mismatch,
    decompose_stacked_gram,
    default_rtol,
    factor_for_rank,
    stack_weighted,
)
from strategies.shared.validation import AggregationInputError, as_float64_matrix, normalize_weights

log = logging.getLogger(__name__)

__all__ = [
    "RankInfo",
    "aggregate_florg_ranks",
    "factor_for_rank",
    "validated_rank_inputs",
]


def validated_rank_inputs(
    client_As: Sequence[Any],
    weights: Sequence[float] | np.ndarray | None,
    prev_by_rank: Mapping[int, Any],
) -> tuple[list[np.ndarray], np.ndarray, dict[int, np.ndarray], int]:
    """(clients' A_n as float64, normalised weights, {r_t: A_prev as float64}, k).

    Raises AggregationInputError naming the client or rank: no clients or no requested
    ranks, a non-matrix or NaN/Inf entry, a k that differs between clients or from a
    previous factor, a client rank r_n > k, a requested rank < 1 or > k (or not an integer),
    a previous factor whose row count is not its rank, negative or all-zero weights.
    """
    if len(client_As) == 0:
        raise AggregationInputError("client_As: no client matrices to aggregate")
    if not isinstance(prev_by_rank, Mapping) or len(prev_by_rank) == 0:
        raise AggregationInputError(
            "prev_by_rank: expected a non-empty mapping rank -> previous factor (r x k)"
        )
    mats = [as_float64_matrix(a, f"client_As[client {i}]") for i, a in enumerate(client_As)]
    k = mats[0].shape[1]
    for i, a in enumerate(mats):
        r_n, k_n = a.shape
        if k_n != k:
            raise AggregationInputError(
                f"client_As[client {i}]: k={k_n} columns does not match client 0's k={k}"
            )
        if r_n > k:
            raise AggregationInputError(
                f"client_As[client {i}]: rank r_n={r_n} exceeds k=min(d_in, d_out)={k}"
            )
    prevs: dict[int, np.ndarray] = {}
    for key, prev_A in prev_by_rank.items():
        if isinstance(key, bool) or not isinstance(key, numbers.Integral):
            raise AggregationInputError(f"prev_by_rank: rank {key!r} is not an integer")
        r_t = int(key)
        if r_t < 1:
            raise AggregationInputError(f"prev_by_rank: requested rank {r_t} is below 1")
        if r_t > k:
            raise AggregationInputError(
                f"prev_by_rank: requested rank {r_t} exceeds k=min(d_in, d_out)={k}"
            )
        prev = as_float64_matrix(prev_A, f"prev_by_rank[{r_t}]")
        if prev.shape[1] != k:
            raise AggregationInputError(
                f"prev_by_rank[{r_t}]: k={prev.shape[1]} columns does not match the clients' k={k}"
            )
        if prev.shape[0] != r_t:
            raise AggregationInputError(
                f"prev_by_rank[{r_t}]: has {prev.shape[0]} rows, but is the factor of rank {r_t}"
            )
        prevs[r_t] = prev
    w = normalize_weights(weights, len(mats))
    return mats, w, prevs, k


def aggregate_florg_ranks(
    client_As: Sequence[np.ndarray],
    weights: Sequence[float] | np.ndarray | None,
    prev_by_rank: Mapping[int, np.ndarray],
    procrustes: bool = True,
    rank_mismatch: str = "truncate",
    rtol: float | None = None,
) -> tuple[dict[int, np.ndarray], dict[int, RankInfo]]:
    """One FLoRG server step for one layer whose clients have different ranks (thin path).

    Args:
        client_As: the clients' A_n, r_n x k each (r_n may differ; 0 x k contributes nothing).
        weights: non-negative client weights (normalised here over all clients, rank-0 ones
            included: a rank-0 client's Gram is zero, so it still takes its share of the
            weight and Q is scaled by 1 - w_n; give it weight 0 to leave Q the others'
            average); None means uniform 1/N.
        prev_by_rank: r_t -> the previous global factor of rank r_t (r_t x k), for each
            distinct rank to return (1 <= r_t <= k).
        procrustes: False gives the ablation (top-r_t rows of A~ in eigenvalue order, signs
            fixed, zero-padded).
        rank_mismatch: 'truncate' (default: the top min(r_t, r') eigenpairs, the
            Eckart-Young best rank-r_t approximation of Q, then an r_t x r_t Procrustes
            rotation, which then does minimise ||S A~_t - A_prev||_F) or 'procrustes' (the
            paper's S over all r' rows: for r' > r_t it maximises the alignment, problem
            P2, but not the distance, P1, and the Gram is approximated, not necessarily
            best; docs/architecture.md).  Ignored by the ablation.
        rtol: relative eigenvalue tolerance for the numerical rank r' (default
            max(k, R) eps_float64).

    Returns:
        (r_t -> new factor, r_t x k float64; r_t -> ``factor_for_rank``'s diagnostics), in
        the order of ``prev_by_rank``.

    For r' <= r_t the two policies are the same computation and A_new^T A_new = Q exactly
    (so whenever R <= r_t).  Rank-deficient Q (r' < r_t): without Procrustes the rows
    beyond r' are zero; with it A_new = S A~ with S (r_t x r') of orthonormal columns, i.e.
    O [A~; 0] for an orthogonal r_t x r_t O (any completion of S to O gives the same
    A_new, the zero rows carry no alignment), with r_t - r' zero singular values.  Q = 0
    (r' = 0) gives A_new = 0.
    """
    check_rank_mismatch(rank_mismatch)
    mats, w, prevs, k = validated_rank_inputs(client_As, weights, prev_by_rank)
    M = stack_weighted(mats, w)  # (R x k), Q = M^T M
    tol = default_rtol(k, M.shape[0]) if rtol is None else float(rtol)
    eigenvalues, A_tilde = decompose_stacked_gram(M, tol)
    if A_tilde.shape[0] == 0:
        log.warning("FLoRG: aggregated Gram matrix is zero (rank 0); every new factor is zero")
    new: dict[int, np.ndarray] = {}
    infos: dict[int, RankInfo] = {}
    for r_t, prev in prevs.items():
        new[r_t], infos[r_t] = factor_for_rank(
            eigenvalues, A_tilde, prev, procrustes, rank_mismatch
        )
    return new, infos
