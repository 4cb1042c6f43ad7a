"""Low-rank linear algebra the LoRA rules share: the weighted product sum_n w_n B_n A_n held
as two thin stacked factors, and its rank-r truncated SVD through QR of each factor and an
SVD of the small core (never forming d_out x d_in)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from strategies.shared.validation import (
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
