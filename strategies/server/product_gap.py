"""``product-gap``: a LoRA rule's new B A against the clients' weighted mean product.

Per layer, ``product_rel_gap`` = ||Σ wₙ Bₙ Aₙ − B_new A_new||_F / ||Σ wₙ Bₙ Aₙ||_F (a
factor-wise average's aggregation bias, also after rotating the replies, whose products
rotation leaves alone; a truncated SVD's error), from the factors alone: no d_out x d_in
product is formed. A reply without one factor of a layer (a method training one part a
round, ``Method.trained_parts``) held it at the global state's, which stands in for it.
A layer whose mean product is 0 counts as gap 0 when B_new A_new is 0 too and is left out
otherwise (no relative size). The row keys: the mean and the max over layers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from flower_app.wire.records import split_state
from strategies.shared.per_layer import LORA_PARTS

GAP_KEY, GAP_MAX_KEY = "product_rel_gap", "product_rel_gap_max"


def product_gap_norms(
    Bs: Sequence[np.ndarray],
    As: Sequence[np.ndarray],
    weights: Sequence[float] | np.ndarray,
    B_new: np.ndarray,
    A_new: np.ndarray,
) -> tuple[float, float]:
    """(||Σ wₙ Bₙ Aₙ − B_new A_new||_F, ||Σ wₙ Bₙ Aₙ||_F) in float64, each client's rank its own.

    With U = [w₁B₁, ..., w_N B_N, B_new] and V = [A₁; ...; A_N; −A_new] the difference is
    U V, and ||U V||_F² = tr((UᵀU)(V Vᵀ)), the sum of the two symmetric Grams' entrywise
    product: O((d_out + d_in) K²) for K = Σ rₙ + r_new columns instead of O(d_out d_in K).
    The mean's norm is the same over the first N blocks. Rounding can make a square a tiny
    negative: clamped at 0. Its resolution is about 1e-8 of the mean product's norm (a
    difference of squares), ample for a diagnostic."""
    if not len(Bs) == len(As) == len(weights):
        raise ValueError(f"{len(Bs)} B, {len(As)} A and {len(weights)} weights")
    w = np.asarray(weights, np.float64)
    U = np.hstack(
        [wn * np.asarray(B, np.float64) for wn, B in zip(w, Bs, strict=True)]
        + [np.asarray(B_new, np.float64)]
    )
    V = np.vstack([np.asarray(A, np.float64) for A in As] + [-np.asarray(A_new, np.float64)])
    if U.shape[1] != V.shape[0]:
        raise ValueError(f"the B's {U.shape[1]} columns do not match the A's {V.shape[0]} rows")
    G, H = U.T @ U, V @ V.T
    m = U.shape[1] - np.shape(B_new)[1]  # the clients' columns
    gap_sq = float(np.sum(G * H))
    mean_sq = float(np.sum(G[:m, :m] * H[:m, :m]))
    return float(np.sqrt(max(gap_sq, 0.0))), float(np.sqrt(max(mean_sq, 0.0)))


def layer_gaps(
    sent: Mapping[str, np.ndarray],
    payloads: list[dict[str, np.ndarray]],
    weights: np.ndarray,
    new_state: Mapping[str, np.ndarray],
) -> dict[str, float]:
    """Each measured layer's relative gap: the layers of ``new_state`` with both LoRA
    factors, a reply's missing factor taken from ``sent`` (the global state the round
    started from), a layer with a zero mean product handled as the module says."""
    b, a = LORA_PARTS
    gaps: dict[str, float] = {}
    for layer, parts in split_state(new_state)[0].items():
        kb, ka = f"{layer}.{b}", f"{layer}.{a}"
        if b not in parts or a not in parts:
            continue
        Bs = [p.get(kb, sent.get(kb)) for p in payloads]
        As = [p.get(ka, sent.get(ka)) for p in payloads]
        if any(x is None for x in (*Bs, *As)):
            continue  # a factor neither the replies nor the global state hold
        gap, mean = product_gap_norms(Bs, As, weights, parts[b], parts[a])
        if mean > 0:
            gaps[layer] = gap / mean
        elif gap == 0:
            gaps[layer] = 0.0
    return gaps


def gap_metrics(
    strategy: Any,
    payloads: list[dict[str, np.ndarray]],
    weights: np.ndarray,
    new_state: Mapping[str, np.ndarray],
) -> dict[str, float]:
    """The round's ``product_rel_gap`` (mean over layers) and ``product_rel_gap_max`` when
    ``strategy.product_gap`` is on and a layer was measured, else {}. Called after the rule
    ran over ``payloads`` (the replies it took) and before ``strategy.global_state`` becomes
    ``new_state``, so the global state is still the one the clients were sent."""
    if not getattr(strategy, "product_gap", False):
        return {}
    gaps = layer_gaps(strategy.global_state, payloads, weights, new_state)
    if not gaps:
        return {}
    values = list(gaps.values())
    return {GAP_KEY: float(np.mean(values)), GAP_MAX_KEY: float(np.max(values))}
