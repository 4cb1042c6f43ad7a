"""FLoRG's buffered step (round-mode=async): the Gram average moved by each stale reply's
Gram delta, decomposed without forming Q, against the dense computation on random inputs;
with every reply fresh it is the synchronous step."""

from __future__ import annotations

import numpy as np
import pytest

from strategies.florg.buffered_rule import aggregate_florg_buffered, decompose_signed_gram
from strategies.florg.rule import aggregate_florg, procrustes_rotation
from strategies.server.buffered_update import staleness_factor


def random_As(rng: np.random.Generator, n: int, r: int, k: int) -> list[np.ndarray]:
    return [rng.normal(size=(r, k)) for _ in range(n)]


@pytest.mark.parametrize("k", [3, 24])  # stacked rows above k, and below it (the thin path)
def test_the_signed_gram_decomposition_is_the_dense_one(k: int):
    rng = np.random.default_rng(0)
    M = rng.normal(size=(10, k))
    signs = np.array([1.0] * 6 + [-1.0] * 4)
    lam, A_tilde, negative = decompose_signed_gram(M, signs, 1e-12)
    Q = M.T @ (signs[:, None] * M)
    dense = np.sort(np.linalg.eigvalsh(Q))[::-1]
    assert np.allclose(lam[: min(10, k)], np.clip(dense, 0, None)[: min(10, k)], atol=1e-9)
    positive = np.clip(dense, 0, None)
    assert np.allclose(A_tilde.T @ A_tilde, _psd_part(Q), atol=1e-9)
    assert negative == pytest.approx(-dense[dense < 0].sum() / np.abs(dense).sum())
    assert positive.sum() > 0


def _psd_part(Q: np.ndarray) -> np.ndarray:
    lam, P = np.linalg.eigh(Q)
    return (P * np.clip(lam, 0, None)) @ P.T


def test_a_buffered_step_decomposes_the_moved_gram_average():
    """Q = A_curᵀA_cur + Σ wₙcₙ(AₙᵀAₙ − A_τₙᵀA_τₙ), formed densely; under 'truncate'
    A_newᵀA_new is Q's top-r eigenpart and A_new that factor aligned with A_cur."""
    rng = np.random.default_rng(1)
    r, k, n = 3, 20, 4
    current = rng.normal(size=(r, k))
    clients, starts = random_As(rng, n, r, k), random_As(rng, n, r, k)
    weights = np.array([1.0, 2.0, 1.0, 4.0])
    staleness = [0, 1, 3, 2]
    factors = [staleness_factor(t, 0.5) for t in staleness]
    new, info = aggregate_florg_buffered(
        clients, starts, weights, factors, current, rank_mismatch="truncate"
    )
    w = weights / weights.sum()
    moves = zip(w, factors, clients, starts, strict=True)
    Q = current.T @ current + sum(wi * c * (a.T @ a - s.T @ s) for wi, c, a, s in moves)
    lam, P = np.linalg.eigh(Q)
    lam, P = lam[::-1], P[:, ::-1]
    top = (P[:, :r] * np.clip(lam[:r], 0, None)) @ P[:, :r].T
    assert np.allclose(new.T @ new, top, atol=1e-8)
    # aligned: no other rotation of the same rows is closer to the current A
    A_tilde = np.sqrt(np.clip(lam[:r], 0, None))[:, None] * P[:, :r].T
    aligned = procrustes_rotation(current, A_tilde) @ A_tilde
    assert np.allclose(new, aligned, atol=1e-8)
    assert info["negative_share"] == pytest.approx(-lam[lam < 0].sum() / np.abs(lam).sum())


def test_with_every_reply_fresh_it_is_the_synchronous_step():
    rng = np.random.default_rng(2)
    r, k = 2, 16
    current = rng.normal(size=(r, k))
    clients = random_As(rng, 3, r, k)
    buffered, _ = aggregate_florg_buffered(clients, [current] * 3, None, [1.0] * 3, current)
    synchronous, _ = aggregate_florg(clients, None, current)
    assert np.allclose(buffered, synchronous, atol=1e-9)


def test_staleness_discounts_a_reply():
    assert staleness_factor(0, 0.5) == 1.0
    assert staleness_factor(3, 0.5) == pytest.approx(0.5)
    assert staleness_factor(5, 0.0) == 1.0
