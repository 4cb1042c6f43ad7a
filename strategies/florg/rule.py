"""FLoRG server step for one adapted layer, the float64 numpy reference (``aggregate_florg``).

    Q = sum_n w_n A_n^T A_n   (k x k; A_n: r x k, k = min(d_in, d_out))   eq. (Gram_agg)
    Q = P^T Lambda P,  A~ = Lambda^{1/2} P   (r' x k)                   eq. (Gram_decompose)
    S = U V^T from A_prev A~^T = U Sigma V^T,  A_new = S A~  (r x k)     Theorem 1

Q is never formed: A~ = U_{r'}^T M, M = [sqrt(w_1) A_1; ...] (N r x k), from eigh of M M^T
(``decompose_stacked_gram``; rows sign-fixed, largest entry positive). Numerical rank
r' = #{i : lambda_i > rtol lambda_1}, rtol = max(k, N r) eps_float64 by default. For r' > r,
'procrustes' (the paper's S over all r' rows) maximises tr(A_prev A~^T S^T) (P2) but does not
minimise ||S A~ - A_prev||_F (P1); 'truncate' keeps the top r eigenpairs (Eckart-Young) first:
docs/architecture.md. ``aggregate_florg_reference`` forms Q (O(k^3), tests and benchmarks).
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
    client_As: Sequence[np.ndarray],
    weights: Sequence[float] | np.ndarray | None,
    prev_A: Any,
    rtol: float | None,
    rank_mismatch: str,
) -> tuple[list[np.ndarray], np.ndarray, np.ndarray, float]:
    """What both FLoRG steps (thin and reference) start from: the policy checked, the
    clients' A_n (each r x k, float64), the normalised weights, prev_A as float64, and the
    eigenvalue tolerance (``rtol``, else ``default_rtol`` for the N r stacked rows)."""
    check_rank_mismatch(rank_mismatch)
    prev = as_float64_matrix(prev_A, "prev_A")
    r, k = prev.shape
    if r > k:
        raise AggregationInputError(f"prev_A: rank r={r} exceeds k=min(d_in, d_out)={k}")
    if r < 1:
        raise AggregationInputError("prev_A: rank r must be at least 1")
    mats = check_client_matrices(client_As, (r, k), "client_As")
    w = normalize_weights(weights, len(mats))
    tol = default_rtol(k, len(mats) * r) if rtol is None else float(rtol)
    return mats, w, prev, tol


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
    mats, w, prev, tol = _validated_inputs(client_As, weights, prev_A, rtol, rank_mismatch)
    M = stack_weighted(mats, w)

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
    mats, w, prev, tol = _validated_inputs(client_As, weights, prev_A, rtol, rank_mismatch)
    r = prev.shape[0]
    Q = sum(wn * (a.T @ a) for wn, a in zip(w, mats, strict=True))
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
