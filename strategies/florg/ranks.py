"""FLoRG with heterogeneous ranks, one layer (numpy reference): clients of different
capacity train A_n with different row counts r_n, and each client gets back the best
factor of its own rank.

Shapes (paper, section 3.1, with r_n in place of the common r): client n sends A_n
(r_n x k), k = min(d_in, d_out), r_n = 0 allowed (a 0 x k matrix); R = sum_n r_n.

    Q     = sum_n w_n A_n^T A_n                       (k x k)      eq. (Gram_agg)
    Q     = P^T Lambda P,  A~ = Lambda^{1/2} P        (r' x k)     eq. (Gram_decompose)

Gram_agg needs no common rank: each A_n^T A_n is k x k whatever r_n is, so Q, its
numerical rank r' <= min(k, R), and A~ are defined exactly as in ``strategies.florg.rule``.
Q is never formed: with the stacked rows of every client

    M = [sqrt(w_1) A_1; ...; sqrt(w_N) A_N]            (R x k),  Q = M^T M,

``strategies.florg.rule.decompose_stacked_gram`` takes A~ = U_{r'}^T M from eigh of the R x R
matrix G = M M^T (or eigh of Q itself when R > k, where Q is the smaller matrix).  A~ is
computed once per layer and serves every requested rank.

For each requested rank r_t (a key of ``prev_by_rank``; A_prev = prev_by_rank[r_t], r_t x k):

- ``truncate`` (default here): keep the top min(r_t, r') eigenpairs, A~_t = Lambda_t^{1/2} P_t,
  the Eckart-Young best rank-r_t approximation of Q (Gram error sqrt(sum_{i>r_t} lambda_i^2)),
  then Theorem 1 on what is kept: S = U V^T from the thin SVD of A_prev A~_t^T, and
  A_new = S A~_t.  For r' >= r_t, S is r_t x r_t orthogonal, so A_new is the factor of the
  best rank-r_t approximation of Q that lies nearest to A_prev in Frobenius norm (problem P1).
- ``procrustes`` (the paper's all-rows policy): S = U V^T from the thin SVD of the r_t x r'
  matrix A_prev A~^T, applied to all r' rows of A~.  For r' <= r_t, S has orthonormal columns
  (S^T S = I_r'), ||S A~||_F = ||A~||_F is fixed, so S minimises ||S A~ - A_prev||_F
  (problem P1) and A_new^T A_new = Q exactly.  For r' > r_t, S has orthonormal rows
  (S S^T = I_r_t): it maximises the trace alignment tr(A_prev A~^T S^T) (problem P2) over
  such S, but it does NOT minimise ||S A~ - A_prev||_F then, because ||S A~||_F depends on S
  (P1 and P2 are equivalent only when S^T S = I, the paper's constraint (c11), which no
  r_t x r' matrix with r' > r_t satisfies).  It projects A~ onto the r_t-dimensional row
  subspace best aligned with A_prev; the Gram matrix is approximated (reported as
  gram_rel_error), not necessarily by its best rank-r_t approximation.
- ``procrustes=False`` (the paper's ablation): the top r_t rows of A~ (eigenvalue order,
  signs fixed by ``_canonical_signs``), zero-padded.

For r' <= r_t both policies are the same computation.  In particular when R <= r_t
(r' <= R), Q is reproduced exactly.  With every r_n = r and the single requested rank r
this is ``strategies.florg.rule.aggregate_florg`` (the same functions, so the same numbers).

Rank-deficient Q (r' < r_t): the factor has rank r' < r_t.  Without Procrustes its rows
beyond r' are zero.  With Procrustes it is S A~ with S (r_t x r') having orthonormal
columns, i.e. O [A~; 0] for an orthogonal r_t x r_t O: the zero-padded factor with its
r_t - r' zero rows rotated (Theorem 1 on what exists: the zero rows carry no alignment,
so any completion of S to an orthogonal O gives the same A_new).  A_new^T A_new = Q exactly,
and A_new has r_t - r' zero singular values.  Q = 0 (r' = 0) gives A_new = 0.

Weights are normalised over all clients, rank-0 ones included: a rank-0 client's Gram is
zero, so it still takes its share of the weight (Q is scaled by 1 - w_n); give it weight 0
to leave Q as the others' average.

Numerical rank and tolerance as in ``strategies.florg.rule``: r' = #{i : lambda_i > rtol lambda_1},
default rtol = max(k, R) eps_float64.

``strategies.florg.ranks_torch.aggregate_florg_ranks_layers`` runs the same step for many
layers at once in torch (float64, batched, CPU or CUDA); this module is its reference.
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
            included); None means uniform 1/N.
        prev_by_rank: r_t -> the previous global factor of rank r_t (r_t x k), for each
            distinct rank to return (1 <= r_t <= k).
        procrustes: False gives the ablation (top-r_t rows of A~, zero-padded).
        rank_mismatch: 'truncate' (default: top-r_t eigenpairs, then an r_t x r_t Procrustes
            rotation) or 'procrustes' (the paper's Procrustes over all r' rows); see the
            module docstring.  Ignored by the ablation.
        rtol: relative eigenvalue tolerance for the numerical rank r'.

    Returns:
        (r_t -> new factor, r_t x k float64; r_t -> ``factor_for_rank``'s diagnostics), in
        the order of ``prev_by_rank``.
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
