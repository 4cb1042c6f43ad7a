"""The FLoRG server step in torch, float64, batched over all layers of equal shape:
``aggregate_florg_layers`` (what ``FLoRGStrategy`` runs; ``aggregate_layers_torch`` takes
the stack's memory bound as a parameter).

For every adapted layer at once it computes what ``strategies.florg.rule.aggregate_florg``
computes for one (same tolerance, rank-mismatch policies and diagnostics; the tests hold the
two to 1e-12). Layers are grouped by (r, k), each group one stack (B x N r x k) on the
server's device (CPU or CUDA), each step one batched call. With full numerical rank and
'procrustes' no eigenvectors are needed: Theorem 1 on M itself (``_group_step`` derives it);
deficient ranks, 'truncate' and the ablation take A~ = U_{r'}^T M. For N r > k, Q is summed
block by block (``strategies.florg.gram_sum``) and decomposed. The stack, its device and
the Gram products: ``strategies.florg.device``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from strategies.florg.device import (
    F64,
    STAGING,
    batched_eigh,
    gram_and_cross,
    resolve_server_device,
    stack_layers,
    times_stack,
)
from strategies.florg.gram_sum import gram_sum
from strategies.florg.rule import check_rank_mismatch, default_rtol
from strategies.shared.validation import AggregationInputError, check_layer_sets, normalize_weights

log = logging.getLogger(__name__)

# Layers per batched call are capped so that one stack of client matrices stays below this.
MAX_STACK_BYTES = 1 << 30

LayerInfo = dict[str, float | int]


# --------------------------------------------------------------------------- inputs


def _check_matrix(a: Any, name: str) -> np.ndarray:
    arr = np.asarray(a)
    if arr.ndim != 2:
        raise AggregationInputError(f"{name}: expected a 2-D matrix, got shape {arr.shape}")
    if not (np.issubdtype(arr.dtype, np.floating) or np.issubdtype(arr.dtype, np.integer)):
        raise AggregationInputError(f"{name}: expected a real float array, got dtype {arr.dtype}")
    return arr


def _validated(
    client_As: Mapping[str, Sequence[Any]],
    weights: Sequence[float] | np.ndarray | None,
    prev_As: Mapping[str, Any],
) -> tuple[dict[str, list[np.ndarray]], np.ndarray, dict[str, np.ndarray]]:
    """Shapes, dtypes, client counts and weights checked (finiteness is checked on the stack)."""
    n = check_layer_sets(client_As, prev_As)
    if n == 0:
        raise AggregationInputError("client_As: no client matrices to aggregate")
    w = normalize_weights(weights, n)
    prevs: dict[str, np.ndarray] = {}
    mats: dict[str, list[np.ndarray]] = {}
    for layer, prev_A in prev_As.items():
        prev = _check_matrix(prev_A, f"prev_A[{layer}]").astype(np.float64, copy=False)
        if not np.all(np.isfinite(prev)):
            raise AggregationInputError(f"prev_A[{layer}]: contains NaN/Inf entries")
        r, k = prev.shape
        if r < 1:
            raise AggregationInputError(f"prev_A[{layer}]: rank r must be at least 1")
        if r > k:
            raise AggregationInputError(
                f"prev_A[{layer}]: rank r={r} exceeds k=min(d_in, d_out)={k}"
            )
        layer_mats = [
            _check_matrix(a, f"{layer}[client {i}]") for i, a in enumerate(client_As[layer])
        ]
        for i, a in enumerate(layer_mats):
            if a.shape != (r, k):
                raise AggregationInputError(
                    f"{layer}[client {i}]: shape {a.shape} does not match the expected {(r, k)}"
                )
        prevs[layer], mats[layer] = prev, layer_mats
    return mats, w, prevs


# --------------------------------------------------------------------------- batched math


def _numerical_rank(lam: torch.Tensor, rtol: torch.Tensor) -> torch.Tensor:
    """Per layer: #{i : lambda_i > rtol lambda_1} (lambda sorted descending, >= 0); 0 if Q = 0."""
    lam1 = lam[:, :1]
    count = (lam > rtol[:, None] * lam1).sum(dim=1)
    return torch.where(lam1[:, 0] > 0, count, torch.zeros_like(count))


def _polar(X: torch.Tensor, via_qr: bool | None = None) -> torch.Tensor:
    """Theorem 1, batched: S = U V^T from the thin SVD of X (B x r x n).

    On CUDA with r <= 32 < n the r x n SVD (which cuSOLVER solves one matrix at a time)
    goes through the thin QR X^T = Q R and the r x r SVD R^T = U' Sigma V'^T, which torch
    batches: X = U' Sigma (Q V')^T is then a thin SVD of X, so S = U' V'^T Q^T (H100, 64
    of 8 x 160: 4 ms against 39 ms, both 1e-15 from LAPACK's; server_profile --blocks).
    """
    r, n = X.shape[-2:]
    if via_qr is None:  # the route by device and shape; True / False force it (tests)
        via_qr = X.device.type == "cuda" and r <= 32 < n
    if via_qr:
        Q, R = torch.linalg.qr(X.mT)
        U, _, Vh = torch.linalg.svd(R.mT)
        return (U @ Vh) @ Q.mT
    U, _, Vh = torch.linalg.svd(X, full_matrices=False)
    return U @ Vh


def _canonical_signs(rows: torch.Tensor) -> torch.Tensor:
    """Flip each row so that its largest-magnitude entry is positive (as the reference)."""
    idx = rows.abs().argmax(dim=-1, keepdim=True)
    pivots = rows.gather(-1, idx)
    return rows * torch.where(pivots < 0, -1.0, 1.0).to(rows.dtype)


def _index_mask(count: torch.Tensor, n: int) -> torch.Tensor:
    """(B x n) float mask, 1 where the column index < count[b]."""
    idx = torch.arange(n, device=count.device)
    return (idx[None, :] < count[:, None]).to(F64)


def _descending_eigh(S: torch.Tensor, vectors: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Eigenvalues (descending, clipped at 0) and, if asked, the matching eigenvectors."""
    lam, U = batched_eigh(S, vectors)
    return lam.flip(-1).clamp_min(0.0), (None if U is None else U.flip(-1))


def _from_factor(
    rows: torch.Tensor,
    use: torch.Tensor,
    lam: torch.Tensor,
    prev: torch.Tensor,
    procrustes: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A_new and ||A_new^T A_new - Q||_F^2 from the first ``use[b]`` rows of A~ (B x n x k).

    ``rows`` holds A~'s rows in eigenvalue order, zero beyond ``use[b]``; ``lam`` is Q's
    whole spectrum (B x m, descending).  Procrustes: S (r x n) from A_prev rows^T, whose
    columns beyond ``use[b]`` are zero (so S's matching columns meet zero rows only).  The
    error is ||Y^T Y - Lambda_used||^2 + sum of the unused eigenvalues squared, with
    Y = S Lambda^{1/2} the coordinates of A_new in A~'s orthonormalised rows (as the
    reference computes it).
    """
    B, n, _ = rows.shape
    r = prev.shape[1]
    mask = _index_mask(use, n)
    lam_n = torch.zeros(B, n, dtype=F64, device=lam.device)
    m = min(n, lam.shape[1])
    lam_n[:, :m] = lam[:, :m]
    lam_used = lam_n * mask
    if procrustes:
        S = _polar(prev @ rows.mT)
        new = S @ rows
        Y = S * (lam_used.sqrt()[:, None, :])
    else:  # ablation: top-r rows of A~ (sign-fixed), zero-padded
        top = _canonical_signs(rows[:, :r])
        new = torch.zeros_like(prev)
        new[:, : top.shape[1]] = top
        Y = torch.diag_embed(lam_used.sqrt())[:, :r]
    kept = Y.mT @ Y - torch.diag_embed(lam_used)
    all_idx = _index_mask(use, lam.shape[1])
    err_sq = (kept**2).sum(dim=(1, 2)) + ((lam * (1.0 - all_idx)) ** 2).sum(dim=1)
    return new, err_sq


def _gram_step(
    Q: torch.Tensor, prev: torch.Tensor, rtol: torch.Tensor, procrustes: bool, rank_mismatch: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``_group_step`` from Q itself (B x k x k), for N r > k (as the reference)."""
    r, k = prev.shape[1], Q.shape[1]
    lam, P = _descending_eigh(Q, vectors=True)
    assert P is not None
    rank = _numerical_rank(lam, rtol)
    factor = (lam.sqrt()[:, :, None] * P.mT) * _index_mask(rank, k)[:, :, None]
    if rank_mismatch == "truncate" or not procrustes:
        use, factor = torch.clamp(rank, max=r), factor[:, :r]
    else:
        use = rank
    new, err_sq = _from_factor(factor, use, lam, prev, procrustes)
    return new, rank, lam, err_sq


def _group_step(
    T: torch.Tensor,
    d: torch.Tensor,
    r: int,
    rtol: torch.Tensor,
    procrustes: bool,
    rank_mismatch: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One batch of layers of equal (r, k) with N r <= k, stacked as T = [A_1; ...; A_N;
    A_prev] (N r > k: ``_gram_step``).

    With A = [A_1; ...; A_N] (B x Nr x k, unweighted) and d = [sqrt(w_1) 1_r; ...] (Nr),
    M = diag(d) A and Q = M^T M (eq. Gram_agg); G = M M^T = (A A^T) o (d d^T) (B x Nr x Nr)
    has Q's nonzero eigenvalues (eq. Gram_decompose).

    Direct path (policy 'procrustes', full numerical rank r' = Nr: the usual case).
    Theorem 1 depends on Q and A_prev only, not on which factor of Q it is given: for any
    F = O A~ with O orthogonal, the SVD of A_prev F^T = (U Sigma V^T) O^T gives
    S_F = U V^T O^T and S_F F = U V^T A~.  M itself is such a factor (M = U A~, U the
    Nr x Nr eigenvectors of G), so

        X = A_prev M^T = (A_prev A^T) o d,   S = U_X V_X^T (thin SVD of X, r x Nr),
        A_new = S M = (S o d) A,

    which needs G's eigenvalues (for r' and the diagnostics) but no eigenvectors, and never
    forms A~ (an Nr x Nr x k product per layer).  Its Gram error: with Pi = S^T S (a rank-r
    projector) and P = I - Pi, A_new^T A_new - Q = -M^T P M and
    ||M^T P M||_F^2 = tr(P G P G) = ||P G P||_F^2 (P^2 = P), an Nr x Nr quantity.

    Layers of deficient rank (r' < Nr) take the eigenvector path, A~ = U_{r'}^T M, so that
    eigenvalues below the tolerance are dropped exactly as the reference drops them; so do
    'truncate' (A~_r = U_r^T M, then an r x r Procrustes) and the ablation (the top-r rows
    of A~, sign-fixed like the reference).

    Returns per layer: A_new, r', Q's spectrum (descending), ||A_new^T A_new - Q||_F^2.
    """
    B, rows, k = T.shape
    nr = rows - r
    A, prev = T[:, :nr], T[:, nr:]
    truncate = rank_mismatch == "truncate"
    GX = gram_and_cross(T, nr)
    G = GX[:, :nr] * (d[:, None] * d[None, :])  # M M^T, eq. (Gram_agg) in the small space
    need_vectors = truncate or not procrustes
    lam, U = _descending_eigh(G, vectors=need_vectors)
    rank = _numerical_rank(lam, rtol)
    if need_vectors:
        # Top-r rows of A~ = U_r^T M only: 'truncate' (Eckart-Young) and the ablation.
        assert U is not None
        use = torch.clamp(rank, max=r)
        factor = times_stack(U[:, :, :r].mT * d[None, None, :], A) * _index_mask(use, r)[:, :, None]
        new, err_sq = _from_factor(factor, use, lam, prev, procrustes)
        return new, rank, lam, err_sq

    X = GX[:, nr:] * d[None, None, :]  # A_prev M^T (r x Nr)
    new = torch.empty_like(prev)
    err_sq = torch.empty(B, dtype=F64, device=T.device)
    full = rank == nr
    direct = torch.nonzero(full).flatten()
    if direct.numel():
        # Theorem 1 applied to M itself (M = U A~ with U orthogonal): see the docstring.
        every = direct.numel() == B  # the usual case: no copy of the stack
        Ad, Gd, Xd = (A, G, X) if every else (A[direct], G[direct], X[direct])
        S = _polar(Xd)  # (B' x r x Nr), orthonormal rows
        new_d = times_stack(S * d[None, None, :], Ad)
        Z = torch.baddbmm(Gd, S.mT, S @ Gd, alpha=-1.0)  # (I - S^T S) G
        PGP = torch.baddbmm(Z, Z @ S.mT, S, alpha=-1.0)  # (I - S^T S) G (I - S^T S)
        err_d = torch.linalg.vector_norm(PGP, dim=(1, 2)) ** 2
        if every:
            return new_d, rank, lam, err_d
        new[direct], err_sq[direct] = new_d, err_d
    deficient = torch.nonzero(~full).flatten()
    if deficient.numel():
        # r' < Nr: A~ = U_{r'}^T M, so that the eigenvalues below the tolerance are dropped.
        # The eigenvalues are taken again from this eigh, so that they match its vectors.
        lam_s, U_s = _descending_eigh(G[deficient], vectors=True)
        assert U_s is not None
        rank_s = _numerical_rank(lam_s, rtol[deficient])
        lam[deficient], rank[deficient] = lam_s, rank_s
        n = max(int(rank_s.max()), 1)
        factor = times_stack(U_s[:, :, :n].mT * d[None, None, :], A[deficient])
        factor = factor * _index_mask(rank_s, n)[:, :, None]
        new[deficient], err_sq[deficient] = _from_factor(
            factor, rank_s, lam_s, prev[deficient], True
        )
    return new, rank, lam, err_sq


def _infos(
    names: Sequence[str],
    new: torch.Tensor,
    prev: torch.Tensor,
    rank: torch.Tensor,
    lam: torch.Tensor,
    err_sq: torch.Tensor,
) -> dict[str, LayerInfo]:
    """The reference's per-layer diagnostics, computed batched and moved to the host once."""
    B, r = prev.shape[0], prev.shape[1]
    lam_pad = torch.cat([lam, torch.zeros(B, r + 1, dtype=F64, device=lam.device)], dim=1)
    gap = lam_pad[:, r - 1] - lam_pad[:, r]
    lam1 = lam_pad[:, 0]
    q_norm = torch.sqrt((lam**2).sum(dim=1))
    safe = torch.where(q_norm > 0, q_norm, torch.ones_like(q_norm))
    gram_err = torch.where(q_norm > 0, err_sq.clamp_min(0.0).sqrt() / safe, 0.0)
    gap_rel = torch.where(lam1 > 0, gap / torch.where(lam1 > 0, lam1, 1.0), 0.0)
    drift = torch.linalg.vector_norm(new - prev, dim=(1, 2))
    table = torch.stack([rank.to(F64), gram_err, drift, gap, gap_rel], dim=1).cpu().numpy()
    return {
        name: {
            "rank": int(row[0]),
            "gram_rel_error": float(row[1]),
            "drift": float(row[2]),
            "eigengap": float(row[3]),
            "eigengap_rel": float(row[4]),
        }
        for name, row in zip(names, table, strict=True)
    }


def aggregate_layers_torch(
    client_As: Mapping[str, Sequence[Any]],
    weights: Sequence[float] | np.ndarray | None,
    prev_As: Mapping[str, Any],
    procrustes: bool = True,
    device: str | torch.device = "auto",
    rank_mismatch: str = "procrustes",
    rtol: float | None = None,
    max_stack_bytes: int = MAX_STACK_BYTES,
) -> tuple[dict[str, np.ndarray], dict[str, LayerInfo]]:
    """``aggregate_florg_layers`` with the staging-memory bound as a parameter."""
    check_rank_mismatch(rank_mismatch)
    dev = resolve_server_device(device)
    mats, w, prevs = _validated(client_As, weights, prev_As)
    n_clients = len(w)
    groups: dict[tuple[int, int], list[str]] = {}
    for name, prev in prevs.items():
        groups.setdefault(prev.shape, []).append(name)

    sqrt_w = torch.as_tensor(np.sqrt(w), dtype=F64, device=dev)
    new_As: dict[str, np.ndarray] = {}
    infos: dict[str, LayerInfo] = {}
    with torch.no_grad(), STAGING.lock:
        for (r, k), names in groups.items():
            d = sqrt_w.repeat_interleave(r)  # sqrt(w_n) for each of client n's r rows
            stacked = n_clients * r if n_clients * r <= k else 2 * k  # stack, or Q + a block
            per_layer = (stacked + r) * k * 8
            chunk = max(1, int(max_stack_bytes) // per_layer)
            tol = default_rtol(k, n_clients * r) if rtol is None else float(rtol)
            for start in range(0, len(names), chunk):
                part = names[start : start + chunk]
                rtol_b = torch.full((len(part),), tol, dtype=F64, device=dev)
                if n_clients * r > k:  # Q summed over blocks of clients, no (N r x k) stack
                    Q = gram_sum(part, mats, np.sqrt(w), dev)
                    prev = torch.from_numpy(np.stack([prevs[name] for name in part])).to(dev)
                    new, rank, lam, err_sq = _gram_step(Q, prev, rtol_b, procrustes, rank_mismatch)
                else:
                    T = stack_layers(part, mats, prevs, dev)
                    prev = T[:, n_clients * r :]
                    new, rank, lam, err_sq = _group_step(T, d, r, rtol_b, procrustes, rank_mismatch)
                infos.update(_infos(part, new, prev, rank, lam, err_sq))
                new_np = new.cpu().numpy()
                for i, name in enumerate(part):
                    new_As[name] = new_np[i]
    zero = [name for name, info in infos.items() if info["rank"] == 0]
    if zero:
        log.warning("FLoRG: aggregated Gram matrix is zero (rank 0) in %s; new A is zero", zero)
    return {name: new_As[name] for name in prevs}, {name: infos[name] for name in prevs}


def aggregate_florg_layers(
    client_As: Mapping[str, Sequence[np.ndarray]],
    weights: Sequence[float] | np.ndarray | None,
    prev_As: Mapping[str, np.ndarray],
    procrustes: bool = True,
    device: str = "auto",
    rank_mismatch: str = "procrustes",
    rtol: float | None = None,
) -> tuple[dict[str, np.ndarray], dict[str, dict[str, float | int]]]:
    """The FLoRG server step for every layer at once: torch, float64, batched, on ``device``.

    Args:
        client_As: layer name -> the clients' A_n (r x k each, same client order per layer).
        weights: client weights (normalised here; None means uniform 1/N), one per client.
        prev_As: layer name -> the previous global A (r x k).
        procrustes, rank_mismatch, rtol: as for ``aggregate_florg``.
        device: 'auto' (CUDA when torch sees a GPU), 'cpu' or 'cuda'.

    Returns:
        (layer name -> new A as float64 numpy, layer name -> the diagnostics
        ``aggregate_florg`` returns for that layer).  Equal to ``aggregate_florg`` layer by
        layer up to rounding (tests: 1e-12); layers of equal (r, k) share one batched
        eigendecomposition and SVD (see ``strategies.florg.rule_torch``).
    """
    return aggregate_layers_torch(
        client_As,
        weights,
        prev_As,
        procrustes=procrustes,
        device=device,
        rank_mismatch=rank_mismatch,
        rtol=rtol,
    )
