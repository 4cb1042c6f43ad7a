"""FLoRG server step for one adapted layer: Gram aggregation, decomposition, Procrustes.

Shapes (paper, section 3.1): each client n sends A_n (r x k), k = min(d_in, d_out).

    Q       = sum_n w_n A_n^T A_n                   (k x k)      eq. (Gram_agg)
    Q       = P^T Lambda P,  A~ = Lambda^{1/2} P    (r' x k)     eq. (Gram_decompose)
    A_prev A~^T = U Sigma V^T,  S = U V^T           (r x r')     Theorem 1
    A_new   = S A~                                  (r x k)

The thin path never forms Q.  With the stacked matrix

    M = [sqrt(w_1) A_1; ...; sqrt(w_N) A_N]          (N r x k),  Q = M^T M,

Q and the small (N r x N r) matrix G = M M^T share their nonzero eigenvalues:
if G = U Lambda U^T, then Q = (U^T M)^T (U^T M) with the rows of U^T M orthogonal
and of squared norms Lambda, i.e.  A~ = Lambda^{1/2} P = U_{r'}^T M  directly,
without dividing by any eigenvalue.  This costs O(k (N r)^2) instead of the
O(k^3) eigendecomposition of Q.  (A thin SVD of M gives the same A~ but LAPACK
takes ~10x longer than eigh of G for these wide matrices.)

Eigenvectors have a sign ambiguity; each row of A~ is given the sign that makes
its largest-magnitude entry positive, so the ablation below is deterministic
(Procrustes output is invariant to it anyway).

Numerical rank: r' = #{i : lambda_i > rtol * lambda_1}, with the default
rtol = max(k, N r) * eps_float64 (eigenvalues below it are rounding noise of
the decomposition and are dropped, which also clamps tiny negative ones).

Rank mismatch (r' != r), the run setting ``rank-mismatch``:

- ``procrustes`` (default, the paper's Theorem 1 as written): S = U V^T from the thin SVD
  of the r x r' matrix A_prev A~^T, applied to all r' rows of A~.  For r' <= r, S has
  orthonormal columns (S^T S = I_r'), ||S A~||_F = ||A~||_F is fixed, so S minimises
  ||S A~ - A_prev||_F (problem P1) and A_new^T A_new = Q exactly.  For r' > r, S has
  orthonormal rows (S S^T = I_r): it maximises the trace alignment tr(A_prev A~^T S^T)
  (problem P2) over such S, but it does NOT minimise ||S A~ - A_prev||_F then, because
  ||S A~||_F depends on S (P1 and P2 are equivalent only when S^T S = I, the paper's
  constraint (c11), which no r x r' matrix with r' > r satisfies).  It projects A~ onto
  the r-dimensional row subspace best aligned with A_prev; the Gram matrix is approximated
  (reported as gram_rel_error), not necessarily by its best rank-r approximation.
- ``truncate``: keep the top-r eigenpairs of Q, A~_r = Lambda_r^{1/2} P_r (the
  Eckart-Young best rank-r approximation of Q, error sqrt(sum_{i>r} lambda_i^2)), then the
  r x r Procrustes rotation S = U V^T of A_prev A~_r^T (orthogonal, so here it does
  minimise ||S A~_r - A_prev||_F).  For r' <= r both policies are the same computation.

``strategies.florg.rule_torch.aggregate_florg_layers`` runs the same step for many layers at
once in torch (float64, batched over layers of equal shape, on CPU or CUDA).
This module's numpy ``aggregate_florg`` is its reference.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import numpy as np

from strategies.shared.validation import (
    AggregationInputError,
    as_float64_matrix,
    check_client_matrices,
    normalize_weights,
)

log = logging.getLogger(__name__)

EPS64 = float(np.finfo(np.float64).eps)
RANK_MISMATCH_POLICIES: tuple[str, ...] = ("procrustes", "truncate")
RankInfo = dict[str, float | int]
# The diagnostics ``aggregate_florg`` returns (of ``factor_for_rank``'s).
AGGREGATE_INFO_KEYS: tuple[str, ...] = (
    "rank",
    "gram_rel_error",
    "drift",
    "eigengap",
    "eigengap_rel",
)


def check_rank_mismatch(policy: str) -> str:
    """The policy name, or ValueError naming the allowed ones."""
    if policy not in RANK_MISMATCH_POLICIES:
        raise ValueError(f"rank_mismatch must be one of {RANK_MISMATCH_POLICIES}, got {policy!r}")
    return policy


def default_rtol(k: int, stacked_rows: int) -> float:
    """Relative eigenvalue tolerance below which an eigenvalue of Q counts as zero."""
    return max(k, stacked_rows) * EPS64


def stack_weighted(client_As: Sequence[np.ndarray], weights: np.ndarray) -> np.ndarray:
    """M = [sqrt(w_1) A_1; ...; sqrt(w_N) A_N]  (N r x k), so that Q = M^T M."""
    return np.concatenate([np.sqrt(w) * a for w, a in zip(weights, client_As, strict=True)])


def _validated_inputs(
    client_As: Sequence[np.ndarray], weights: Sequence[float] | np.ndarray | None, prev_A: Any
) -> tuple[list[np.ndarray], np.ndarray, np.ndarray]:
    prev = as_float64_matrix(prev_A, "prev_A")
    r, k = prev.shape
    if r > k:
        raise AggregationInputError(f"prev_A: rank r={r} exceeds k=min(d_in, d_out)={k}")
    if r < 1:
        raise AggregationInputError("prev_A: rank r must be at least 1")
    mats = check_client_matrices(client_As, (r, k), "client_As")
    w = normalize_weights(weights, len(mats))
    return mats, w, prev


def procrustes_rotation(prev_A: np.ndarray, A_tilde: np.ndarray) -> np.ndarray:
    """Theorem 1: S = U V^T from the thin SVD of A_prev A~^T (r x r').

    S maximises the trace alignment tr(A_prev A~^T S^T) (problem P2) over r x r' matrices
    with orthonormal columns (r' <= r) or orthonormal rows (r' > r).  For r' <= r that is
    the same as minimising ||S A~ - A_prev||_F (P1); for r' > r it is not, since
    ||S A~||_F then depends on S (see the module docstring).
    """
    r, r_prime = prev_A.shape[0], A_tilde.shape[0]
    if r_prime == 0:
        return np.zeros((r, 0))
    U, _, Vt = np.linalg.svd(prev_A @ A_tilde.T, full_matrices=False)
    return U @ Vt


def _numerical_rank(eigenvalues: np.ndarray, rtol: float) -> int:
    """Number of eigenvalues (sorted descending) above rtol * lambda_1."""
    if eigenvalues.size == 0 or eigenvalues[0] <= 0:
        return 0
    return int(np.count_nonzero(eigenvalues > rtol * eigenvalues[0]))


def _eigengap(eigenvalues: np.ndarray, r: int) -> tuple[float, float]:
    """lambda_r - lambda_{r+1} (1-based, zero beyond the spectrum) and that gap over lambda_1."""
    lam = np.concatenate([np.clip(eigenvalues, 0.0, None), np.zeros(r + 1)])
    gap = float(lam[r - 1] - lam[r])
    return gap, (gap / float(lam[0]) if lam[0] > 0 else 0.0)


def _canonical_signs(A_tilde: np.ndarray) -> np.ndarray:
    """Flip each row so that its largest-magnitude entry is positive (fixes eigh's signs)."""
    if A_tilde.size == 0:
        return A_tilde
    pivots = A_tilde[np.arange(A_tilde.shape[0]), np.argmax(np.abs(A_tilde), axis=1)]
    return A_tilde * np.where(pivots < 0, -1.0, 1.0)[:, None]


def _top_rows(A_tilde: np.ndarray, r: int) -> np.ndarray:
    """Ablation 'without Procrustes': first r rows of A~ (eigenvalue order), zero-padded."""
    out = np.zeros((r, A_tilde.shape[1]))
    m = min(r, A_tilde.shape[0])
    out[:m] = A_tilde[:m]
    return out


def decompose_stacked_gram(M: np.ndarray, rtol: float) -> tuple[np.ndarray, np.ndarray]:
    """Eigenvalues of Q = M^T M (descending, >= 0) and A~ = Lambda^{1/2} P (r' x k), Q never formed.

    Uses eigh of G = M M^T when M has fewer rows than columns (the usual N r < k);
    otherwise Q itself is the smaller matrix and is decomposed directly.
    """
    rows, k = M.shape
    if rows <= k:
        eigenvalues, U = np.linalg.eigh(M @ M.T)
        eigenvalues, U = np.clip(eigenvalues[::-1], 0.0, None), U[:, ::-1]
        r_prime = _numerical_rank(eigenvalues, rtol)
        return eigenvalues, _canonical_signs(U[:, :r_prime].T @ M)
    eigenvalues, P = np.linalg.eigh(M.T @ M)
    eigenvalues, P = np.clip(eigenvalues[::-1], 0.0, None), P[:, ::-1]
    r_prime = _numerical_rank(eigenvalues, rtol)
    return eigenvalues, _canonical_signs(np.sqrt(eigenvalues[:r_prime])[:, None] * P[:, :r_prime].T)


def factor_for_rank(
    eigenvalues: np.ndarray,
    A_tilde: np.ndarray,
    prev: np.ndarray,
    procrustes: bool,
    rank_mismatch: str,
) -> tuple[np.ndarray, RankInfo]:
    """The new factor of rank r_t = prev.shape[0] from Q's decomposition, and its diagnostics.

    Args:
        eigenvalues: Q's spectrum, descending, >= 0 (as ``decompose_stacked_gram`` returns).
        A_tilde: A~ = Lambda^{1/2} P (r' x k), rows orthogonal in eigenvalue order.
        prev: the previous factor of this rank (r_t x k), the Procrustes anchor.
        procrustes, rank_mismatch: see the module docstring (no defaults here: the
            homogeneous step defaults to 'procrustes', the mixed-rank one to 'truncate').

    Returns:
        A_new (r_t x k) and ``rank`` (r'), ``kept`` (the number of A~'s rows, i.e. of Q's
        eigenpairs, A_new is built from), ``gram_rel_error`` (||A_new^T A_new - Q||_F /
        ||Q||_F), ``trace_share`` (tr(A_new^T A_new) / tr(Q)), ``drift``
        (||A_new - A_prev||_F), ``eigengap`` (lambda_{r_t} - lambda_{r_t+1}) and
        ``eigengap_rel`` (that over lambda_1).
    """
    r = prev.shape[0]
    r_prime = A_tilde.shape[0]
    sqrt_lam = np.sqrt(eigenvalues[:r_prime])
    # A_new = Y Lambda^{-1/2} A~ with Y (r x r') its coordinates in the orthonormal rows
    # Lambda^{-1/2} A~; then ||A_new^T A_new - Q||_F = ||[Y^T Y - Lambda_{r'}, dropped]||_F.
    if procrustes:
        # 'truncate' keeps the top-r rows of A~ (Eckart-Young); Theorem 1 on what is kept.
        m = min(r, r_prime) if rank_mismatch == "truncate" else r_prime
        S = procrustes_rotation(prev, A_tilde[:m])
        new_A = S @ A_tilde[:m]
        Y = np.zeros((r, r_prime))
        Y[:, :m] = S * sqrt_lam[:m]
    else:
        m = min(r, r_prime)
        new_A, Y = _top_rows(A_tilde, r), _top_rows(np.diag(sqrt_lam), r)
    kept = Y.T @ Y - np.diag(eigenvalues[:r_prime])
    err_sq = float(np.sum(kept**2) + np.sum(eigenvalues[r_prime:] ** 2))
    q_norm = float(np.sqrt(np.sum(eigenvalues**2)))
    trace = float(np.sum(eigenvalues))
    gap, gap_rel = _eigengap(eigenvalues, r)
    info: RankInfo = {
        "rank": r_prime,
        "kept": m,
        "gram_rel_error": float(np.sqrt(err_sq) / q_norm) if q_norm > 0 else 0.0,
        "trace_share": float(np.sum(new_A**2)) / trace if trace > 0 else 0.0,
        "drift": float(np.linalg.norm(new_A - prev)),
        "eigengap": gap,
        "eigengap_rel": gap_rel,
    }
    return new_A, info


def aggregate_florg(
    client_As: Sequence[np.ndarray],
    weights: Sequence[float] | np.ndarray | None,
    prev_A: np.ndarray,
    procrustes: bool = True,
    rtol: float | None = None,
    rank_mismatch: str = "procrustes",
) -> tuple[np.ndarray, dict[str, float | int]]:
    """One FLoRG server step for one layer (thin path; never forms the k x k Gram matrix).

    Args:
        client_As: the clients' A_n, each r x k.
        weights: non-negative client weights (normalised here); None means uniform 1/N.
        prev_A: the previous global A (r x k), the Procrustes anchor.
        procrustes: False gives the paper's ablation (top-r rows of A~, zero-padded).
        rtol: relative eigenvalue tolerance for the numerical rank r' (see module doc).
        rank_mismatch: what to do when r' > r: 'procrustes' (Procrustes over all r' rows)
            or 'truncate' (top-r eigenpairs, then an r x r Procrustes rotation); see the
            module docstring.  Ignored by the ablation (procrustes=False).

    Returns:
        new_A (r x k, float64) and diagnostics ``rank`` (r'), ``gram_rel_error``
        (||A_new^T A_new - Q||_F / ||Q||_F), ``drift`` (||A_new - A_prev||_F),
        ``eigengap`` (lambda_r - lambda_{r+1}) and ``eigengap_rel`` (that over lambda_1).
    """
    check_rank_mismatch(rank_mismatch)
    mats, w, prev = _validated_inputs(client_As, weights, prev_A)
    M = stack_weighted(mats, w)
    tol = default_rtol(prev.shape[1], M.shape[0]) if rtol is None else float(rtol)

    eigenvalues, A_tilde = decompose_stacked_gram(M, tol)
    if A_tilde.shape[0] == 0:
        log.warning("FLoRG: aggregated Gram matrix is zero (rank 0); the new A is zero")
    new_A, diagnostics = factor_for_rank(eigenvalues, A_tilde, prev, procrustes, rank_mismatch)
    info = {key: diagnostics[key] for key in AGGREGATE_INFO_KEYS}
    return new_A, info


def aggregate_florg_reference(
    client_As: Sequence[np.ndarray],
    weights: Sequence[float] | np.ndarray | None,
    prev_A: np.ndarray,
    procrustes: bool = True,
    rtol: float | None = None,
    rank_mismatch: str = "procrustes",
) -> tuple[np.ndarray, dict[str, float | int]]:
    """The paper's straightforward path: form Q (k x k), ``eigh`` it, then Procrustes.

    O(k^3) per layer; kept for tests and the benchmark.  Same tolerance rule as
    ``aggregate_florg``; diagnostics are computed densely.
    """
    check_rank_mismatch(rank_mismatch)
    mats, w, prev = _validated_inputs(client_As, weights, prev_A)
    r, k = prev.shape
    Q = sum(wn * (a.T @ a) for wn, a in zip(w, mats, strict=True))
    tol = default_rtol(k, len(mats) * r) if rtol is None else float(rtol)
    lam, vecs = np.linalg.eigh(Q)
    lam, vecs = np.clip(lam[::-1], 0.0, None), vecs[:, ::-1]
    r_prime = _numerical_rank(lam, tol)
    A_tilde = _canonical_signs(np.sqrt(lam[:r_prime])[:, None] * vecs[:, :r_prime].T)
    if procrustes:
        kept = A_tilde[: min(r, r_prime)] if rank_mismatch == "truncate" else A_tilde
        new_A = procrustes_rotation(prev, kept) @ kept
    else:
        new_A = _top_rows(A_tilde, r)
    q_norm = float(np.linalg.norm(Q))
    gap, gap_rel = _eigengap(lam, r)
    info: dict[str, float | int] = {
        "rank": r_prime,
        "gram_rel_error": float(np.linalg.norm(new_A.T @ new_A - Q)) / q_norm if q_norm else 0.0,
        "drift": float(np.linalg.norm(new_A - prev)),
        "eigengap": gap,
        "eigengap_rel": gap_rel,
    }
    return new_A, info
