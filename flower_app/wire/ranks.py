"""Adapter state at a client's rank: the rank a state carries, and the state cut to a rank.

A shared state is ``{key: array}`` (flower_app/wire/records.py); its adapter matrices
carry the rank r in one axis: FLoRG's ``<layer>.A`` and LoRA's ``<layer>.lora_A`` in
their rows (r x k, r x d_in), LoRA's ``<layer>.lora_B`` in its columns (d_out x r),
LoRA-SB's ``<layer>.R`` in both (r x r; its fixed B and A never travel as state).  The
head has no rank.  A client of rank r_n keeps the top r_n rows of every A and the first
r_n columns of every B of a state of a larger rank (``truncate_to_rank``): for a rule that
pads to the largest rank that is the distribution rule itself, for a truncated SVD the
SVD at r_n (its factors are ordered by singular value), for FLoRG's seeded initial A the
factor a rank-r_n node would have drawn (the same generator, row-major).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

__all__ = ["adapter_k", "rank_of", "shapes_at_rank", "truncate_to_rank"]

ROW_RANKED = (".A", ".lora_A")  # rank = rows
COLUMN_RANKED = (".lora_B",)  # rank = columns
SQUARE_RANKED = (".R",)  # rank = rows = columns


def rank_of(state: Mapping[str, np.ndarray]) -> int:
    """The rank of a state: the largest rank axis of its adapter matrices (an app's layers
    share one; 0: no adapter)."""
    ranks = [0]
    for key, value in state.items():
        if key.endswith(ROW_RANKED):
            ranks.append(int(np.shape(value)[0]))
        elif key.endswith(COLUMN_RANKED):
            ranks.append(int(np.shape(value)[1]))
        elif key.endswith(SQUARE_RANKED):
            ranks.append(int(np.shape(value)[0]))
    return max(ranks)


def _at_rank(key: str, shape: tuple[int, ...], r: int) -> tuple[int, ...]:
    if key.endswith(ROW_RANKED):
        return (r, *shape[1:])
    if key.endswith(COLUMN_RANKED):
        return (shape[0], r, *shape[2:])
    if key.endswith(SQUARE_RANKED):
        return (r, r)
    return shape


def shapes_at_rank(state: Mapping[str, np.ndarray], r: int) -> dict[str, tuple[int, ...]]:
    """Every key's shape when the adapter has rank ``r`` (the head's is unchanged)."""
    return {key: _at_rank(key, tuple(np.shape(v)), r) for key, v in state.items()}


def adapter_k(state: Mapping[str, np.ndarray]) -> int:
    """The largest rank every adapted layer can take: min over layers of k = min(d_in,
    d_out) (FLoRG's A is r x k; LoRA's k is min(rows of B, columns of A))."""
    ks = []
    for key, value in state.items():
        if key.endswith(".A"):
            ks.append(int(np.shape(value)[1]))
        elif key.endswith(".lora_A"):
            b = state.get(key[: -len(".lora_A")] + ".lora_B")
            d_out = int(np.shape(b)[0]) if b is not None else int(np.shape(value)[1])
            ks.append(min(int(np.shape(value)[1]), d_out))
        elif key.endswith(".lora_B"):
            ks.append(int(np.shape(value)[0]))
        elif key.endswith(SQUARE_RANKED):  # k is not in R (r x r): r is what it proves
            ks.append(int(np.shape(value)[1]))
    return min(ks) if ks else 0


def truncate_to_rank(state: Mapping[str, np.ndarray], r: int) -> dict[str, np.ndarray]:
    """The top ``r`` rows of every A and the first ``r`` columns of every B (arrays of
    rank <= r and the head are returned as they are)."""
    out: dict[str, np.ndarray] = {}
    for key, value in state.items():
        if key.endswith(ROW_RANKED) and value.shape[0] > r:
            out[key] = value[:r]
        elif key.endswith(COLUMN_RANKED) and value.shape[1] > r:
            out[key] = value[:, :r]
        elif key.endswith(SQUARE_RANKED) and value.shape[0] > r:
            out[key] = value[:r, :r]
        else:
            out[key] = value
    return out
