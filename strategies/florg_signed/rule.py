"""florg-signed's server step for one layer (``aggregate_florg_signed``): two FLoRG steps, one
per sign block of A.

The adapter is ``W = W0 + s L AᵀDA R`` with D = diag(+1 for the first p = ⌈r/2⌉ rows of A,
-1 for the other r - p), A = [A₊; A₋], so AᵀDA = A₊ᵀA₊ - A₋ᵀA₋ can be any symmetric
k x k matrix of rank <= r. The clients' mean core Σ wₙ AₙᵀDAₙ = Q₊ - Q₋ is linear in the two
Gram averages, so each block is aggregated exactly as FLoRG aggregates A (eq. Gram_agg,
Gram_decompose, Theorem 1; ``strategies.florg.rule``), anchored to the previous A₊ / A₋.
The new core is exactly Q₊ - Q₋ when each block's stacked rank fits its rows (r'₊ <= p,
r'₋ <= r - p), with FLoRG's r' > r caveat otherwise (``rank-mismatch``). Traffic: FLoRG's,
one r x k matrix per layer each way. ``row_signs`` and ``sign_blocks`` give D and the blocks,
``signed_blocks`` names them ('<layer>.A#<i>') for the batched, private and secure steps.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from strategies.florg.rule import aggregate_florg


def positive_rows(r: int) -> int:
    """p = ⌈r/2⌉: how many rows of A carry the sign +1 (the rest carry -1)."""
    return (r + 1) // 2


def row_signs(r: int) -> tuple[float, ...]:
    """The diagonal of D: +1 for the first ⌈r/2⌉ rows, -1 for the rest."""
    p = positive_rows(r)
    return tuple([1.0] * p + [-1.0] * (r - p))


def sign_blocks(r: int) -> list[slice]:
    """The row slices of A aggregated separately: [+ block, - block] (one block if r = 1)."""
    p = positive_rows(r)
    return [slice(0, p)] + ([slice(p, r)] if r > p else [])


def signed_blocks(factors: Mapping[str, np.ndarray]) -> dict[str, tuple[str, slice]]:
    """Every sign block of every '<layer>.A' of ``factors``: '<layer>.A#<i>' -> (its key, the
    rows of block i), + block first (the units of FLoRG's Gram step here)."""
    return {
        f"{key}#{i}": (key, rows)
        for key, a in factors.items()
        if key.endswith(".A")
        for i, rows in enumerate(sign_blocks(np.shape(a)[0]))
    }


def aggregate_florg_signed(
    client_As: Sequence[np.ndarray],
    weights: Sequence[float] | np.ndarray | None,
    prev_A: np.ndarray,
    procrustes: bool = True,
    rtol: float | None = None,
    rank_mismatch: str = "procrustes",
) -> tuple[np.ndarray, list[dict[str, float | int]]]:
    """The numpy reference: each sign block through ``aggregate_florg``, stacked back.

    Returns the new A (r x k, float64) and each block's diagnostics (+ block first)."""
    prev = np.asarray(prev_A, dtype=np.float64)
    blocks, infos = [], []
    for rows in sign_blocks(prev.shape[0]):
        new, info = aggregate_florg(
            [np.asarray(a)[rows] for a in client_As], weights, prev[rows],
            procrustes=procrustes, rtol=rtol, rank_mismatch=rank_mismatch,
        )  # fmt: skip
        blocks.append(new)
        infos.append(info)
    return np.concatenate(blocks), infos
