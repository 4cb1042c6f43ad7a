"""FLoRG under secure aggregation: each client adds its Gram AₙᵀAₙ, the server decomposes the sum.

FLoRG's state is exactly the mean Gram Q = Σ wₙ AₙᵀAₙ (k × k, eq. Gram_agg), so a secure sum
of each client's Gram (its upper triangle, k(k+1)/2 values a layer) gives the server Q and
nothing else; the server step is then the one it runs on Q when N r > k (eigendecomposition,
top r, Procrustes: ``rule_torch._gram_step``), batched per (r, k) on the server's device.
The unit is a block of A's rows (``Blocks``, as ``FLoRGStrategy.blocks()`` names them):
FLoRG's is each layer's whole A; a method that aggregates row blocks apart sums one Gram each.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from strategies.florg.device import F64
from strategies.florg.rule import default_rtol
from strategies.florg.rule_torch import _gram_step, _infos, resolve_server_device

# The Gram step's units: block name -> (the '<layer>.A' key, its rows of A).
Blocks = Mapping[str, tuple[str, slice]]
GRAM_SUFFIX = "-gram"  # block '<layer>.A' -> '<layer>.A-gram': the upper triangle of its AᵀA


def _is_factor(key: str) -> bool:
    return key.endswith(".A")


def gram_key(block: str) -> str:
    """The contribution key of a block's Gram: '<layer>.A' -> '<layer>.A-gram',
    '<layer>.A#1' -> '<layer>.A#1-gram'."""
    return block + GRAM_SUFFIX


def whole_factors(arrays: Mapping[str, object]) -> dict[str, tuple[str, slice]]:
    """FLoRG's blocks: each layer's whole A, named by its key."""
    return {key: (key, slice(None)) for key in arrays if _is_factor(key)}


def join_blocks(new: Mapping[str, np.ndarray], blocks: Blocks) -> dict[str, np.ndarray]:
    """Each layer's A from its blocks' new rows, stacked in the blocks' order."""
    keys = dict.fromkeys(key for key, _ in blocks.values())
    return {
        key: np.concatenate([new[name] for name, (k, _) in blocks.items() if k == key])
        for key in keys
    }


def gram_contribution(
    arrays: Mapping[str, np.ndarray], blocks: Blocks | None = None
) -> dict[str, np.ndarray]:
    """A client's secure-sum contribution: the upper triangle, row by row (float64), of
    A_bᵀA_b for each block b of A's rows (``blocks``; default: each layer's whole A), under
    ``gram_key(b)``; the head's arrays as they are."""
    blocks = whole_factors(arrays) if blocks is None else blocks
    out: dict[str, np.ndarray] = {}
    for name, (key, rows) in blocks.items():
        a = np.asarray(arrays[key], np.float64)[rows]
        upper = np.triu_indices(a.shape[1])
        out[gram_key(name)] = (a.T @ a)[upper]
    for key, value in arrays.items():
        if not _is_factor(key):
            out[key] = np.asarray(value, np.float64)
    return out


def gram_shapes(
    uplink: Mapping[str, np.ndarray], blocks: Blocks | None = None
) -> dict[str, tuple[int, ...]]:
    """The shapes of ``gram_contribution`` for arrays shaped as ``uplink``."""
    blocks = whole_factors(uplink) if blocks is None else blocks
    shapes: dict[str, tuple[int, ...]] = {}
    for name, (key, _) in blocks.items():
        k = np.shape(uplink[key])[1]
        shapes[gram_key(name)] = (k * (k + 1) // 2,)
    for key, value in uplink.items():
        if not _is_factor(key):
            shapes[key] = tuple(np.shape(value))
    return shapes


def unpack_gram(upper: np.ndarray, k: int) -> np.ndarray:
    """The symmetric k × k matrix whose upper triangle (row by row) is ``upper``."""
    rows, cols = np.triu_indices(k)
    full = np.zeros((k, k), np.float64)
    full[rows, cols] = upper
    full[cols, rows] = upper
    return full


def _top_eigenvalue(Q: torch.Tensor, iterations: int = 50) -> torch.Tensor:
    """λ₁ of each symmetric positive semi-definite Q (B × k × k) by power iteration, to a
    few digits (it only scales the rounding floor); 0 where Q is 0."""
    v = torch.ones(Q.shape[0], Q.shape[1], 1, dtype=Q.dtype, device=Q.device)
    for _ in range(iterations):
        w = Q @ v
        v = w / torch.linalg.vector_norm(w, dim=1, keepdim=True).clamp_min(1e-300)
    return (v.mT @ Q @ v)[:, 0, 0].clamp_min(0.0)


def aggregate_from_grams(
    mean: Mapping[str, np.ndarray],
    prev_As: Mapping[str, np.ndarray],
    num_clients: int,
    *,
    procrustes: bool,
    rank_mismatch: str,
    device: str = "auto",
    rounding_std: float = 0.0,
) -> tuple[dict[str, np.ndarray], dict[str, dict[str, float | int]]]:
    """The FLoRG step from the mean Grams (``mean``: ``gram_key(b)`` upper triangles) for
    every block b of ``prev_As`` (b -> its previous rows, r_b × k; FLoRG's blocks are each
    layer's '<layer>.A'): the new rows of each block and the per-block diagnostics of
    ``aggregate_florg_layers``. An eigenvalue counts as zero below
    ``default_rtol`` (as for N stacked replies) or below the rounding's floor: with each
    entry of the mean Gram off by independent rounding errors of std ``rounding_std``, the
    error matrix's spectral norm is about 2 √k times that (a random symmetric matrix), so
    eigenvalues below 3 √k ``rounding_std`` are indistinguishable from rounding (applied as
    a tolerance relative to λ₁)."""
    dev = resolve_server_device(device)
    groups: dict[tuple[int, int], list[str]] = {}
    for key, prev in prev_As.items():
        groups.setdefault(tuple(np.shape(prev)), []).append(key)
    new_As: dict[str, np.ndarray] = {}
    infos: dict[str, dict[str, float | int]] = {}
    with torch.no_grad():
        for (r, k), keys in groups.items():
            grams = [unpack_gram(mean[gram_key(key)], k) for key in keys]
            Q = torch.from_numpy(np.stack(grams)).to(dev, F64)
            prevs = [np.asarray(prev_As[key], np.float64) for key in keys]
            prev = torch.from_numpy(np.stack(prevs)).to(dev)
            tol = default_rtol(k, num_clients * r)
            rtol = torch.full((len(keys),), tol, dtype=F64, device=dev)
            if rounding_std > 0:  # 3 √k rounding_std relative to λ₁ (power iteration)
                lam1 = _top_eigenvalue(Q)
                floor = 3 * k**0.5 * rounding_std / torch.where(lam1 > 0, lam1, 1.0)
                rtol = torch.maximum(rtol, floor)
            new, rank, lam, err_sq = _gram_step(Q, prev, rtol, procrustes, rank_mismatch)
            infos.update(_infos(keys, new, prev, rank, lam, err_sq))
            for key, value in zip(keys, new.cpu().numpy(), strict=True):
                new_As[key] = value
    return {key: new_As[key] for key in prev_As}, {key: infos[key] for key in prev_As}


def private_contribution(
    arrays: Mapping[str, np.ndarray],
    received: Mapping[str, np.ndarray],
    clipping_norm: float,
    blocks: Blocks | None = None,
) -> tuple[dict[str, np.ndarray], bool]:
    """Under dp=central: each layer's A with its update A − A_prev and the head's update
    scaled jointly to C (``clip_florg_with_head``, as the server clips a plain private round;
    blocks that partition A's rows share that one clipping), then as ``gram_contribution``:
    the Grams of the clipped A's ``blocks``, the clipped head update; and whether it was
    scaled down."""
    from strategies.florg.dp import clip_florg_with_head

    As = {k: np.asarray(v, np.float64) for k, v in arrays.items() if _is_factor(k)}
    prev = {k: np.asarray(received[k], np.float64) for k in As}
    head = {
        k: np.asarray(v, np.float64) - np.asarray(received[k], np.float64)
        for k, v in arrays.items()
        if not _is_factor(k)
    }
    norm_sq = sum(float(np.sum((As[k] - prev[k]) ** 2)) for k in As)
    norm_sq += sum(float(np.sum(h * h)) for h in head.values())
    clipped_A, clipped_head = clip_florg_with_head(As, head or None, clipping_norm, prev_A=prev)
    clipped = {**clipped_A, **(clipped_head or {})}
    return gram_contribution(clipped, blocks), norm_sq > clipping_norm**2


def private_from_grams(
    sums: Mapping[str, np.ndarray],
    prev_As: Mapping[str, np.ndarray],
    clients: int,
    num_sampled: float,
    clipping_norm: float,
    noise_multiplier: float,
    rng: np.random.Generator,
    *,
    procrustes: bool,
    device: str = "auto",
) -> tuple[dict[str, np.ndarray], dict[str, dict[str, float | int]], float]:
    """The private FLoRG step (docs/privacy.md section 4) from the survivors' summed Grams of
    their clipped A, per block b of ``prev_As`` (b -> its previous rows P): Q^ = (Σ AₙᵀAₙ −
    n PᵀP + E) / m + PᵀP, E Analyze-Gauss noise of std z Δ, Δ = C (2 max ‖P‖₂ + C) over the
    blocks (``florg_sensitivity``), drawn as the plain round draws it (``layer_noise``); then
    ``florg_private_steps_torch``. Returns the new rows, the per-block diagnostics and z Δ."""
    from strategies.florg.dp import florg_sensitivity, layer_noise
    from strategies.florg.dp_torch import florg_private_steps_torch

    dev = resolve_server_device(device)
    prevs = {k: np.asarray(v, np.float64) for k, v in prev_As.items()}
    std = noise_multiplier * florg_sensitivity(clipping_norm, prevs)
    noise = layer_noise(prevs, std, rng)
    new_As: dict[str, np.ndarray] = {}
    infos: dict[str, dict[str, float | int]] = {}
    with torch.no_grad():
        for key, prev in prevs.items():
            r, k = prev.shape
            gram = unpack_gram(sums[gram_key(key)], k)
            base = prev.T @ prev
            Q = (gram - clients * base + noise[key]) / num_sampled + base
            new, rank, lam = florg_private_steps_torch(
                torch.from_numpy(Q[None]).to(dev, F64),
                torch.from_numpy(prev[None]).to(dev, F64),
                procrustes=procrustes,
            )
            new_As[key] = new[0].cpu().numpy()
            lam_r = lam[0].cpu().numpy()
            infos[key] = {
                "rank": int(rank[0]),
                "drift": float(np.linalg.norm(new_As[key] - prev)),
                "eigengap": float(lam_r[r - 1] - (lam_r[r] if k > r else 0.0)),
                "negative_eigenvalues": int((lam_r < 0).sum()),
            }
    return new_As, infos, std
