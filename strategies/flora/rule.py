"""FLoRA (Wang et al., NeurIPS 2024): stack the clients' LoRA factors, so the round's update is
the exact weighted mean of their products, merge it into W0, and start a fresh LoRA.

    ΔW_t = sum_n w_n B_n A_n = [B_1 ... B_N] [w_1 A_1; ...; w_N A_N]     (d_out x d_in)

The stacked factors have sum_n r_n columns / rows, so clients of different rank stack as
they are. The authors' code (ATP-1010/FederatedLLM fed_utils/model_aggregation.py with
``stacking``; seanie12/fed-svd fedmm/fedavg/server.py ``_agg_flora``) weights A_n by w_n and
leaves B_n unweighted; here each side carries sqrt(w_n), the same product with both stacks
on the same scale (they travel as float32). The merged update keeps the clients' scaling
s = alpha / r: W0 <- W0 + s ΔW_t, as ``_agg_flora`` writes it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from strategies.shared.folds import Residual
from strategies.shared.validation import AggregationInputError, normalize_weights


def stack_flora(
    client_Bs: Sequence[np.ndarray],
    client_As: Sequence[np.ndarray],
    weights: Sequence[float] | np.ndarray | None,
) -> Residual:
    """The round's update as exact factors P Q = sum_n w_n B_n A_n: P = [sqrt(w_n) B_n]
    (d_out x sum r_n), Q = [sqrt(w_n) A_n] (sum r_n x d_in); ranks may differ."""
    if len(client_Bs) != len(client_As) or not client_Bs:
        raise AggregationInputError(
            f"need one A per B and at least one client; got {len(client_Bs)} B, {len(client_As)} A"
        )
    Bs = [np.asarray(b, np.float64) for b in client_Bs]
    As = [np.asarray(a, np.float64) for a in client_As]
    d_out, d_in = Bs[0].shape[0], As[0].shape[1]
    for n, (b, a) in enumerate(zip(Bs, As, strict=True)):
        if b.ndim != 2 or a.ndim != 2 or b.shape[0] != d_out or a.shape[1] != d_in:
            raise AggregationInputError(
                f"client {n}: B {b.shape} and A {a.shape} do not match d_out={d_out}, d_in={d_in}"
            )
        if b.shape[1] != a.shape[0]:
            raise AggregationInputError(f"client {n}: B {b.shape} but A {a.shape}: ranks differ")
        if not (np.all(np.isfinite(b)) and np.all(np.isfinite(a))):
            raise AggregationInputError(f"client {n}: NaN or Inf")
    root = np.sqrt(normalize_weights(weights, len(Bs)))
    P = np.concatenate([s * b for s, b in zip(root, Bs, strict=True)], axis=1)
    Q = np.concatenate([s * a for s, a in zip(root, As, strict=True)], axis=0)
    return Residual(P=P, Q=Q)


def factor_mean_product(mean_product: np.ndarray, max_rank: int) -> Residual:
    """Factors P Q of the round's update M = Σ wₙBₙAₙ held whole (a secure round's mean of the
    clients' products): its SVD at ``max_rank`` (Σ rₙ, the stack's width, which bounds
    rank(M)), singular values split evenly, P = U S^½ and Q = S^½ Vᵀ. Exact for the products'
    mean; the secure sum's quantisation, full rank, is cut beyond ``max_rank``. At most as
    wide as the stacked factors: the fold's traffic is the plain round's or less."""
    U, S, Vt = np.linalg.svd(np.asarray(mean_product, np.float64), full_matrices=False)
    k = min(max_rank, S.size)
    root = np.sqrt(S[:k])
    return Residual(P=U[:, :k] * root, Q=root[:, None] * Vt[:k])


def fresh_lora(rng: np.random.Generator, d_out: int, d_in: int, r: int):
    """The next round's LoRA: B = 0 and A ~ U(-1/sqrt(d_in), 1/sqrt(d_in)) (the bound of
    PEFT's kaiming-uniform initialisation, which ``_agg_flora`` re-draws)."""
    bound = 1.0 / np.sqrt(d_in)
    return np.zeros((d_out, r)), rng.uniform(-bound, bound, (r, d_in))
