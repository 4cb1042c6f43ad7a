"""The five baselines' aggregation rules against dense float64 references."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from strategies.federa.rule import aggregate_federa
from strategies.fedex_lora.rule import aggregate_fedex_lora
from strategies.fedit.rule import aggregate_fedit
from strategies.fedsa_lora.rule import aggregate_fedsa_lora
from strategies.ffa_lora.rule import aggregate_ffa_lora


def lora_clients(rng, n, d_out, d_in, r):
    Bs = [rng.standard_normal((d_out, r)) for _ in range(n)]
    As = [rng.standard_normal((r, d_in)) for _ in range(n)]
    return Bs, As


def dense_avg_product(Bs, As, w):
    w = np.asarray(w, float) / np.sum(w)
    return sum(wn * b @ a for wn, b, a in zip(w, Bs, As, strict=True))


def rel(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


dims = st.tuples(
    st.integers(1, 5),
    st.integers(3, 30),
    st.integers(3, 30),
    st.integers(1, 3),
    st.integers(0, 2**31 - 1),
)


def test_fedit_is_biased():
    """avg(B) avg(A) != avg(B A): the error FLoRG removes."""
    rng = np.random.default_rng(0)
    Bs, As = lora_clients(rng, 3, 12, 8, 2)
    B, A = aggregate_fedit(Bs, As, [1, 2, 3])
    w = np.array([1, 2, 3]) / 6
    np.testing.assert_allclose(B, sum(wn * b for wn, b in zip(w, Bs, strict=True)), rtol=1e-13)
    np.testing.assert_allclose(A, sum(wn * a for wn, a in zip(w, As, strict=True)), rtol=1e-13)
    assert rel(B @ A, dense_avg_product(Bs, As, w)) > 0.1


@settings(max_examples=40, deadline=None)
@given(dims, st.sampled_from(["dense", "factored"]))
def test_fedex_update_is_exactly_avg_product(dim, mode):
    n, d_out, d_in, r, seed = dim
    rng = np.random.default_rng(seed)
    Bs, As = lora_clients(rng, n, d_out, d_in, r)
    w = rng.random(n) + 0.05
    B, A, residual = aggregate_fedex_lora(Bs, As, w, residual_mode=mode)
    target = dense_avg_product(Bs, As, w)
    assert B.shape == (d_out, r) and A.shape == (r, d_in)
    assert np.linalg.norm(B @ A + residual.to_dense() - target) <= 1e-12 * np.linalg.norm(target)


def test_fedex_factored_residual_equals_dense_and_is_smaller():
    rng = np.random.default_rng(1)
    n, d_out, d_in, r = 4, 64, 48, 2
    Bs, As = lora_clients(rng, n, d_out, d_in, r)
    _, _, dense = aggregate_fedex_lora(Bs, As, None, "dense")
    _, _, fact = aggregate_fedex_lora(Bs, As, None, "factored")
    assert fact.P.shape == (d_out, (n + 1) * r) and fact.Q.shape == ((n + 1) * r, d_in)
    assert np.linalg.norm(fact.P @ fact.Q - dense.dense) <= 1e-13 * np.linalg.norm(dense.dense)
    assert fact.num_params == (n + 1) * r * (d_out + d_in) < dense.num_params == d_out * d_in
    assert np.linalg.matrix_rank(dense.dense) <= (n + 1) * r


@settings(max_examples=40, deadline=None)
@given(dims)
def test_federa_exact_when_rank_fits(dim):
    n, d_out, d_in, r, seed = dim
    rng = np.random.default_rng(seed)
    # All clients share the column space of B and row space of A -> rank(avg BA) <= r.
    Ub = rng.standard_normal((d_out, r))
    Va = rng.standard_normal((r, d_in))
    Bs = [Ub @ rng.standard_normal((r, r)) for _ in range(n)]
    As = [rng.standard_normal((r, r)) @ Va for _ in range(n)]
    w = rng.random(n) + 0.05
    B, A, info = aggregate_federa(Bs, As, w)
    target = dense_avg_product(Bs, As, w)
    assert B.shape == (d_out, r) and A.shape == (r, d_in)
    assert np.linalg.norm(B @ A - target) <= 1e-10 * np.linalg.norm(target)
    assert info["trunc_rel_error"] < 1e-10


def test_federa_is_best_rank_r_and_splits_singular_values_evenly():
    rng = np.random.default_rng(2)
    Bs, As = lora_clients(rng, 5, 20, 14, 3)
    B, A, info = aggregate_federa(Bs, As, None)
    target = dense_avg_product(Bs, As, np.ones(5))
    U, s, Vt = np.linalg.svd(target)
    best = (U[:, :3] * s[:3]) @ Vt[:3]
    assert rel(B @ A, best) < 1e-10
    np.testing.assert_allclose(np.linalg.norm(B, axis=0), np.sqrt(s[:3]), rtol=1e-10)
    np.testing.assert_allclose(np.linalg.norm(A, axis=1), np.sqrt(s[:3]), rtol=1e-10)
    assert info["rank"] == 14
    assert info["trunc_rel_error"] == pytest.approx(np.sqrt(np.sum(s[3:] ** 2) / np.sum(s**2)))


def test_ffa_lora_is_exact_with_shared_frozen_A():
    rng = np.random.default_rng(3)
    A = rng.standard_normal((2, 9))
    Bs = [rng.standard_normal((7, 2)) for _ in range(4)]
    w = [1, 1, 2, 4]
    B = aggregate_ffa_lora(Bs, w)
    assert rel(B @ A, dense_avg_product(Bs, [A] * 4, w)) < 1e-13


def test_fedsa_lora_averages_A_only():
    rng = np.random.default_rng(4)
    As = [rng.standard_normal((2, 9)) for _ in range(3)]
    A = aggregate_fedsa_lora(As, [3, 1, 1])
    np.testing.assert_allclose(A, (3 * As[0] + As[1] + As[2]) / 5, rtol=1e-13)
    assert A.shape == (2, 9)


def test_federa_and_fedex_transposes_on_non_square_layers():
    """B is d_out x r and A is r x d_in; swapping them must be rejected, not silently used."""
    rng = np.random.default_rng(5)
    Bs, As = lora_clients(rng, 2, 30, 7, 2)
    B, A, _ = aggregate_federa(Bs, As, None)
    assert B.shape == (30, 2) and A.shape == (2, 7)
    with pytest.raises(ValueError, match="B's columns must equal A's rows"):
        aggregate_federa([b.T for b in Bs], [a.T for a in As], None)
    with pytest.raises(ValueError, match="B's columns must equal A's rows"):
        aggregate_fedex_lora(As, Bs, None)
