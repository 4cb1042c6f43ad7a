"""FeDeRA as the FLoRG paper describes it: aggregate the products, re-factor by truncated SVD.

    Delta = sum_n w_n B_n A_n = B_s A_s,   B_s = [sqrt(w_1) B_1, ..., sqrt(w_N) B_N]   (d_out x N r)
                                           A_s = [sqrt(w_1) A_1; ...; sqrt(w_N) A_N]   (N r x d_in)

Delta (d_out x d_in) is never formed: with B_s = Q_b R_b and A_s^T = Q_a R_a (thin QR),
Delta = Q_b (R_b R_a^T) Q_a^T, and the SVD of the small core R_b R_a^T = U S V^T gives
Delta's SVD.  The rank-r truncation splits the singular values evenly:

    B = Q_b U_r S_r^{1/2}  (d_out x r),     A = S_r^{1/2} V_r^T Q_a^T  (r x d_in).

Exact (B A = Delta) whenever rank(Delta) <= r.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from strategies.common.validation import (
    AggregationInputError,
    check_client_matrices,
    normalize_weights,
)


def stacked_lora_factors(
    client_Bs: Sequence[np.ndarray],
    client_As: Sequence[np.ndarray],
    weights: Sequence[float] | np.ndarray | None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(B_s, A_s, w) with B_s A_s = sum_n w_n B_n A_n; checks shapes, finiteness and weights."""
    Bs = check_client_matrices(client_Bs, None, "B")
    As = check_client_matrices(client_As, None, "A")
    if len(Bs) != len(As):
        raise AggregationInputError(f"got {len(Bs)} B matrices but {len(As)} A matrices")
    if Bs[0].shape[1] != As[0].shape[0]:
        raise AggregationInputError(
            f"B is {Bs[0].shape} but A is {As[0].shape}: B's columns must equal A's rows (r)"
        )
    w = normalize_weights(weights, len(Bs))
    sw = np.sqrt(w)
    B_s = np.concatenate([s * b for s, b in zip(sw, Bs, strict=True)], axis=1)
    A_s = np.concatenate([s * a for s, a in zip(sw, As, strict=True)], axis=0)
    return B_s, A_s, w


def truncated_product_svd(
    left: np.ndarray, right: np.ndarray, r: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rank-r factors (B, A) of left @ right via QR + core SVD, and all singular values."""
    Qb, Rb = np.linalg.qr(left)
    Qa, Ra = np.linalg.qr(right.T)
    U, s, Vt = np.linalg.svd(Rb @ Ra.T)
    root = np.sqrt(s[:r])
    B = (Qb @ U[:, :r]) * root
    A = (root[:, None] * Vt[:r]) @ Qa.T
    if B.shape[1] < r:  # fewer singular directions than r: pad with zero columns/rows
        B = np.pad(B, ((0, 0), (0, r - B.shape[1])))
        A = np.pad(A, ((0, r - A.shape[0]), (0, 0)))
    return B, A, s


def aggregate_federa(
    client_Bs: Sequence[np.ndarray],
    client_As: Sequence[np.ndarray],
    weights: Sequence[float] | np.ndarray | None,
) -> tuple[np.ndarray, np.ndarray, dict[str, float | int]]:
    """Rank-r (B, A) nearest sum_n w_n B_n A_n; info holds ``rank`` and ``trunc_rel_error``."""
    B_s, A_s, _ = stacked_lora_factors(client_Bs, client_As, weights)
    r = np.asarray(client_Bs[0]).shape[1]
    B, A, s = truncated_product_svd(B_s, A_s, r)
    tol = max(B_s.shape[0], A_s.shape[1]) * np.finfo(np.float64).eps * (s[0] if s.size else 0.0)
    total = float(np.sqrt(np.sum(s**2)))
    info: dict[str, float | int] = {
        "rank": int(np.count_nonzero(s > tol)),
        "trunc_rel_error": float(np.sqrt(np.sum(s[r:] ** 2)) / total) if total > 0 else 0.0,
    }
    return B, A, info
