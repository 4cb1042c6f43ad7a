"""The private FLoRG server step (dp=central) in torch, float64, batched over layers of equal
k: ``private_florg_layers_torch``, what ``strategies.florg.dp.private_florg_layers``
computes (same clipping check, Delta and noise, drawn on the host by
``strategies.florg.dp.layer_noise`` in the same layer order; the tests hold the two to
1e-10). Per group of layers with equal (r, k), on the server's device:

    Q^  = (M^T M + E) / m    (B x k x k; centred: + (1 - N/m) P^T P)
    eigh(Q^) -> top r, drop lambda <= k eps lambda_1, A~ = Lambda^{1/2} P,  A_new = S A~

The k x k eigendecomposition (cuSOLVER on CUDA) has no thin path: the noise E is full rank
(docs/privacy.md, section 4.3). Staging memory: B k^2 float64 per group, chunked below
``MAX_GRAM_BYTES``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from strategies.florg.device import F64, STAGING, resolve_server_device, stack_layers
from strategies.florg.dp import _florg_inputs, layer_noise, private_step_rank
from strategies.florg.rule_torch import _canonical_signs, _polar
from strategies.server.central_dp import EPS64

# Layers per batched call are capped so that the noised Gram matrices stay below this.
MAX_GRAM_BYTES = 1 << 30


def _symmetric_product(X: torch.Tensor) -> torch.Tensor:
    g = X.mT @ X
    return (g + g.mT) / 2


def florg_private_steps_torch(
    noised_Qs: torch.Tensor,
    prev_As: torch.Tensor,
    r: int | None = None,
    *,
    procrustes: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``strategies.florg.dp.florg_private_step`` for a batch: noised_Qs (B x k x k, symmetric),
    prev_As (B x r_prev x k), float64 on one device.  Returns (A_new (B x r_prev x k),
    r' per layer, the eigenvalues of each Q^ in descending order)."""
    B, k, _ = noised_Qs.shape
    r = private_step_rank(r, prev_As.shape[1])
    lam, P = torch.linalg.eigh((noised_Qs + noised_Qs.mT) / 2)
    lam, P = lam.flip(-1), P.flip(-1)
    lam1 = lam[:, :1]
    keep = (lam[:, :r] > k * EPS64 * lam1) & (lam1 > 0)  # a prefix: lam is descending
    rows = lam[:, :r].clamp_min(0.0).sqrt()[:, :, None] * P[:, :, :r].mT
    rows = _canonical_signs(rows * keep[:, :, None].to(F64))
    if procrustes:
        # Columns of S that meet the zero rows of A~ (dropped eigenpairs) do not matter.
        new = _polar(prev_As @ rows.mT) @ rows
    else:
        new = torch.zeros_like(prev_As)
        new[:, :r] = rows
    return new, keep.sum(dim=1), lam


def private_florg_layers_torch(
    clipped_client_As: Mapping[str, Sequence[Any]],
    prev_As: Mapping[str, Any],
    clipping_norm: float,
    noise_multiplier: float,
    rng: np.random.Generator,
    *,
    centred: bool = True,
    num_sampled: float | None = None,
    procrustes: bool = True,
    device: str | torch.device = "auto",
    max_gram_bytes: int = MAX_GRAM_BYTES,
) -> tuple[dict[str, np.ndarray], dict[str, dict[str, float | int]]]:
    """``strategies.florg.dp.private_florg_layers`` batched in torch on ``device`` ('auto': CUDA
    when torch sees one).  Same arguments, same results (new A as float64 numpy, the same
    info keys) up to rounding."""
    mats, prevs, n, m, std = _florg_inputs(
        clipped_client_As, prev_As, clipping_norm, noise_multiplier, centred, num_sampled
    )
    dev = resolve_server_device(device)
    noise = layer_noise(prevs, std, rng)  # the reference's draws, in its order
    groups: dict[tuple[int, int], list[str]] = {}
    for name, prev in prevs.items():
        groups.setdefault(prev.shape, []).append(name)
    new_As: dict[str, np.ndarray] = {}
    infos: dict[str, dict[str, float | int]] = {}
    with torch.no_grad(), STAGING.lock:
        for (r, k), names in groups.items():
            chunk = max(1, int(max_gram_bytes) // (3 * k * k * 8))
            for start in range(0, len(names), chunk):
                part = names[start : start + chunk]
                T = stack_layers(part, mats, prevs, dev)  # [A_1; ...; A_N; A_prev]
                M, prev = T[:, : n * r], T[:, n * r :]
                E = torch.from_numpy(np.stack([noise[name] for name in part])).to(dev)
                gram = _symmetric_product(M)  # as strategies.florg.dp.noised_mean_gram
                if centred:
                    base = _symmetric_product(prev)
                    Q = (gram - n * base + E) / m + base
                else:
                    Q = (gram + E) / m
                new, rank, lam = florg_private_steps_torch(Q, prev, procrustes=procrustes)
                lam_pad = torch.cat([lam, torch.zeros_like(lam[:, :1])], dim=1)
                gap = lam_pad[:, r - 1] - lam_pad[:, r]
                negative = (lam < 0).sum(dim=1)
                drift = torch.linalg.vector_norm(new - prev, dim=(1, 2))
                new_np = new.cpu().numpy()
                table = torch.stack([rank.to(F64), gap, negative.to(F64), drift], 1).cpu().numpy()
                for i, name in enumerate(part):
                    new_As[name] = new_np[i].copy()
                    infos[name] = {
                        "rank": int(table[i, 0]),
                        "dropped": r - int(table[i, 0]),
                        "eigengap": float(table[i, 1]),
                        "negative_eigenvalues": int(table[i, 2]),
                        "drift": float(table[i, 3]),
                        "noise_std": std / m,
                    }
    return {name: new_As[name] for name in prevs}, {name: infos[name] for name in prevs}
