"""FLoRG's server step for a buffer of replies trained from different models, one layer
(``aggregate_florg_buffered``), the update of ``round-mode=async``
(strategies/server/buffered_rounds.py). A reply trained from an older A_τ enters as its
Gram delta, scaled by its staleness factor cₙ = (1 + τₙ)^-a and FedBuff's server rate η_g:

    Q = A_curᵀ A_cur + η_g Σ wₙ cₙ (AₙᵀAₙ − A_τₙᵀ A_τₙ)      (Σ wₙ = 1; eq. Gram_agg)

then the decomposition (eq. Gram_decompose) and Procrustes with A_cur (Theorem 1) as in
``strategies.florg.rule``; with every reply fresh and η_g = 1 Q is the synchronous Gram
average. Q may have negative eigenvalues: the step keeps its positive part and reports the
share dropped (``negative_share``); ``gram_rel_error`` is against the signed Q. Q is never
formed (``signed_gram_eigenpairs``). More: docs/async.md, "What an update does, per method".
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from strategies.florg.rule import (
    AGGREGATE_INFO_KEYS,
    _canonical_signs,
    _numerical_rank,
    check_rank_mismatch,
    default_rtol,
    factor_for_rank,
)
from strategies.shared.validation import (
    as_float64_matrix,
    check_client_matrices,
    normalize_weights,
)


def signed_gram_eigenpairs(M: np.ndarray, signs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q = Mᵀ diag(signs) M: its eigenvalues, signed and descending, and eigenvectors P
    (k x min(rows, k); Q has no other nonzero eigenvalue).

    Q is never formed while M has no more rows p than columns: a QR factorisation
    Mᵀ = U T (U k x p with orthonormal columns) gives Q = U (T D Tᵀ) Uᵀ, D = diag(signs),
    so the eigenpairs of the small symmetric T D Tᵀ = V Λ Vᵀ give Q's: eigenvectors U V,
    eigenvalues Λ."""
    rows, k = M.shape
    if rows <= k:
        U, T = np.linalg.qr(M.T)  # Mᵀ = U T
        lam, V = np.linalg.eigh(T @ (signs[:, None] * T.T))
        P = U @ V
    else:
        lam, P = np.linalg.eigh(M.T @ (signs[:, None] * M))
    return lam[::-1], P[:, ::-1]


def decompose_signed_gram(
    M: np.ndarray, signs: np.ndarray, rtol: float
) -> tuple[np.ndarray, np.ndarray, float]:
    """Q = Mᵀ diag(signs) M: its eigenvalues (descending, negative ones set to 0), A~ =
    Λ^½ Pᵀ over the positive ones (r' x k) and the share of |Λ| that was negative."""
    return positive_part(*signed_gram_eigenpairs(M, signs), rtol)


def positive_part(
    lam: np.ndarray, P: np.ndarray, rtol: float
) -> tuple[np.ndarray, np.ndarray, float]:
    """``decompose_signed_gram`` from Q's signed eigenpairs (descending)."""
    total = float(np.sum(np.abs(lam)))
    negative = float(-np.sum(lam[lam < 0]) / total) if total > 0 else 0.0
    lam = np.clip(lam, 0.0, None)
    r_prime = _numerical_rank(lam, rtol)
    A_tilde = _canonical_signs(np.sqrt(lam[:r_prime])[:, None] * P[:, :r_prime].T)
    return lam, A_tilde, negative


def aggregate_florg_buffered(
    client_As: Sequence[np.ndarray],
    start_As: Sequence[np.ndarray],
    weights: Sequence[float] | np.ndarray | None,
    factors: Sequence[float],
    current_A: np.ndarray,
    procrustes: bool = True,
    rtol: float | None = None,
    rank_mismatch: str = "procrustes",
) -> tuple[np.ndarray, dict[str, float | int]]:
    """One buffered FLoRG step for one layer (the module docstring's Q), Q = Mᵀ D M with M
    the stacked rows [A_cur; √(wₙcₙ) Aₙ; √(wₙcₙ) A_τₙ] and D their signs (+, +, −).

    Args:
        client_As: the replies' A_n (r x k each).
        start_As: the global A each reply trained from (A_τₙ; r x k each).
        weights: the replies' weights (normalised here; None: uniform).
        factors: each reply's share of its Gram delta, η_g cₙ: its staleness factor
            times the server rate (``strategies.server.buffered_update.staleness_factors``).
        current_A: the current global A, Q's base and the Procrustes anchor.

    Returns the new A (r x k) and ``strategies.florg.rule``'s diagnostics
    (``gram_rel_error`` against the signed Q) plus ``negative_share``."""
    check_rank_mismatch(rank_mismatch)
    prev = as_float64_matrix(current_A, "current_A")
    r, k = prev.shape
    mats = check_client_matrices(client_As, (r, k), "client_As")
    starts = check_client_matrices(start_As, (r, k), "start_As")
    w = normalize_weights(weights, len(mats)) * np.asarray(factors, np.float64)
    scale = np.sqrt(w)
    M = np.concatenate(
        [prev, *(s * a for s, a in zip(scale, mats, strict=True)),
         *(s * a for s, a in zip(scale, starts, strict=True))]
    )  # fmt: skip
    signs = np.concatenate([np.ones(r * (1 + len(mats))), -np.ones(r * len(starts))])
    tol = default_rtol(k, M.shape[0]) if rtol is None else float(rtol)
    signed, P = signed_gram_eigenpairs(M, signs)
    eigenvalues, A_tilde, negative = positive_part(signed, P, tol)
    new_A, diagnostics = factor_for_rank(eigenvalues, A_tilde, prev, procrustes, rank_mismatch)
    info = {key: diagnostics[key] for key in AGGREGATE_INFO_KEYS}
    info["gram_rel_error"] = signed_gram_rel_error(
        float(diagnostics["gram_rel_error"]), eigenvalues, signed
    )
    info["negative_share"] = negative
    return new_A, info


def signed_gram_rel_error(
    positive_rel_error: float, eigenvalues: np.ndarray, signed: np.ndarray
) -> float:
    """‖A_newᵀA_new − Q‖_F / ‖Q‖_F from the error relative to Q's positive part
    (``factor_for_rank``'s, over ``eigenvalues``, Q's clipped at 0) and Q's ``signed``
    eigenvalues.

    Q's negative part lies in eigenvectors orthogonal to A_new's rows and to the positive
    part, so its squared norm adds alike to the squared error against the positive part
    and to ‖Q‖_F²."""
    negative_sq = float(np.sum(signed[signed < 0] ** 2))
    if negative_sq == 0:
        return positive_rel_error
    positive_sq = float(np.sum(eigenvalues**2))
    total = positive_sq + negative_sq
    return float(np.sqrt((positive_rel_error**2 * positive_sq + negative_sq) / total))
