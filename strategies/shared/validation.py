"""Input checks shared by every aggregation rule.

A client update that is malformed (wrong shape, NaN/Inf) or a weight vector that
is meaningless (negative, all zero) raises ``AggregationInputError`` with a
message that names the offending client and tensor, before anything is computed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np


class AggregationInputError(ValueError):
    """A client update or weight vector that must not be aggregated."""


def as_float64_matrix(x: np.ndarray, name: str) -> np.ndarray:
    """Return ``x`` as a finite 2-D float64 array, or raise naming ``name``."""
    arr = np.asarray(x)
    if arr.ndim != 2:
        raise AggregationInputError(f"{name}: expected a 2-D matrix, got shape {arr.shape}")
    if not np.issubdtype(arr.dtype, np.floating) and not np.issubdtype(arr.dtype, np.integer):
        raise AggregationInputError(f"{name}: expected a real float array, got dtype {arr.dtype}")
    arr = arr.astype(np.float64, copy=False)
    if not np.all(np.isfinite(arr)):
        bad = int(np.size(arr) - np.count_nonzero(np.isfinite(arr)))
        raise AggregationInputError(f"{name}: contains {bad} NaN/Inf entries")
    return arr


def check_client_matrices(
    matrices: Sequence[np.ndarray], expected_shape: tuple[int, int] | None, name: str
) -> list[np.ndarray]:
    """Validate one matrix per client; all must share ``expected_shape`` (or the first's)."""
    if len(matrices) == 0:
        raise AggregationInputError(f"{name}: no client matrices to aggregate")
    out = [as_float64_matrix(m, f"{name}[client {i}]") for i, m in enumerate(matrices)]
    shape = expected_shape if expected_shape is not None else out[0].shape
    for i, m in enumerate(out):
        if m.shape != tuple(shape):
            raise AggregationInputError(
                f"{name}[client {i}]: shape {m.shape} does not match the expected {tuple(shape)}"
            )
    return out


def check_layer_sets(
    client_layers: Mapping[str, Sequence[Any]],
    prev_layers: Mapping[str, Any],
    names: tuple[str, str] = ("client_As", "prev_As"),
) -> int:
    """The clients' per-layer updates and the previous state name the same layers (at least
    one), and every layer has the same number of clients; returns that number."""
    missing = sorted(set(prev_layers) - set(client_layers))
    extra = sorted(set(client_layers) - set(prev_layers))
    if missing or extra:
        raise AggregationInputError(
            f"{names[0]} and {names[1]} name different layers: "
            f"missing {missing[:3]}, extra {extra[:3]}"
        )
    if not prev_layers:
        raise AggregationInputError("no layers to aggregate")
    counts = {len(v) for v in client_layers.values()}
    if len(counts) != 1:
        raise AggregationInputError(f"layers have different numbers of clients: {sorted(counts)}")
    return counts.pop()


def check_mixed_rank_pairs(
    client_Bs: Sequence[np.ndarray], client_As: Sequence[np.ndarray], method: str
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Validate one LoRA pair (B_n: d_out x r_n, A_n: r_n x d_in) per client, r_n free:
    at least one client, as many B as A, B_n's columns = A_n's rows, one d_out and one d_in."""
    if len(client_Bs) == 0 or len(client_Bs) != len(client_As):
        raise AggregationInputError(
            f"{method}: got {len(client_Bs)} B matrices and {len(client_As)} A matrices"
        )
    Bs = [as_float64_matrix(b, f"B[client {i}]") for i, b in enumerate(client_Bs)]
    As = [as_float64_matrix(a, f"A[client {i}]") for i, a in enumerate(client_As)]
    d_out, d_in = Bs[0].shape[0], As[0].shape[1]
    for i, (b, a) in enumerate(zip(Bs, As, strict=True)):
        if b.shape[1] != a.shape[0]:
            raise AggregationInputError(
                f"client {i}: B is {b.shape} but A is {a.shape}: B's columns must equal A's rows"
            )
        if b.shape[0] != d_out or a.shape[1] != d_in:
            raise AggregationInputError(
                f"client {i}: B {b.shape}, A {a.shape} do not match client 0's d_out={d_out}, "
                f"d_in={d_in}"
            )
    return Bs, As


def normalize_weights(weights: Sequence[float] | np.ndarray | None, num_clients: int) -> np.ndarray:
    """Non-negative client weights normalised to sum to 1 (``None`` means uniform 1/N)."""
    if num_clients < 1:
        raise AggregationInputError("weights: there must be at least one client")
    if weights is None:
        return np.full(num_clients, 1.0 / num_clients)
    w = np.asarray(weights, dtype=np.float64).reshape(-1)
    if w.shape[0] != num_clients:
        raise AggregationInputError(
            f"weights: got {w.shape[0]} weights for {num_clients} client matrices"
        )
    if not np.all(np.isfinite(w)):
        raise AggregationInputError("weights: contain NaN/Inf")
    if np.any(w < 0):
        raise AggregationInputError(f"weights: must be non-negative, got {w.tolist()}")
    total = w.sum()
    if total <= 0:
        raise AggregationInputError("weights: all zero; at least one client must have weight > 0")
    return w / total
