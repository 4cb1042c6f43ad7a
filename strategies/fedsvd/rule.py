"""FedSVD (Lee et al., NeurIPS 2025): A fixed during local training, only B trained and
averaged; the server then re-factorises the product into an orthonormal A
(``aggregate_fedsvd``, ``refactorise``).

With A the same on every client the mean is exact: sum_n w_n B_n A = B_bar A. The server
writes B_bar A = U S V^T (its rank-r thin SVD) and sends A' = V_r^T (orthonormal rows) and
B' = U_r S_r, so B' A' = B_bar A: the global model is unchanged, and the next round trains
B against an orthonormal A fitted to the update so far. The factors come from QR of the two
thin factors and the SVD of the r x r core, O((d_out + d_in) r^2), where the authors'
``reinit_lora`` (seanie12/fed-svd, misc/utils.py) takes the SVD of the dense product; signs
are fixed (each row of A' has its largest-magnitude entry positive), which changes neither
the product nor the next round's training: docs/architecture.md, "The math".
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from strategies.shared.averaging import weighted_average


def refactorise(B: np.ndarray, A: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(B', A') with B' A' = B A, A' (r x d_in) with orthonormal rows, B' = U_r S_r."""
    B = np.asarray(B, np.float64)
    A = np.asarray(A, np.float64)
    r = A.shape[0]
    q_b, r_b = np.linalg.qr(B)  # B = Q_B R_B, Q_B d_out x r
    q_a, r_a = np.linalg.qr(A.T)  # A^T = Q_A R_A, Q_A d_in x r
    u, s, vt = np.linalg.svd(r_b @ r_a.T)  # the r x r core of B A = Q_B core Q_A^T
    new_A = vt[:r] @ q_a.T
    new_B = (q_b @ u[:, :r]) * s[:r]
    # deterministic signs: the largest-magnitude entry of each row of A' is positive
    signs = np.sign(new_A[np.arange(r), np.argmax(np.abs(new_A), axis=1)])
    signs[signs == 0] = 1.0
    return new_B * signs, new_A * signs[:, None]


def aggregate_fedsvd(
    client_Bs: Sequence[np.ndarray],
    A: np.ndarray,
    weights: Sequence[float] | np.ndarray | None,
) -> tuple[np.ndarray, np.ndarray]:
    """(B', A'): the mean sum_n w_n B_n (d_out x r) against the shared A (r x d_in),
    re-factorised (``refactorise``)."""
    return refactorise(weighted_average(client_Bs, weights, "B"), A)
