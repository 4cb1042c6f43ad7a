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

from strategies.shared.low_rank import stacked_lora_factors, truncated_product_svd


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
