"""Issue 30: the baselines for clients of different rank, HetLoRA's and FlexLoRA's rules
(strategies/hetlora/rule.py, strategies/flexlora/rule.py), against references and their reductions
to known rules at equal ranks."""

from __future__ import annotations

import numpy as np
import pytest

from flower_app.wire.ranks import truncate_to_rank
from strategies.federa.rule import aggregate_federa
from strategies.fedit.rule import aggregate_fedit
from strategies.flexlora.rule import aggregate_flexlora
from strategies.hetlora.rule import aggregate_hetlora
from strategies.shared.validation import AggregationInputError

D_OUT, D_IN = 7, 9


def factors(ranks, seed=0):
    rng = np.random.default_rng(seed)
    Bs = [rng.standard_normal((D_OUT, r)) for r in ranks]
    As = [rng.standard_normal((r, D_IN)) for r in ranks]
    return Bs, As


def test_hetlora_with_equal_ranks_is_fedit_exactly():
    Bs, As = factors([3, 3, 3])
    w = [0.2, 0.5, 0.3]
    B, A = aggregate_hetlora(Bs, As, w)
    B_ref, A_ref = aggregate_fedit(Bs, As, w)
    np.testing.assert_array_equal(B, B_ref)
    np.testing.assert_array_equal(A, A_ref)


def test_hetlora_zero_pads_to_the_largest_rank():
    Bs, As = factors([1, 2, 4])
    w = np.array([0.5, 0.25, 0.25])
    B, A = aggregate_hetlora(Bs, As, w)
    assert B.shape == (D_OUT, 4) and A.shape == (4, D_IN)
    for i in range(4):  # direction i averages over every client, absent ones as zero
        col = sum(wn * (b[:, i] if b.shape[1] > i else 0) for wn, b in zip(w, Bs, strict=True))
        row = sum(wn * (a[i] if a.shape[0] > i else 0) for wn, a in zip(w, As, strict=True))
        np.testing.assert_allclose(B[:, i], col, rtol=1e-14)
        np.testing.assert_allclose(A[i], row, rtol=1e-14)
    B8, A8 = aggregate_hetlora(Bs, As, w, rank=8)  # a larger global rank: zero beyond 4
    np.testing.assert_array_equal(B8[:, :4], B)
    np.testing.assert_array_equal(A8[4:], 0)


def test_hetlora_refuses_mismatched_factors():
    Bs, As = factors([2, 3])
    with pytest.raises(AggregationInputError, match="client 1"):
        aggregate_hetlora(Bs, [As[0], As[0]], None)
    with pytest.raises(AggregationInputError, match="exceeds the padded rank"):
        aggregate_hetlora(Bs, As, None, rank=2)


def dense_reference(Bs, As, w, r):
    """sum w B A formed densely, float64 SVD, symmetric split at rank r."""
    w = np.asarray(w) / np.sum(w)
    delta = sum(wn * b @ a for wn, b, a in zip(w, Bs, As, strict=True))
    U, s, Vt = np.linalg.svd(delta)
    return delta, U[:, :r] * np.sqrt(s[:r]), np.sqrt(s[:r])[:, None] * Vt[:r], s


@pytest.mark.parametrize("ranks", [[1, 2, 4], [2, 2, 8], [3]])
@pytest.mark.parametrize("r", [1, 2, 4])
def test_flexlora_equals_a_dense_float64_svd(ranks, r):
    Bs, As = factors(ranks, seed=sum(ranks) + r)
    w = np.linspace(1.0, 2.0, len(ranks))
    B, A, info = aggregate_flexlora(Bs, As, w, rank=r)
    delta, B_ref, A_ref, s = dense_reference(Bs, As, w, r)
    assert B.shape == (D_OUT, r) and A.shape == (r, D_IN)
    np.testing.assert_allclose(B @ A, B_ref @ A_ref, atol=1e-12)
    # symmetric split: B^T B = A A^T = S_r (each column / row carries sqrt(s_i))
    np.testing.assert_allclose(B.T @ B, np.diag(s[:r]), atol=1e-12)
    np.testing.assert_allclose(A @ A.T, np.diag(s[:r]), atol=1e-12)
    err = np.linalg.norm(delta - B @ A) / np.linalg.norm(delta)
    assert info["trunc_rel_error"] == pytest.approx(err, abs=1e-12)


def test_flexlora_truncation_is_each_clients_own_svd():
    Bs, As = factors([2, 4, 6], seed=3)
    B6, A6, _ = aggregate_flexlora(Bs, As, None, rank=6)
    for r in (2, 4):
        B, A, _ = aggregate_flexlora(Bs, As, None, rank=r)
        mine = truncate_to_rank({"l.lora_B": B6, "l.lora_A": A6}, r)
        np.testing.assert_allclose(mine["l.lora_B"] @ mine["l.lora_A"], B @ A, atol=1e-12)


def test_flexlora_with_equal_ranks_is_federas_refactoring():
    Bs, As = factors([3, 3, 3], seed=5)
    w = [0.2, 0.3, 0.5]
    B, A, info = aggregate_flexlora(Bs, As, w, rank=3)
    B_ref, A_ref, ref_info = aggregate_federa(Bs, As, w)
    np.testing.assert_array_equal(B, B_ref)
    np.testing.assert_array_equal(A, A_ref)
    assert info["trunc_rel_error"] == ref_info["trunc_rel_error"]


def test_flexlora_pads_a_product_of_lower_rank():
    Bs, As = factors([1, 1], seed=7)
    B, A, info = aggregate_flexlora(Bs, As, None, rank=4)
    assert B.shape == (D_OUT, 4) and np.all(B[:, 2:] == 0) and np.all(A[2:] == 0)
    delta = 0.5 * (Bs[0] @ As[0] + Bs[1] @ As[1])
    np.testing.assert_allclose(B @ A, delta, atol=1e-12)
    assert info["trunc_rel_error"] == pytest.approx(0.0, abs=1e-12)
