"""The Gram mechanism of central DP (FLoRG, its no-Procrustes ablation and its sign-block variant),
numpy reference: clip each client's update A_n - A_prev (with its head update) jointly,
release the noised mean Gram matrix (Analyze-Gauss noise, symmetric), decompose it, keep
the top r, align by Procrustes (docs/privacy.md section 4).  The batched torch path the
strategy runs: strategies/florg/dp_torch.py."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from strategies.florg.rule import _canonical_signs, procrustes_rotation
from strategies.server.central_dp import (
    EPS64,
    Arrays,
    _check_clipped,
    _items,
    _rebuild,
    check_clipping_norm,
    check_noise_multiplier,
    public_divisor,
)
from strategies.shared.validation import as_float64_matrix


def _layers(A: Any) -> tuple[bool, list[tuple[Any, np.ndarray]]]:
    """(was a single matrix, [(name, matrix)])."""
    if isinstance(A, Mapping):
        return False, [(k, as_float64_matrix(v, f"A[{k}]")) for k, v in A.items()]
    return True, [(None, as_float64_matrix(A, "A"))]


def florg_sensitivity(clipping_norm: float, prev_A: Any = None) -> float:
    """L2 sensitivity Delta of the released Gram SUM under adding/removing one client.

    Clipping A itself (``prev_A`` None, ||A_n||_F <= C): the client's term is A_n^T A_n and
    ||A^T A||_F <= ||A||_2 ||A||_F <= ||A||_F^2 <= C^2, so Delta = C^2.  Over several layers
    clipped jointly (sum_l ||A_l||_F^2 <= C^2): sqrt(sum_l ||A_l^T A_l||_F^2) <=
    sum_l ||A_l||_F^2 <= C^2, the same Delta.

    Clipping the update D = A_n - P (``prev_A`` = P, the public A the round started from;
    ||D||_F <= C): the released statistic is sum_n (A_n^T A_n - P^T P) (P^T P is public, added
    back by post-processing), whose client term g(D) = P^T D + D^T P + D^T D has
    ||g(D)||_F <= 2 ||P||_2 ||D||_F + ||D||_F^2, so Delta = C (2 ||P||_2 + C); over layers
    clipped jointly, by the triangle inequality in l2 over layers,
    Delta = C (2 max_l ||P_l||_2 + C).  P = 0 gives back C^2.

    The noise is added to the upper triangle (diagonal included) only, whose L2 norm is at
    most the Frobenius norm, so Delta bounds that vector's sensitivity too.
    """
    c = check_clipping_norm(clipping_norm)
    if prev_A is None:
        return c * c
    _, layers = _layers(prev_A)
    p = max((float(np.linalg.norm(P, 2)) if P.size else 0.0) for _, P in layers)
    return c * (2.0 * p + c)


def clip_florg_with_head(
    A: Any,
    head_update: Arrays | None,
    clipping_norm: float,
    head_clipping_norm: float | None = None,
    prev_A: Any = None,
) -> tuple[Any, Any]:
    """One client's FLoRG upload clipped: its A (one matrix or a mapping layer -> A, all
    layers jointly) and, optionally, its task-head update, with one common scale factor.

    With D = A - prev_A (or A itself when ``prev_A`` is None), a = ||D||_F / C and
    b = ||head||/C_h, both are scaled by c = min(1, 1/sqrt(a^2 + b^2)).  Then the Gram term
    has ||g(cD)||_F <= a' Delta (a' = c a <= 1, so a'^2 <= a') and the head
    ||c head|| = b' C_h with a'^2 + b'^2 <= 1: the Gram sum with noise std z Delta
    (``florg_sensitivity``) and the head sum with std z C_h together are ONE Gaussian
    mechanism with multiplier z, not two to compose.  Returns (clipped A in A's
    structure, clipped head update or None).
    """
    c = check_clipping_norm(clipping_norm)
    single, layers = _layers(A)
    prev: dict[Any, np.ndarray] = {}
    if prev_A is not None:
        prev_single, prev_layers = _layers(prev_A)
        prev = dict(prev_layers)
        if prev_single != single or set(prev) != {k for k, _ in layers}:
            raise ValueError("prev_A must have the same layers as A")
    deltas = []
    for name, a in layers:
        base = prev.get(name)
        if base is not None and base.shape != a.shape:
            raise ValueError(f"layer {name!r}: A {a.shape} and prev_A {base.shape} differ")
        deltas.append(a if base is None else a - base)
    ratio_sq = sum(float(np.sum(d * d)) for d in deltas) / (c * c)
    head_items = None
    if head_update is not None:
        ch = c if head_clipping_norm is None else check_clipping_norm(head_clipping_norm)
        head_items = _items(head_update)
        ratio_sq += sum(float(np.sum(h * h)) for _, h in head_items) / (ch * ch)
    scale = min(1.0, 1.0 / math.sqrt(ratio_sq)) if ratio_sq > 0 else 1.0
    clipped = []
    for (name, _), d in zip(layers, deltas, strict=True):
        base = prev.get(name)
        clipped.append((name, scale * d if base is None else base + scale * d))
    out_A = clipped[0][1] if single else {name: a for name, a in clipped}
    out_head = None
    if head_update is not None:
        out_head = _rebuild(head_update, [(k, scale * h) for k, h in head_items or []])
    return out_A, out_head


def clip_florg(A: Any, clipping_norm: float, prev_A: Any = None) -> Any:
    """A (one r x k matrix, or a mapping layer -> A clipped jointly over the layers) scaled
    so that ||A||_F <= C (``prev_A`` None), or prev_A + (A - prev_A) scaled so that
    ||A - prev_A||_F <= C.  Hence ||A^T A||_F <= ||A||_F^2 <= C^2 for the former, and the
    sensitivities of ``florg_sensitivity`` for either.

    Which unit: the Gram aggregation sums A_n^T A_n, a function of A itself, so clipping A
    (the first proposal, Delta = C^2, independent of the state) is the direct choice.  It
    is a poor one in practice: A carries the whole learned adapter (A_prev, public, plus
    this round's change), so either C >= ||A_prev||_F every round, and the noise z C^2 / m
    is relative to the whole model rather than to the round's change, or clipping shrinks
    A_prev itself every round and the model decays geometrically.  Clipping the update
    D = A - A_prev (as every mean method and Flower clip, and as screening measures it)
    bounds what one client changes; it costs a state-dependent but public sensitivity
    C (2 ||A_prev||_2 + C), which for C << ||A_prev|| is about 2 ||A_prev||_2 C, far below
    ||A_prev||_F^2.  Both are implemented; the recommended one, and the default of
    ``private_florg_layers``, is the update (``centred=True``).
    """
    return clip_florg_with_head(A, None, clipping_norm, prev_A=prev_A)[0]


def symmetric_noise(k: int, std: float, rng: np.random.Generator) -> np.ndarray:
    """Analyze-Gauss noise (Dwork, Talwar, Thakurta, Zhang 2014): a k x k symmetric E whose
    upper triangle, diagonal included, is iid N(0, std^2), drawn in ``np.triu_indices(k)``
    order, and mirrored below (exactly symmetric)."""
    iu = np.triu_indices(k)
    E = np.zeros((k, k))
    E[iu] = rng.normal(0.0, std, iu[0].size)
    return E + np.triu(E, 1).T


def noised_gram_sum(
    clipped_As: Sequence[Any],
    clipping_norm: float,
    noise_multiplier: float,
    rng: np.random.Generator,
    *,
    prev_A: Any = None,
    sensitivity: float | None = None,
    num_sampled: float | None = None,
) -> np.ndarray:
    """(sum_n A_n^T A_n + E) / m for one layer: the Gram sum plus symmetric Gaussian noise E
    (``symmetric_noise`` with std z Delta), divided by m, i.e. the noised mean Gram matrix
    (k x k, symmetric, indefinite in general).

    Delta is ``florg_sensitivity(C, prev_A)`` (C^2 when the A_n were clipped themselves,
    C (2 ||prev_A||_2 + C) when their updates were), or ``sensitivity`` when given: for
    layers clipped jointly pass the multi-layer value (max over the layers' ||P_l||_2).
    With the update clipped the statistic is P^T P + (sum_n g(D_n) + E) / m
    (``noised_mean_gram``), which equals the mean Gram + E / m when m is the number of
    inputs.  ``num_sampled`` as for ``noised_mean``.  Inputs must be clipped (checked per
    layer: ||A_n - prev_A||_F <= C or ||A_n||_F <= C).
    """
    c = check_clipping_norm(clipping_norm)
    z = check_noise_multiplier(noise_multiplier, allow_zero=True)
    if len(clipped_As) == 0:
        raise ValueError("noised_gram_sum: no client matrices")
    mats = [as_float64_matrix(a, f"A[client {i}]") for i, a in enumerate(clipped_As)]
    prev = None if prev_A is None else as_float64_matrix(prev_A, "prev_A")
    k = mats[0].shape[1]
    for i, a in enumerate(mats):
        if a.shape != mats[0].shape or (prev is not None and a.shape != prev.shape):
            raise ValueError(f"A[client {i}]: shape {a.shape} differs")
        norm = float(np.linalg.norm(a if prev is None else a - prev))
        _check_clipped(norm, c, f"A[client {i}]" + ("" if prev is None else " - prev_A"))
    m = public_divisor(num_sampled, len(mats))
    delta = florg_sensitivity(c, prev) if sensitivity is None else float(sensitivity)
    noise = symmetric_noise(k, z * delta, rng)
    return noised_mean_gram(mats, noise, m, prev)


def _symmetric_product(X: np.ndarray) -> np.ndarray:
    """X^T X made exactly symmetric (BLAS may round the two triangles differently)."""
    g = X.T @ X
    return (g + g.T) / 2


def noised_mean_gram(
    mats: Sequence[np.ndarray], noise: np.ndarray, m: float, prev: np.ndarray | None
) -> np.ndarray:
    """The released Q^ from the clipped matrices and the noise E (std on the SUM):
    (sum_n A_n^T A_n + E) / m, or, with the update clipped (``prev`` = P),
    P^T P + (sum_n (A_n^T A_n - P^T P) + E) / m -- the sum of the clients' terms g(D_n) that
    the sensitivity bounds, so that a missing client (fewer matrices than m) counts as one
    that did not move, as in ``noised_mean``.  Both equal the mean Gram + E / m when there
    are m matrices.  Exactly symmetric."""
    gram = _symmetric_product(np.concatenate(mats))
    if prev is None:
        return (gram + noise) / m
    base = _symmetric_product(prev)
    return (gram - len(mats) * base + noise) / m + base


def private_step_rank(r: int | None, prev_rows: int) -> int:
    """The rank the private step keeps: ``r`` (None: prev_A's ``prev_rows``), checked to lie
    in 1..prev_rows (the numpy and the torch step share this check)."""
    r = prev_rows if r is None else int(r)
    if not 1 <= r <= prev_rows:
        raise ValueError(f"rank r={r} must be between 1 and prev_A's {prev_rows} rows")
    return r


def florg_private_step(
    noised_Q: Any, prev_A: Any, r: int | None = None, *, procrustes: bool = True
) -> tuple[np.ndarray, dict[str, float | int]]:
    """FLoRG's decomposition and Procrustes on a noised mean Gram matrix (post-processing).

    eigh of the k x k matrix, eigenvalues in descending order; the top r are kept, those not
    above k eps lambda_1 (the non-positive ones, up to rounding; the noise makes Q
    indefinite) are dropped, giving r' <= r rows A~ = Lambda^{1/2} P (signs fixed by the
    largest entry of each row), then Theorem 1: S = U V^T from the thin SVD of
    A_prev A~^T (r x r', orthonormal columns) and A_new = S A~ -- the 'truncate' policy of
    ``strategies.florg.rule`` (Eckart-Young rank-r approximation of the noised Q, the only one
    that makes sense once Q has full rank from the noise).  ``procrustes=False``: the
    paper's ablation, the top rows of A~ zero-padded.

    Why the thin path of strategies/florg/rule.py cannot be used: it never forms Q, taking Q's
    eigenpairs from the N r x N r matrix G = M M^T of the stacked client matrices M, which
    works because Q = M^T M has rank <= N r and its eigenvectors lie in the row space of M.
    Q + E/m has no such factor: E is full rank and indefinite, the eigenvectors of the
    noised Q leave the clients' row space (they must -- eigenvectors confined to the span
    of the clients' rows would publish that span exactly), and noising M instead would be
    noise per client, i.e. local DP.  So the k x k eigendecomposition, O(k^3) per layer,
    is the price (batched over layers in ``strategies.florg.dp_torch``).

    Returns (A_new with prev_A's shape, info: ``rank`` r', ``dropped`` (r - r', top-r
    eigenvalues dropped as non-positive), ``eigengap`` lambda_r - lambda_{r+1},
    ``negative_eigenvalues`` (how many of Q's are < 0, a gauge of the noise), ``drift``).
    """
    Q = as_float64_matrix(noised_Q, "noised_Q")
    prev = as_float64_matrix(prev_A, "prev_A")
    k = Q.shape[0]
    if Q.shape != (k, k) or prev.shape[1] != k:
        raise ValueError(f"noised_Q {Q.shape} and prev_A {prev.shape} do not match (k x k, r x k)")
    r = private_step_rank(r, prev.shape[0])
    lam, vecs = np.linalg.eigh((Q + Q.T) / 2)
    lam, vecs = lam[::-1], vecs[:, ::-1]
    r_prime = int(np.count_nonzero(lam[:r] > k * EPS64 * lam[0])) if lam[0] > 0 else 0
    A_tilde = _canonical_signs(np.sqrt(lam[:r_prime])[:, None] * vecs[:, :r_prime].T)
    if procrustes:
        new_A = procrustes_rotation(prev, A_tilde) @ A_tilde
    else:
        new_A = np.zeros_like(prev)
        new_A[:r_prime] = A_tilde
    lam_pad = np.concatenate([lam, [0.0]])
    info: dict[str, float | int] = {
        "rank": r_prime,
        "dropped": r - r_prime,
        "eigengap": float(lam_pad[r - 1] - lam_pad[r]),
        "negative_eigenvalues": int(np.count_nonzero(lam < 0)),
        "drift": float(np.linalg.norm(new_A - prev)),
    }
    return new_A, info


def _florg_inputs(
    clipped_client_As: Mapping[str, Sequence[Any]],
    prev_As: Mapping[str, Any],
    clipping_norm: float,
    noise_multiplier: float,
    centred: bool,
    num_sampled: float | None,
) -> tuple[dict[str, list[np.ndarray]], dict[str, np.ndarray], int, float, float]:
    """Checked inputs of ``private_florg_layers`` (and of its torch twin): (mats, prevs, n,
    m, std), every client's joint clipping verified; ``std`` = z Delta is the noise std on
    the Gram SUM, one Delta for all layers (``florg_sensitivity`` over the whole ``prevs``
    when centred, C^2 otherwise)."""
    c = check_clipping_norm(clipping_norm)
    z = check_noise_multiplier(noise_multiplier, allow_zero=True)
    if not prev_As or set(prev_As) != set(clipped_client_As):
        raise ValueError("clipped_client_As and prev_As must name the same, non-empty layers")
    prevs = {name: as_float64_matrix(p, f"prev_A[{name}]") for name, p in prev_As.items()}
    counts = {len(clipped_client_As[name]) for name in prevs}
    if len(counts) != 1 or 0 in counts:
        raise ValueError(f"every layer needs the same number (>= 1) of clients, got {counts}")
    n = counts.pop()
    mats: dict[str, list[np.ndarray]] = {}
    for name, prev in prevs.items():
        mats[name] = [
            as_float64_matrix(a, f"{name}[client {i}]")
            for i, a in enumerate(clipped_client_As[name])
        ]
        for i, a in enumerate(mats[name]):
            if a.shape != prev.shape:
                raise ValueError(f"{name}[client {i}]: shape {a.shape}, prev_A {prev.shape}")
    for i in range(n):
        sq = sum(
            float(np.sum((mats[name][i] - prev if centred else mats[name][i]) ** 2))
            for name, prev in prevs.items()
        )
        what = f"client {i}: " + ("sum over layers of ||A - prev_A||" if centred else "||A||")
        _check_clipped(math.sqrt(sq), c, what)
    m = public_divisor(num_sampled, n)
    delta = florg_sensitivity(c, prevs if centred else None)
    return mats, prevs, n, m, z * delta


def layer_noise(
    prevs: Mapping[str, np.ndarray], std: float, rng: np.random.Generator
) -> dict[str, np.ndarray]:
    """Each layer's symmetric noise (std on the Gram SUM), drawn in ``prevs`` order: the one
    order both the numpy and the torch path use, so that the same rng gives the same E."""
    return {name: symmetric_noise(prev.shape[1], std, rng) for name, prev in prevs.items()}


def private_florg_layers(
    clipped_client_As: Mapping[str, Sequence[Any]],
    prev_As: Mapping[str, Any],
    clipping_norm: float,
    noise_multiplier: float,
    rng: np.random.Generator,
    *,
    centred: bool = True,
    num_sampled: float | None = None,
    procrustes: bool = True,
) -> tuple[dict[str, np.ndarray], dict[str, dict[str, float | int]]]:
    """The private FLoRG server step for every layer (numpy reference).

    ``clipped_client_As``: layer -> the clients' A_n, same client order per layer, each
    client already clipped jointly over all layers by ``clip_florg`` / ``clip_florg_with_head``
    (with ``prev_A=prev_As`` when ``centred``; verified here).  One Delta for all layers
    (``florg_sensitivity`` over the whole ``prev_As`` when centred, C^2 otherwise), noise
    drawn by ``layer_noise``, Q^_l by ``noised_mean_gram``, then
    ``florg_private_step`` per layer.  A sign-block variant: pass each sign block of each layer as
    its own entry (its blocks partition A's rows, so the joint bound is the same).
    Returns (layer -> new A, layer -> info, with ``noise_std``, the std on Q^'s entries).
    """
    mats, prevs, _, m, std = _florg_inputs(
        clipped_client_As, prev_As, clipping_norm, noise_multiplier, centred, num_sampled
    )
    noise = layer_noise(prevs, std, rng)
    new_As: dict[str, np.ndarray] = {}
    infos: dict[str, dict[str, float | int]] = {}
    for name, prev in prevs.items():
        Q = noised_mean_gram(mats[name], noise[name], m, prev if centred else None)
        new_As[name], infos[name] = florg_private_step(Q, prev, procrustes=procrustes)
        infos[name]["noise_std"] = std / m
    return new_As, infos
