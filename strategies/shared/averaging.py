"""Weighted averaging of client tensors (FedAvg), the building block of every rule."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from strategies.shared.validation import check_client_matrices, normalize_weights


def weighted_average(
    matrices: Sequence[np.ndarray], weights: Sequence[float] | np.ndarray | None, name: str
) -> np.ndarray:
    """sum_n w_n X_n in float64, after shape/finiteness checks; weights are normalised."""
    arrays = [np.asarray(m) for m in matrices]
    if arrays and arrays[0].ndim == 1:  # biases and other vectors: check them as 1 x d
        arrays = [a.reshape(1, -1) if a.ndim == 1 else a for a in arrays]
        out = weighted_average(arrays, weights, name)
        return out.reshape(-1)
    mats = check_client_matrices(arrays, None, name)
    w = normalize_weights(weights, len(mats))
    return np.einsum("n,nij->ij", w, np.stack(mats))
