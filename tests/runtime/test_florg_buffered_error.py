"""FLoRG's buffered step (strategies/florg/buffered_rule.py) reports ``gram_rel_error``
against the signed Q it decomposes, ‖A_newᵀA_new − Q‖_F / ‖Q‖_F, not against Q's positive
part: checked against a dense float64 computation where Q has negative eigenvalues."""

from __future__ import annotations

import numpy as np
import pytest

from strategies.florg.buffered_rule import aggregate_florg_buffered
from strategies.server.buffered_update import staleness_factor


def buffered_inputs(k: int, seed: int):
    """A buffer of stale replies, each from a start of its own: in some directions their
    Gram deltas remove more than A_curᵀA_cur holds, so Q has a negative part."""
    rng = np.random.default_rng(seed)
    r, n = 3, 4
    current = 0.5 * rng.normal(size=(r, k))
    clients = [0.5 * rng.normal(size=(r, k)) for _ in range(n)]
    starts = [0.5 * rng.normal(size=(r, k)) for _ in range(n)]
    weights = np.array([1.0, 2.0, 1.0, 3.0])
    factors = [staleness_factor(t, 0.5) for t in (1, 2, 0, 3)]
    w = weights / weights.sum()
    moves = zip(w, factors, clients, starts, strict=True)
    Q = current.T @ current + sum(wi * c * (a.T @ a - s.T @ s) for wi, c, a, s in moves)
    return (clients, starts, weights, factors, current), Q


@pytest.mark.parametrize("k", [5, 40])  # stacked rows above k (Q decomposed), below (thin)
@pytest.mark.parametrize(
    ("procrustes", "rank_mismatch"),
    [(True, "procrustes"), (True, "truncate"), (False, "procrustes")],
)
def test_gram_rel_error_is_measured_against_the_signed_gram(k, procrustes, rank_mismatch):
    (clients, starts, weights, factors, current), Q = buffered_inputs(k, seed=k)
    new, info = aggregate_florg_buffered(
        clients, starts, weights, factors, current,
        procrustes=procrustes, rank_mismatch=rank_mismatch,
    )  # fmt: skip
    lam = np.linalg.eigvalsh(Q)
    assert lam.min() < -1e-3 * lam.max()  # a real negative part
    expected = np.linalg.norm(new.T @ new - Q) / np.linalg.norm(Q)
    assert info["gram_rel_error"] == pytest.approx(expected, rel=1e-9)
    positive = (lambda w, P: (P * np.clip(w, 0, None)) @ P.T)(*np.linalg.eigh(Q))
    against_positive = np.linalg.norm(new.T @ new - positive) / np.linalg.norm(positive)
    assert info["gram_rel_error"] > against_positive
    assert info["negative_share"] == pytest.approx(-lam[lam < 0].sum() / np.abs(lam).sum())
