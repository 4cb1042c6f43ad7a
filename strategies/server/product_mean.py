"""The product-mean mechanism of central DP, for methods whose rule is linear in the
products B_n A_n (it averages them and re-factors by truncated SVD): each client's unit is
its product update B_n A_n - B_sent A_sent (dense d_out x d_in per layer) with its head
update, clipped jointly to C; ``noised_mean`` of those plus B_sent A_sent is the noised
mean product, re-factored to rank r (post-processing).  The noise is dense, hence the
product is formed densely, unlike the noiseless QR path of the rules."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from flower_app.wire.records import split_state
from strategies.server.central_dp import CentralDP, noise_std_mean, noised_mean
from strategies.shared.validation import as_float64_matrix


def product_update(B: Any, A: Any, B_sent: Any, A_sent: Any) -> np.ndarray:
    """The clipped unit for one layer: B_n A_n - B_sent A_sent (d_out x d_in, dense).

    Clip the dict of every layer's product update and the head update jointly with
    ``clip_update``, release with ``noised_mean``, add B_sent A_sent back, then
    ``refactor_noised_product``.
    """
    return as_float64_matrix(B, "B") @ as_float64_matrix(A, "A") - (
        as_float64_matrix(B_sent, "B_sent") @ as_float64_matrix(A_sent, "A_sent")
    )


def refactor_noised_product(
    noised_product: Any, r: int
) -> tuple[np.ndarray, np.ndarray, dict[str, float | int]]:
    """Rank-r (B, A) from the noised mean product (post-processing): the truncated SVD
    U S V^T with B = U_r S_r^{1/2}, A = S_r^{1/2} V_r^T, the split of
    ``strategies.shared.low_rank.truncated_product_svd``.  With z = 0 and no clipping active it
    equals ``aggregate_federa``.  info: ``trunc_rel_error`` as there."""
    P = as_float64_matrix(noised_product, "noised_product")
    if not 1 <= r <= min(P.shape):
        raise ValueError(f"rank r={r} must be between 1 and {min(P.shape)}")
    U, s, Vt = np.linalg.svd(P, full_matrices=False)
    root = np.sqrt(s[:r])
    total = float(np.sqrt(np.sum(s**2)))
    info: dict[str, float | int] = {
        "trunc_rel_error": float(np.sqrt(np.sum(s[r:] ** 2)) / total) if total > 0 else 0.0
    }
    return U[:, :r] * root, root[:, None] * Vt[:r], info


def product_mean_mechanism(
    dp: CentralDP,
    sent: Mapping[str, np.ndarray],
    payloads: list[dict[str, np.ndarray]],
    num_sampled: float,
) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """One private round (docs/privacy.md section 3): each client's product updates
    (``product_update`` per layer) and head update, clipped jointly to C by ``dp``;
    ``noised_mean`` of those plus B_sent A_sent is the noised mean product, re-factored to
    rank r by ``refactor_noised_product``; m = ``num_sampled`` (the count sampled, or q N
    under Poisson sampling: ``central_dp.public_divisor``). One client's dense updates are in
    memory at a time. Returns the whole new state and the round's metrics."""
    layers, head_state = split_state(sent)
    head = list(head_state)

    def unit(p):
        update = {
            ("product", layer): product_update(
                p[f"{layer}.lora_B"], p[f"{layer}.lora_A"],
                sent[f"{layer}.lora_B"], sent[f"{layer}.lora_A"],
            )
            for layer in layers
        }  # fmt: skip
        update.update({("head", k): np.asarray(p[k], np.float64) - sent[k] for k in head})
        return dp.clip(update)

    mean = noised_mean(
        (unit(p) for p in payloads),
        dp.clipping_norm,
        dp.noise_multiplier,
        dp.rng,
        num_sampled=num_sampled,
    )
    new: dict[str, np.ndarray] = {}
    errors = []
    for layer in layers:
        kb, ka = f"{layer}.lora_B", f"{layer}.lora_A"
        product = sent[kb] @ sent[ka] + mean[("product", layer)]
        new[kb], new[ka], info = refactor_noised_product(product, sent[kb].shape[1])
        errors.append(info["trunc_rel_error"])
    new.update({k: sent[k] + mean[("head", k)] for k in head})
    return new, {
        "trunc_rel_error": float(np.mean(errors)),
        "dp-noise-std": noise_std_mean(dp.clipping_norm, dp.noise_multiplier, num_sampled),
    }
