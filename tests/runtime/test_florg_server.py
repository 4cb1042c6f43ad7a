"""FLoRG server step against dense float64 references built here."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from strategies.florg.rule import aggregate_florg, aggregate_florg_reference, procrustes_rotation


def dense_gram(As: list[np.ndarray], w: np.ndarray) -> np.ndarray:
    return sum(wn * a.T @ a for wn, a in zip(w / w.sum(), As, strict=True))


def rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-300))


def clients(rng: np.random.Generator, n: int, r: int, k: int, scale: float = 0.3):
    prev = rng.standard_normal((r, k)) * scale
    As = [prev + 0.1 * scale * rng.standard_normal((r, k)) for _ in range(n)]
    return As, prev


shapes = st.tuples(
    st.integers(1, 5),  # N clients
    st.integers(1, 6),  # r
    st.integers(6, 40),  # k
    st.integers(0, 2**31 - 1),  # seed
)


@settings(max_examples=60, deadline=None)
@given(shapes, st.booleans())
def test_thin_path_equals_reference(shape, procrustes):
    n, r, k, seed = shape
    rng = np.random.default_rng(seed)
    As, prev = clients(rng, n, r, k)
    w = rng.random(n) + 0.1
    thin, info = aggregate_florg(As, w, prev, procrustes=procrustes)
    ref, ref_info = aggregate_florg_reference(As, w, prev, procrustes=procrustes)
    assert thin.shape == prev.shape
    assert rel(thin, ref) < 1e-10
    assert info["rank"] == ref_info["rank"] == min(n * r, k)
    for key in ("gram_rel_error", "drift"):
        assert abs(info[key] - ref_info[key]) < 1e-10 * max(1.0, abs(ref_info[key]))


@settings(max_examples=60, deadline=None)
@given(shapes)
def test_gram_is_exact_when_rank_fits(shape):
    n, r, k, seed = shape
    rng = np.random.default_rng(seed)
    # r' <= r: clients share a row space of dimension r_true <= r.
    r_true = int(rng.integers(1, r + 1))
    basis = rng.standard_normal((r_true, k))
    As = [rng.standard_normal((r, r_true)) @ basis for _ in range(n)]
    prev = rng.standard_normal((r, k))
    w = rng.random(n) + 0.1
    new_A, info = aggregate_florg(As, w, prev)
    Q = dense_gram(As, w)
    assert info["rank"] == np.linalg.matrix_rank(Q) <= r
    assert rel(new_A.T @ new_A, Q) < 1e-10
    assert info["gram_rel_error"] < 1e-10


def test_gram_error_diagnostic_matches_dense_when_truncated():
    rng = np.random.default_rng(1)
    As, prev = clients(rng, 6, 3, 20)
    new_A, info = aggregate_florg(As, None, prev)
    Q = dense_gram(As, np.ones(6))
    assert info["rank"] == 18 > 3
    assert info["gram_rel_error"] == pytest.approx(rel(new_A.T @ new_A, Q), rel=1e-9)
    assert info["drift"] == pytest.approx(np.linalg.norm(new_A - prev), rel=1e-12)


@pytest.mark.parametrize("n,r,k", [(1, 4, 12), (3, 4, 30), (8, 2, 10)])
def test_procrustes_is_optimal(n, r, k):
    """Theorem 1: S* maximises tr(A_prev A~^T S^T) over S with orthonormal rows or columns;
    for r' <= r that is also the minimum of ||S A~ - A_prev||_F (problem P1)."""
    rng = np.random.default_rng(n * 100 + k)
    As, prev = clients(rng, n, r, k)
    new_A, info = aggregate_florg(As, None, prev)
    Q = dense_gram(As, np.ones(n))
    lam, vecs = np.linalg.eigh(Q)
    keep = lam > 1e-12 * lam.max()
    A_tilde = np.sqrt(lam[keep])[:, None] * vecs[:, keep].T  # any valid factor of Q
    r_prime = A_tilde.shape[0]
    best_align = np.trace(prev @ new_A.T)
    best_dist = np.linalg.norm(new_A - prev)
    for _ in range(2000):
        G = rng.standard_normal((max(r, r_prime), min(r, r_prime)))
        orth, _ = np.linalg.qr(G)
        S = orth if r >= r_prime else orth.T  # r x r'
        assert np.trace(prev @ (S @ A_tilde).T) <= best_align + 1e-12
        if r_prime <= r:
            assert np.linalg.norm(S @ A_tilde - prev) >= best_dist - 1e-12
    # And new_A is S* A~ for Theorem 1's S* = U V^T computed from this independent factor.
    U, _, Vt = np.linalg.svd(prev @ A_tilde.T, full_matrices=False)
    S_star = U @ Vt
    np.testing.assert_allclose(S_star @ A_tilde, new_A, atol=1e-10)


def test_procrustes_does_not_minimise_the_distance_when_r_prime_exceeds_r():
    """For r' > r, ||S A~||_F depends on S, so the trace optimum S* = U V^T is not the
    distance optimum (the docstring's correction): a counterexample with r = 1, r' = 2."""
    A_tilde = np.array([[10.0, 0.0], [0.0, 1.0]])  # rows orthogonal, norms^2 = eigenvalues
    prev = np.array([[1.0, 1.0]])
    S_star = procrustes_rotation(prev, A_tilde)
    np.testing.assert_allclose(S_star @ S_star.T, np.eye(1), atol=1e-15)
    other = np.array([[0.0, 1.0]])  # also orthonormal rows
    assert np.trace(prev @ (S_star @ A_tilde).T) > np.trace(prev @ (other @ A_tilde).T)
    assert np.linalg.norm(other @ A_tilde - prev) < np.linalg.norm(S_star @ A_tilde - prev) - 1


@pytest.mark.parametrize("n,r,k", [(2, 4, 16), (1, 3, 9), (5, 2, 7)])
def test_invariant_to_eigensolver_sign_and_rotation(n, r, k):
    """Procrustes output depends on Q and A_prev only, not on the chosen factor of Q."""
    rng = np.random.default_rng(7)
    As, prev = clients(rng, n, r, k)
    new_A, _ = aggregate_florg(As, None, prev)
    # Clients' A_n -> O_n A_n with orthogonal O_n leaves every A_n^T A_n, hence Q, unchanged,
    # but changes the stacked matrix M and therefore every eigenvector choice downstream.
    rotated = [np.linalg.qr(rng.standard_normal((r, r)))[0] @ a for a in As]
    new_rot, _ = aggregate_florg(rotated, None, prev)
    assert rel(new_rot, new_A) < 1e-10
    # Flipping signs / rotating the reference factor gives the same Procrustes result too.
    Q = dense_gram(As, np.ones(n))
    lam, vecs = np.linalg.eigh(Q)
    keep = lam > 1e-12 * lam.max()
    A_tilde = np.sqrt(lam[keep])[:, None] * vecs[:, keep].T
    rot = np.linalg.qr(rng.standard_normal((A_tilde.shape[0],) * 2))[0]
    rot[:, 0] *= -1  # include a reflection (a sign flip) as well
    U, _, Vt = np.linalg.svd(prev @ (rot @ A_tilde).T, full_matrices=False)
    assert rel(U @ Vt @ rot @ A_tilde, new_A) < 1e-10


@pytest.mark.parametrize("d_out,d_in", [(24, 10), (10, 24)])
def test_non_square_layers(d_out, d_in):
    k = min(d_out, d_in)
    rng = np.random.default_rng(3)
    As, prev = clients(rng, 3, 2, k)
    new_A, info = aggregate_florg(As, [1, 2, 3], prev)
    ref, _ = aggregate_florg_reference(As, [1, 2, 3], prev)
    assert new_A.shape == (2, k)
    assert rel(new_A, ref) < 1e-10
    assert info["rank"] == 6


def test_unequal_weights_matter_and_scale_invariance():
    rng = np.random.default_rng(5)
    As, prev = clients(rng, 2, 2, 8)
    a, _ = aggregate_florg(As, [1, 1], prev)
    b, _ = aggregate_florg(As, [1, 3], prev)
    c, _ = aggregate_florg(As, [10, 30], prev)
    assert rel(a, b) > 1e-3
    assert rel(b, c) < 1e-14
    # A weight of zero removes that client entirely.
    d, _ = aggregate_florg(As, [0, 1], prev)
    e, _ = aggregate_florg(As[1:], None, prev)
    assert rel(d, e) < 1e-12


def test_single_client_identity():
    """One client, r' = r: anchored at A itself, Procrustes returns A exactly."""
    rng = np.random.default_rng(11)
    A = rng.standard_normal((4, 15))
    new_A, info = aggregate_florg([A], None, A)
    assert rel(new_A, A) < 1e-12
    assert info["rank"] == 4 and info["gram_rel_error"] < 1e-12
    # Anchored elsewhere it returns O A (same Gram) no farther from the anchor than A is.
    prev = A + 0.1 * rng.standard_normal((4, 15))
    moved, info = aggregate_florg([A], None, prev)
    assert rel(moved.T @ moved, A.T @ A) < 1e-12
    assert info["drift"] <= np.linalg.norm(A - prev) + 1e-12


def test_rank_mismatch_cases():
    rng = np.random.default_rng(2)
    r, k = 4, 12
    prev = rng.standard_normal((r, k))
    # r' < r: every client identical with rank 2
    low = rng.standard_normal((r, 2)) @ rng.standard_normal((2, k))
    new_A, info = aggregate_florg([low, low], None, prev)
    assert info["rank"] == 2 and new_A.shape == (r, k)
    assert rel(new_A.T @ new_A, low.T @ low) < 1e-10
    # r' > r: Gram approximated, reported error agrees with the dense one
    As = [rng.standard_normal((r, k)) for _ in range(3)]
    new_A, info = aggregate_florg(As, None, prev)
    assert info["rank"] == 12 > r
    Q = dense_gram(As, np.ones(3))
    assert info["gram_rel_error"] == pytest.approx(rel(new_A.T @ new_A, Q), rel=1e-9)


def test_rank_zero_gives_zero_update():
    prev = np.ones((2, 5))
    new_A, info = aggregate_florg([np.zeros((2, 5))] * 3, None, prev)
    assert info["rank"] == 0
    assert np.all(new_A == 0) and new_A.shape == (2, 5)
    assert info["gram_rel_error"] == 0.0
    assert info["drift"] == pytest.approx(np.sqrt(10))


def test_ablation_takes_top_eigen_rows():
    rng = np.random.default_rng(4)
    As, prev = clients(rng, 3, 2, 10)
    new_A, info = aggregate_florg(As, None, prev, procrustes=False)
    Q = dense_gram(As, np.ones(3))
    lam, vecs = np.linalg.eigh(Q)
    lam, vecs = lam[::-1], vecs[:, ::-1]
    expected_gram = (vecs[:, :2] * lam[:2]) @ vecs[:, :2].T
    assert rel(new_A.T @ new_A, expected_gram) < 1e-10
    np.testing.assert_allclose(np.linalg.norm(new_A, axis=1) ** 2, lam[:2], rtol=1e-10)
    assert info["eigengap"] == pytest.approx(lam[1] - lam[2], rel=1e-9)
    # Procrustes moves less than the ablation from the previous A.
    aligned, aligned_info = aggregate_florg(As, None, prev)
    assert aligned_info["drift"] < info["drift"]


def test_ablation_pads_with_zero_rows():
    rng = np.random.default_rng(6)
    low = rng.standard_normal((4, 1)) @ rng.standard_normal((1, 9))
    new_A, info = aggregate_florg([low], None, rng.standard_normal((4, 9)), procrustes=False)
    assert info["rank"] == 1
    assert np.all(new_A[1:] == 0) and np.linalg.norm(new_A[0]) > 0
    assert rel(new_A.T @ new_A, low.T @ low) < 1e-10


def test_uses_more_rows_than_columns_path():
    """N r > k switches to decomposing Q directly; still equals the reference."""
    rng = np.random.default_rng(8)
    As, prev = clients(rng, 10, 4, 12)
    w = rng.random(10)
    thin, info = aggregate_florg(As, w, prev)
    ref, _ = aggregate_florg_reference(As, w, prev)
    assert info["rank"] == 12
    assert rel(thin, ref) < 1e-10


# --- rank-mismatch policies ('procrustes', the paper's; 'truncate', Eckart-Young) -----------


def heterogeneous(rng: np.random.Generator, n: int, r: int, k: int):
    """Clients far from A_prev and from each other: r' = min(n r, k) > r."""
    return [rng.standard_normal((r, k)) for _ in range(n)], rng.standard_normal((r, k))


@pytest.mark.parametrize("n,r,k", [(3, 2, 12), (5, 4, 30), (4, 3, 9)])
def test_truncate_gives_the_best_rank_r_gram(n, r, k):
    rng = np.random.default_rng(n + r + k)
    As, prev = heterogeneous(rng, n, r, k)
    w = rng.random(n) + 0.2
    new_A, info = aggregate_florg(As, w, prev, rank_mismatch="truncate")
    Q = dense_gram(As, w)
    lam, vecs = np.linalg.eigh(Q)
    lam, vecs = lam[::-1], vecs[:, ::-1]
    optimum = np.sqrt(np.sum(lam[r:] ** 2)) / np.sqrt(np.sum(lam**2))  # Eckart-Young
    assert info["rank"] == min(n * r, k) > r
    assert info["gram_rel_error"] == pytest.approx(optimum, rel=1e-9)
    assert rel(new_A.T @ new_A, Q) == pytest.approx(optimum, rel=1e-9)
    best = (vecs[:, :r] * lam[:r]) @ vecs[:, :r].T
    assert rel(new_A.T @ new_A, best) < 1e-10
    # ... aligned to A_prev by an r x r rotation: no orthogonal matrix beats it in distance.
    for _ in range(200):
        rot = np.linalg.qr(rng.standard_normal((r, r)))[0]
        assert np.linalg.norm(rot @ new_A - prev) >= info["drift"] - 1e-12
    # The 'procrustes' policy approximates the Gram no better, but moves no farther.
    aligned, aligned_info = aggregate_florg(As, w, prev, rank_mismatch="procrustes")
    assert aligned_info["gram_rel_error"] >= info["gram_rel_error"] - 1e-12
    assert aligned_info["drift"] <= info["drift"] + 1e-12
    ref, ref_info = aggregate_florg_reference(As, w, prev, rank_mismatch="truncate")
    assert rel(new_A, ref) < 1e-10
    assert ref_info["gram_rel_error"] == pytest.approx(optimum, rel=1e-9)


@settings(max_examples=40, deadline=None)
@given(shapes)
def test_policies_are_identical_when_the_rank_fits(shape):
    n, r, k, seed = shape
    rng = np.random.default_rng(seed)
    r_true = int(rng.integers(1, r + 1))  # r' <= r
    basis = rng.standard_normal((r_true, k))
    As = [rng.standard_normal((r, r_true)) @ basis for _ in range(n)]
    prev = rng.standard_normal((r, k))
    w = rng.random(n) + 0.1
    a, info_a = aggregate_florg(As, w, prev, rank_mismatch="procrustes")
    b, info_b = aggregate_florg(As, w, prev, rank_mismatch="truncate")
    assert info_a["rank"] <= r
    np.testing.assert_array_equal(a, b)
    assert info_a == info_b


def test_policies_agree_near_a_prev_and_differ_for_heterogeneous_clients():
    rng = np.random.default_rng(21)
    n, r, k = 6, 4, 40
    # Clients a small step from A_prev: A_prev's row space carries almost all of Q, so
    # aligning over all r' rows or truncating to the top r first lands on (nearly) the same A.
    prev = rng.standard_normal((r, k))
    near = [prev + 1e-4 * rng.standard_normal((r, k)) for _ in range(n)]
    a, info_a = aggregate_florg(near, None, prev, rank_mismatch="procrustes")
    b, info_b = aggregate_florg(near, None, prev, rank_mismatch="truncate")
    assert info_a["rank"] == n * r > r
    assert rel(a, b) < 1e-6
    # Heterogeneous clients: the policies give different A (and Grams).
    As, prev = heterogeneous(rng, n, r, k)
    a, info_a = aggregate_florg(As, None, prev, rank_mismatch="procrustes")
    b, info_b = aggregate_florg(As, None, prev, rank_mismatch="truncate")
    assert rel(a, b) > 0.1
    assert rel(a.T @ a, b.T @ b) > 0.1
    assert info_b["gram_rel_error"] < info_a["gram_rel_error"]


def test_unknown_rank_mismatch_policy_is_rejected():
    prev = np.ones((2, 5))
    with pytest.raises(ValueError, match="rank_mismatch"):
        aggregate_florg([prev], None, prev, rank_mismatch="svd")
