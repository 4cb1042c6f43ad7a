"""Fed-SB (Singhal et al. 2025, arXiv 2502.15436): LoRA-SB's fixed B and A, the average of R
and the initialisation's factorisation, as float64 numpy references.

    sum_n w_n B R_n A = B (sum_n w_n R_n) A                                   (1)

so the server averages R (r x r) alone (``aggregate_fed_sb``), as the authors'
``aggregate_models_fed_sb`` (fed_sb/fed/fed_agg.py). The initialisation (the authors'
``find_and_initialize_grad`` with ``get_svd_grad``): P = -lr sign(G) (``sign_step``), G the
summed gradient of the loss with respect to W0, and its rank-r truncated SVD
P ≈ U_r S_r V_rᵀ gives B = U_r, R = S_r, A = V_rᵀ (``initial_factors``). The SVD is exact,
float64, with each direction's sign fixed (``truncated_svd``), where the authors' is
randomised and rounded to bf16: docs/architecture.md, "Fed-SB, and how it differs".
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from strategies.shared.averaging import weighted_average
from strategies.shared.validation import AggregationInputError


def aggregate_fed_sb(
    client_Rs: Sequence[np.ndarray], weights: Sequence[float] | np.ndarray | None
) -> np.ndarray:
    """sum_n w_n R_n (r x r), the exact mean update (1) in the fixed B and A."""
    return weighted_average(client_Rs, weights, "R")


def sign_step(G: np.ndarray, lr: float) -> np.ndarray:
    """P = -lr sign(G): the first step of a sign optimiser from the gradient G."""
    if not lr > 0:
        raise ValueError(f"lr must be > 0, got {lr!r}")
    G = np.asarray(G, np.float64)
    if G.ndim != 2 or not np.all(np.isfinite(G)):
        raise AggregationInputError(f"gradient must be a finite matrix, got shape {G.shape}")
    return -lr * np.sign(G)


def truncated_svd(P: np.ndarray, r: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(U_r, s_r, V_rᵀ) of P (d_out x d_in), float64, r <= min(d_out, d_in), with the
    largest-magnitude entry of each row of V_rᵀ positive (its column of U_r flipped with
    it), so every node and the server derive the same B and A whatever the LAPACK build;
    flipping a row of A with its column of B leaves B R A unchanged (R diagonal). The
    authors take the SVD of Gᵀ with ``torch.svd_lowrank`` (randomised, 10 power
    iterations, float32, rounded to bf16) and transpose twice."""
    P = np.asarray(P, np.float64)
    if not 1 <= r <= min(P.shape):
        raise ValueError(f"rank r={r} must be in [1, min(d_out, d_in)={min(P.shape)}]")
    u, s, vt = np.linalg.svd(P, full_matrices=False)
    u, s, vt = u[:, :r], s[:r], vt[:r]
    signs = np.sign(vt[np.arange(r), np.argmax(np.abs(vt), axis=1)])
    signs[signs == 0] = 1.0
    return u * signs, s, vt * signs[:, None]


def initial_factors(G: np.ndarray, lr: float, r: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(B, R, A) from the gradient G of one layer: B R A = the rank-r truncation of
    -lr sign(G), B = U_r (d_out x r), R = diag(S_r), A = V_rᵀ (r x d_in)."""
    B, s, A = truncated_svd(sign_step(G, lr), r)
    return B, np.diag(s), A
