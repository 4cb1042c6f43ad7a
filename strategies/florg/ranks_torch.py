"""FLoRG with heterogeneous client ranks in torch, float64, batched over layers:
``aggregate_florg_ranks_layers``, what ``strategies.florg.ranks.aggregate_florg_ranks``
computes for one layer (same tolerance, policies and diagnostics; the tests hold the two to
1e-12).

Layers are grouped by (k, the clients' row counts r_1..r_N, the requested ranks), each group
one stack on the server's device. One decomposition per layer, A~ = U_n^T M from eigh of
G = M M^T (of Q itself when R = sum_n r_n > k), serves every requested rank r_t: Theorem 1
on the rows the policy keeps, batched, and the Gram-error diagnostic shared with the
homogeneous path (``strategies.florg.rule_torch._from_factor``). Unlike that path it always
takes eigenvectors and stacks without the reused staging buffer.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from strategies.florg.device import F64, gram_and_cross, resolve_server_device, times_stack
from strategies.florg.ranks import RankInfo, validated_rank_inputs
from strategies.florg.rule import check_rank_mismatch, default_rtol
from strategies.florg.rule_torch import _descending_eigh, _from_factor, _index_mask, _numerical_rank
from strategies.shared.validation import AggregationInputError, check_layer_sets, normalize_weights

log = logging.getLogger(__name__)

# Layers per batched call are capped so that one stack of client matrices stays below this.
MAX_STACK_BYTES = 1 << 30

__all__ = ["aggregate_florg_ranks_layers"]


def _validated(
    client_As_by_layer: Mapping[str, Sequence[Any]],
    weights: Sequence[float] | np.ndarray | None,
    prev_by_layer_and_rank: Mapping[str, Mapping[int, Any]],
) -> tuple[dict[str, list[np.ndarray]], np.ndarray, dict[str, dict[int, np.ndarray]]]:
    """Per layer the reference's checks (errors prefixed by the layer), plus the layer sets."""
    n = check_layer_sets(
        client_As_by_layer, prev_by_layer_and_rank, ("client_As_by_layer", "prev_by_layer_and_rank")
    )
    w = normalize_weights(weights, n)
    mats: dict[str, list[np.ndarray]] = {}
    prevs: dict[str, dict[int, np.ndarray]] = {}
    for layer, prev_by_rank in prev_by_layer_and_rank.items():
        try:
            mats[layer], _, prevs[layer], _ = validated_rank_inputs(
                client_As_by_layer[layer], w, prev_by_rank
            )
        except AggregationInputError as err:
            raise AggregationInputError(f"{layer}: {err}") from None
    return mats, w, prevs


def _decompose(
    A: torch.Tensor, d: torch.Tensor, rtol: torch.Tensor, rows_needed: int | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q's spectrum (B x min(R, k), descending), r' per layer, and A~'s first rows (B x n x k).

    ``rows_needed``: how many rows of A~ to form (None: up to the batch's largest r').
    Rows beyond a layer's r' are zero.
    """
    _, n_rows, k = A.shape
    if n_rows > k:
        # More stacked rows than columns: Q (k x k) is the smaller matrix (as the reference).
        M = A * d[None, :, None]
        lam, P = _descending_eigh(M.mT @ M, vectors=True)
        assert P is not None
        rank = _numerical_rank(lam, rtol)
        n = _rows(rows_needed, rank, k)
        factor = lam[:, :n].sqrt()[:, :, None] * P[:, :, :n].mT
        return lam, rank, factor * _index_mask(rank, n)[:, :, None]
    G = gram_and_cross(A, n_rows).to(A.device) * (d[:, None] * d[None, :])  # M M^T (eq. Gram_agg)
    lam, U = _descending_eigh(G, vectors=True)
    assert U is not None
    rank = _numerical_rank(lam, rtol)
    n = _rows(rows_needed, rank, n_rows)
    factor = times_stack(U[:, :, :n].mT * d[None, None, :], A)  # U_n^T M
    return lam, rank, factor * _index_mask(rank, n)[:, :, None]


def _rows(rows_needed: int | None, rank: torch.Tensor, available: int) -> int:
    wanted = int(rank.max()) if rows_needed is None else rows_needed
    return max(1, min(wanted, available))


def _group_step(
    A: torch.Tensor,
    d: torch.Tensor,
    prevs: Mapping[int, torch.Tensor],
    rtol: torch.Tensor,
    procrustes: bool,
    rank_mismatch: str,
) -> tuple[torch.Tensor, torch.Tensor, dict[int, tuple[torch.Tensor, torch.Tensor]]]:
    """One batch of layers of equal (k, r_1..r_N, requested ranks).

    One decomposition serves every requested rank r_t: A~'s first n rows, n the rows any
    requested rank needs (max r_t for 'truncate' and the ablation, the batch's largest r'
    for 'procrustes'), then Theorem 1 on the rows the policy keeps, per r_t.

    Returns Q's spectrum and r' per layer, and per requested rank (A_new, ||A_new^T A_new -
    Q||_F^2) per layer.
    """
    all_rows = procrustes and rank_mismatch == "procrustes"
    lam, rank, factor = _decompose(A, d, rtol, None if all_rows else max(prevs))
    out: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for r_t, prev in prevs.items():
        if all_rows:
            rows, use = factor, rank
        else:
            rows, use = factor[:, :r_t], torch.clamp(rank, max=r_t)
        out[r_t] = _from_factor(rows, use, lam, prev, procrustes)
    return lam, rank, out


def _infos(
    new: torch.Tensor,
    prev: torch.Tensor,
    rank: torch.Tensor,
    kept: torch.Tensor,
    lam: torch.Tensor,
    err_sq: torch.Tensor,
) -> list[RankInfo]:
    """The reference's diagnostics (``factor_for_rank``) for one rank, batched, one host copy."""
    B, r = prev.shape[0], prev.shape[1]
    lam_pad = torch.cat([lam, torch.zeros(B, r + 1, dtype=F64, device=lam.device)], dim=1)
    gap = lam_pad[:, r - 1] - lam_pad[:, r]
    lam1 = lam_pad[:, 0]
    q_norm = torch.sqrt((lam**2).sum(dim=1))
    trace = lam.sum(dim=1)
    gram_err = torch.where(
        q_norm > 0, err_sq.clamp_min(0.0).sqrt() / torch.where(q_norm > 0, q_norm, 1.0), 0.0
    )
    share = torch.where(
        trace > 0, (new**2).sum(dim=(1, 2)) / torch.where(trace > 0, trace, 1.0), 0.0
    )
    gap_rel = torch.where(lam1 > 0, gap / torch.where(lam1 > 0, lam1, 1.0), 0.0)
    drift = torch.linalg.vector_norm(new - prev, dim=(1, 2))
    table = torch.stack(
        [rank.to(F64), kept.to(F64), gram_err, share, drift, gap, gap_rel], dim=1
    ).cpu()
    return [
        {
            "rank": int(row[0]),
            "kept": int(row[1]),
            "gram_rel_error": float(row[2]),
            "trace_share": float(row[3]),
            "drift": float(row[4]),
            "eigengap": float(row[5]),
            "eigengap_rel": float(row[6]),
        }
        for row in table.numpy()
    ]


def aggregate_florg_ranks_layers(
    client_As_by_layer: Mapping[str, Sequence[np.ndarray]],
    weights: Sequence[float] | np.ndarray | None,
    prev_by_layer_and_rank: Mapping[str, Mapping[int, np.ndarray]],
    device: str | torch.device = "auto",
    procrustes: bool = True,
    rank_mismatch: str = "truncate",
    rtol: float | None = None,
    max_stack_bytes: int = MAX_STACK_BYTES,
) -> tuple[dict[str, dict[int, np.ndarray]], dict[str, dict[int, RankInfo]]]:
    """The heterogeneous-rank FLoRG server step for every layer at once (torch, float64).

    Args:
        client_As_by_layer: layer -> the clients' A_n (r_n x k each; r_n may differ between
            clients and be 0; the same client order in every layer).
        weights: one per client (normalised here; None means uniform 1/N).
        prev_by_layer_and_rank: layer -> {r_t: previous factor of rank r_t (r_t x k)}.
        device: 'auto' (CUDA when torch sees a GPU), 'cpu' or 'cuda'.
        procrustes, rank_mismatch, rtol: as for ``aggregate_florg_ranks``.
        max_stack_bytes: cap on one batched stack of client matrices (layers are chunked).

    Returns:
        (layer -> {r_t: new factor, float64 numpy}, layer -> {r_t: diagnostics}), equal to
        ``aggregate_florg_ranks`` layer by layer up to rounding (tests: 1e-12).
    """
    check_rank_mismatch(rank_mismatch)
    dev = resolve_server_device(device)
    mats, w, prevs = _validated(client_As_by_layer, weights, prev_by_layer_and_rank)
    groups: dict[tuple[int, tuple[int, ...], tuple[int, ...]], list[str]] = {}
    for name, layer_mats in mats.items():
        key = (layer_mats[0].shape[1], tuple(a.shape[0] for a in layer_mats), tuple(prevs[name]))
        groups.setdefault(key, []).append(name)

    all_rows = procrustes and rank_mismatch == "procrustes"  # A~'s rows S is applied to
    new_out: dict[str, dict[int, np.ndarray]] = {name: {} for name in prevs}
    info_out: dict[str, dict[int, RankInfo]] = {name: {} for name in prevs}
    with torch.no_grad():
        for (k, row_counts, ranks), names in groups.items():
            R = sum(row_counts)
            tol = default_rtol(k, R) if rtol is None else float(rtol)
            d_np = np.repeat(np.sqrt(w), row_counts)  # sqrt(w_n) for each of client n's rows
            if R == 0:  # every client rank 0: one zero row stands in (Q = 0, r' = 0)
                d_np = np.zeros(1)
            d = torch.as_tensor(d_np, dtype=F64, device=dev)
            chunk = max(1, int(max_stack_bytes) // (max(R, 1) * k * 8))
            for start in range(0, len(names), chunk):
                part = names[start : start + chunk]
                if R == 0:
                    stack = np.zeros((len(part), 1, k))
                else:
                    stack = np.stack([np.concatenate(mats[name]) for name in part])
                A = torch.from_numpy(stack).to(dev)
                prev_t = {
                    r_t: torch.from_numpy(np.stack([prevs[name][r_t] for name in part])).to(dev)
                    for r_t in ranks
                }
                rtol_b = torch.full((len(part),), tol, dtype=F64, device=dev)
                lam, rank, per_rank = _group_step(A, d, prev_t, rtol_b, procrustes, rank_mismatch)
                for r_t, (new, err_sq) in per_rank.items():
                    kept = rank if all_rows else torch.clamp(rank, max=r_t)
                    infos = _infos(new, prev_t[r_t], rank, kept, lam, err_sq)
                    new_np = new.cpu().numpy()
                    for i, name in enumerate(part):
                        new_out[name][r_t] = new_np[i]
                        info_out[name][r_t] = infos[i]
    zero = [name for name, by_rank in info_out.items() if next(iter(by_rank.values()))["rank"] == 0]
    if zero:
        log.warning("FLoRG: aggregated Gram matrix is zero (rank 0) in %s; factors are zero", zero)
    return new_out, info_out
