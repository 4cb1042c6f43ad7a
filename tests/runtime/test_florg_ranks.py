"""FLoRG with heterogeneous client ranks (strategies/florg_ranks*.py) against dense float64
references built here: Q formed densely and eigendecomposed, Theorem 1 in closed form."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from strategies.florg.ranks import aggregate_florg_ranks
from strategies.florg.ranks_torch import aggregate_florg_ranks_layers
from strategies.florg.rule import aggregate_florg
from strategies.shared.validation import AggregationInputError

TOL = 1e-12
MODES = [(True, "truncate"), (True, "procrustes"), (False, "truncate")]
INFO_KEYS = {
    "rank",
    "kept",
    "gram_rel_error",
    "trace_share",
    "drift",
    "eigengap",
    "eigengap_rel",
}


def rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-300))


def dense_gram(As: list[np.ndarray], w: np.ndarray | None) -> np.ndarray:
    w = np.ones(len(As)) if w is None else np.asarray(w, dtype=float)
    w = w / w.sum()
    k = As[0].shape[1]
    return sum((wn * a.T @ a for wn, a in zip(w, As, strict=True)), np.zeros((k, k)))


def dense_eig(Q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q's eigenvalues (descending, clipped at 0) and eigenvectors (columns), from eigh of Q."""
    lam, vecs = np.linalg.eigh(Q)
    return np.clip(lam[::-1], 0.0, None), vecs[:, ::-1]


def best_rank(Q: np.ndarray, r: int) -> np.ndarray:
    """Eckart-Young: the best rank-r approximation of the PSD Q."""
    lam, vecs = dense_eig(Q)
    return (vecs[:, :r] * lam[:r]) @ vecs[:, :r].T


def dense_factor(Q: np.ndarray, rows: int, rtol: float = 1e-10) -> np.ndarray:
    """Lambda^{1/2} P for Q's top ``rows`` eigenpairs above rtol lambda_1 (eigh's own signs)."""
    lam, vecs = dense_eig(Q)
    keep = min(rows, int(np.count_nonzero(lam > rtol * lam[0])) if lam[0] > 0 else 0)
    return np.sqrt(lam[:keep])[:, None] * vecs[:, :keep].T


def polar(X: np.ndarray) -> np.ndarray:
    U, _, Vt = np.linalg.svd(X, full_matrices=False)
    return U @ Vt


def clients(rng: np.random.Generator, ranks: list[int], k: int) -> list[np.ndarray]:
    return [rng.standard_normal((r, k)) for r in ranks]


def prevs(rng: np.random.Generator, ranks: list[int], k: int) -> dict[int, np.ndarray]:
    return {r: rng.standard_normal((r, k)) for r in ranks}


def random_rotation(rng: np.random.Generator, n: int) -> np.ndarray:
    return np.linalg.qr(rng.standard_normal((n, n)))[0]


def near_identity_rotation(rng: np.random.Generator, n: int, eps: float) -> np.ndarray:
    """The Cayley transform (I - K)^{-1} (I + K) of a small random skew-symmetric K."""
    K = rng.standard_normal((n, n))
    K = eps * (K - K.T)
    return np.linalg.solve(np.eye(n) - K, np.eye(n) + K)


# Client ranks, k, requested ranks: mixed ranks with R = sum r_n < k, R > k (Q decomposed
# directly), rank-0 clients, and requested ranks above and below R.
CASES = [
    ([2, 4, 8], 30, [2, 4, 8]),
    ([1, 3, 0, 4], 12, [1, 3, 4, 8]),
    ([4, 8, 8, 2], 10, [2, 4, 8]),
    ([1, 1], 16, [1, 2, 6]),
]


# --------------------------------------------------------------------------- Eckart-Young


@pytest.mark.parametrize("ranks,k,wanted", CASES)
@pytest.mark.parametrize("procrustes", [True, False])
def test_truncate_gives_the_best_rank_r_gram_for_every_requested_rank(ranks, k, wanted, procrustes):
    rng = np.random.default_rng(sum(ranks) + k)
    As, prev = clients(rng, ranks, k), prevs(rng, wanted, k)
    w = rng.random(len(ranks)) + 0.1
    new, info = aggregate_florg_ranks(As, w, prev, procrustes=procrustes)
    Q = dense_gram(As, w)
    lam, _ = dense_eig(Q)
    r_prime = np.linalg.matrix_rank(Q)
    assert r_prime == min(sum(ranks), k)
    assert list(new) == list(prev) and list(info) == list(prev)
    for r_t in wanted:
        assert new[r_t].shape == (r_t, k) and new[r_t].dtype == np.float64
        assert set(info[r_t]) == INFO_KEYS
        assert rel(new[r_t].T @ new[r_t], best_rank(Q, r_t)) < 1e-10, r_t
        optimum = np.sqrt(np.sum(lam[r_t:] ** 2) / np.sum(lam**2))  # Eckart-Young error
        assert info[r_t]["gram_rel_error"] == pytest.approx(optimum, rel=1e-9, abs=1e-13)
        assert rel(new[r_t].T @ new[r_t], Q) == pytest.approx(optimum, rel=1e-9, abs=1e-13)
        assert info[r_t]["rank"] == r_prime
        assert info[r_t]["kept"] == min(r_t, r_prime)
        assert info[r_t]["trace_share"] == pytest.approx(lam[:r_t].sum() / lam.sum(), rel=1e-10)
        assert info[r_t]["drift"] == pytest.approx(np.linalg.norm(new[r_t] - prev[r_t]))
        gap = np.concatenate([lam, np.zeros(r_t + 1)])
        assert info[r_t]["eigengap"] == pytest.approx(gap[r_t - 1] - gap[r_t], abs=1e-12)


@settings(max_examples=25, deadline=None)
@given(
    st.lists(st.integers(0, 5), min_size=1, max_size=5),  # client ranks
    st.integers(5, 24),  # k
    st.lists(st.integers(1, 6), min_size=1, max_size=3, unique=True),  # requested ranks
    st.integers(0, 2**31 - 1),
)
def test_random_heterogeneous_ranks_are_eckart_young(ranks, k, wanted, seed):
    rng = np.random.default_rng(seed)
    k = max(k, *wanted)
    As, prev = clients(rng, ranks, k), prevs(rng, wanted, k)
    w = rng.integers(1, 50, size=len(ranks)).astype(float)
    new, info = aggregate_florg_ranks(As, w, prev)
    Q = dense_gram(As, w)
    for r_t in wanted:
        if sum(ranks) == 0:
            assert np.all(new[r_t] == 0) and info[r_t]["rank"] == 0
            continue
        best = best_rank(Q, r_t)
        assert np.linalg.norm(new[r_t].T @ new[r_t] - best) <= 1e-10 * np.linalg.norm(Q)


# --------------------------------------------------------------------------- Procrustes


@pytest.mark.parametrize("ranks,k,wanted", CASES)
def test_truncate_procrustes_rotation_is_optimal(ranks, k, wanted):
    """No rotation O of the returned factor lies closer to the previous one (problem P1 over
    the factors of the best rank-r_t approximation), and the factor is Theorem 1's closed form
    S* = U V^T applied to an independently computed factor of that approximation."""
    rng = np.random.default_rng(3 * k + len(ranks))
    As = clients(rng, ranks, k)
    # Previous factors near the new ones, so that the optimum is not a far-off rotation.
    Q = dense_gram(As, None)
    prev = {r: dense_factor(Q, r) for r in wanted}
    prev = {
        r: np.vstack([f, np.zeros((r - f.shape[0], k))]) + 0.3 * rng.standard_normal((r, k))
        for r, f in prev.items()
    }
    new, info = aggregate_florg_ranks(As, None, prev)
    for r_t in wanted:
        dist = np.linalg.norm(new[r_t] - prev[r_t])
        assert dist == pytest.approx(info[r_t]["drift"], rel=1e-12)
        for _ in range(300):
            rot = random_rotation(rng, r_t)
            assert np.linalg.norm(rot @ new[r_t] - prev[r_t]) >= dist - 1e-12
        for eps in (1e-1, 1e-3, 1e-5):
            for _ in range(20):
                rot = near_identity_rotation(rng, r_t, eps)
                assert np.linalg.norm(rot @ new[r_t] - prev[r_t]) >= dist - 1e-12
        F = dense_factor(Q, r_t)  # eigh's signs, not the module's canonical ones
        F = random_rotation(rng, F.shape[0]) @ F  # any factor of the same Gram
        closed_form = polar(prev[r_t] @ F.T) @ F
        np.testing.assert_allclose(new[r_t], closed_form, atol=1e-10)


def test_paper_policy_maximises_the_trace_alignment_over_all_rows():
    """rank_mismatch='procrustes' with r' > r_t: S* (r_t x r', orthonormal rows) maximises
    tr(A_prev A~^T S^T) (problem P2), and equals U V^T over all r' rows of a dense factor."""
    rng = np.random.default_rng(5)
    As, k = clients(rng, [2, 3, 1], 14), 14
    prev = prevs(rng, [1, 2, 4], k)
    new, info = aggregate_florg_ranks(As, None, prev, rank_mismatch="procrustes")
    Q = dense_gram(As, None)
    F = dense_factor(Q, k)
    assert F.shape[0] == 6 == info[1]["rank"] == info[4]["kept"]
    for r_t, p in prev.items():
        np.testing.assert_allclose(new[r_t], polar(p @ F.T) @ F, atol=1e-10)
        best = np.trace(p @ new[r_t].T)
        for _ in range(300):
            S = np.linalg.qr(rng.standard_normal((F.shape[0], r_t)))[0].T  # orthonormal rows
            assert np.trace(p @ (S @ F).T) <= best + 1e-12
    # It approximates the Gram no better than truncating first (Eckart-Young).
    _, info_t = aggregate_florg_ranks(As, None, prev, rank_mismatch="truncate")
    for r_t in prev:
        assert info[r_t]["gram_rel_error"] >= info_t[r_t]["gram_rel_error"] - 1e-12
    assert info[1]["gram_rel_error"] > info_t[1]["gram_rel_error"] + 1e-3


# --------------------------------------------------------------------------- exact cases


@pytest.mark.parametrize("procrustes,rank_mismatch", MODES)
def test_q_is_reproduced_when_all_rows_fit(procrustes, rank_mismatch):
    rng = np.random.default_rng(7)
    ranks, k = [1, 2, 0, 3], 20  # R = 6
    As = clients(rng, ranks, k)
    w = [1.0, 2.0, 3.0, 4.0]
    prev = prevs(rng, [6, 8, 3], k)
    new, info = aggregate_florg_ranks(As, w, prev, procrustes, rank_mismatch)
    Q = dense_gram(As, np.array(w))
    for r_t in (6, 8):  # R <= r_t
        assert rel(new[r_t].T @ new[r_t], Q) < 1e-12
        assert info[r_t]["gram_rel_error"] < 1e-12 and info[r_t]["rank"] == 6
        assert info[r_t]["trace_share"] == pytest.approx(1.0, abs=1e-12)
    assert rel(new[3].T @ new[3], Q) > 0.05  # r_t < R: not exact
    if procrustes:  # r' <= r_t: both policies are the same computation
        other = "procrustes" if rank_mismatch == "truncate" else "truncate"
        same, _ = aggregate_florg_ranks(As, w, prev, procrustes, other)
        for r_t in (6, 8):
            np.testing.assert_array_equal(same[r_t], new[r_t])


@pytest.mark.parametrize("procrustes,rank_mismatch", MODES)
def test_rank_zero_clients(procrustes, rank_mismatch):
    rng = np.random.default_rng(9)
    k = 10
    A1, A2 = rng.standard_normal((3, k)), rng.standard_normal((2, k))
    empty = np.zeros((0, k))
    prev = prevs(rng, [2, 5], k)
    # A rank-0 client contributes a zero Gram but keeps its share of the weight.
    new, info = aggregate_florg_ranks([A1, empty, A2], [1, 2, 1], prev, procrustes, rank_mismatch)
    Q = dense_gram([A1, np.zeros((1, k)), A2], np.array([1, 2, 1]))
    np.testing.assert_allclose(Q, (A1.T @ A1 + A2.T @ A2) / 4, atol=1e-14)
    assert rel(new[5].T @ new[5], Q) < 1e-12 and info[5]["rank"] == 5
    assert rel(new[2].T @ new[2], best_rank(Q, 2)) < 1e-10 or rank_mismatch == "procrustes"
    # With weight 0 it changes nothing.
    without, _ = aggregate_florg_ranks([A1, A2], [1, 1], prev, procrustes, rank_mismatch)
    zero_w, _ = aggregate_florg_ranks([A1, empty, A2], [1, 0, 1], prev, procrustes, rank_mismatch)
    for r_t in prev:
        assert rel(zero_w[r_t], without[r_t]) < 1e-12
    # Every client rank 0: Q = 0, every factor zero.
    new, info = aggregate_florg_ranks([empty, empty], None, prev, procrustes, rank_mismatch)
    for r_t, p in prev.items():
        assert new[r_t].shape == (r_t, k) and np.all(new[r_t] == 0)
        assert info[r_t]["rank"] == 0 and info[r_t]["kept"] == 0
        assert info[r_t]["gram_rel_error"] == 0.0 and info[r_t]["trace_share"] == 0.0
        assert info[r_t]["drift"] == pytest.approx(np.linalg.norm(p))


@pytest.mark.parametrize("procrustes,rank_mismatch", MODES)
def test_deficient_rank_gives_a_factor_of_rank_r_prime(procrustes, rank_mismatch):
    """Clients in a shared 2-dimensional row space: r' = 2 < r_t.  Q is reproduced; the
    factor has r_t - r' zero singular values (zero rows beyond r', rotated by Theorem 1's
    O when Procrustes is on, literally zero rows in the ablation)."""
    rng = np.random.default_rng(11)
    k, r_true = 15, 2
    basis = rng.standard_normal((r_true, k))
    As = [rng.standard_normal((r, r_true)) @ basis for r in (1, 3, 4)]
    prev = prevs(rng, [4, 6], k)
    new, info = aggregate_florg_ranks(As, [3, 1, 2], prev, procrustes, rank_mismatch)
    Q = dense_gram(As, np.array([3, 1, 2]))
    for r_t, p in prev.items():
        assert info[r_t]["rank"] == r_true and info[r_t]["kept"] == r_true
        assert rel(new[r_t].T @ new[r_t], Q) < 1e-10
        sv = np.linalg.svd(new[r_t], compute_uv=False)
        assert np.all(sv[:r_true] > 1e-3) and np.all(sv[r_true:] < 1e-10 * sv[0])
        if not procrustes:
            assert np.all(new[r_t][r_true:] == 0)
        else:
            assert np.count_nonzero(np.linalg.norm(new[r_t], axis=1) > 1e-8) > r_true
            # Theorem 1 over what exists: U V^T of the r_t x r' cross matrix.
            F = dense_factor(Q, r_t)
            np.testing.assert_allclose(new[r_t], polar(p @ F.T) @ F, atol=1e-10)
            for _ in range(200):
                rot = random_rotation(rng, r_t)
                assert np.linalg.norm(rot @ new[r_t] - p) >= info[r_t]["drift"] - 1e-12


# --------------------------------------------------------------------------- invariance


def _flip_signs(eigh, rng):
    def flipped(a, *args, **kwargs):
        lam, vecs = eigh(a, *args, **kwargs)
        signs = rng.choice([-1.0, 1.0], size=vecs.shape[-1])
        if isinstance(vecs, torch.Tensor):
            signs = torch.as_tensor(signs, dtype=vecs.dtype, device=vecs.device)
        return lam, vecs * signs

    return flipped


@pytest.mark.parametrize("procrustes,rank_mismatch", MODES)
def test_invariant_to_eigenvector_signs_client_order_and_client_rotations(
    procrustes, rank_mismatch, monkeypatch
):
    rng = np.random.default_rng(13)
    for ranks, k, wanted in CASES:
        As, prev = clients(rng, ranks, k), prevs(rng, wanted, k)
        w = rng.random(len(ranks)) + 0.1
        base, base_info = aggregate_florg_ranks(As, w, prev, procrustes, rank_mismatch)
        order = rng.permutation(len(ranks))
        perm, _ = aggregate_florg_ranks(
            [As[i] for i in order], w[order], prev, procrustes, rank_mismatch
        )
        # O_n A_n leaves every A_n^T A_n (so Q) unchanged but changes M and G's eigenvectors.
        rot = [random_rotation(rng, a.shape[0]) @ a if a.shape[0] else a for a in As]
        rotated, _ = aggregate_florg_ranks(rot, w, prev, procrustes, rank_mismatch)
        with monkeypatch.context() as m:
            m.setattr(np.linalg, "eigh", _flip_signs(np.linalg.eigh, rng))
            flipped, _ = aggregate_florg_ranks(As, w, prev, procrustes, rank_mismatch)
            m.setattr(torch.linalg, "eigh", _flip_signs(torch.linalg.eigh, rng))
            batched, _ = aggregate_florg_ranks_layers(
                {"x": As}, w, {"x": prev}, "cpu", procrustes, rank_mismatch
            )
        for r_t in wanted:
            assert np.linalg.norm(base[r_t]) > 0
            for other in (perm, rotated, flipped, batched["x"]):
                assert rel(other[r_t], base[r_t]) < 1e-10, (ranks, r_t)


@pytest.mark.parametrize("ranks,k", [([2, 3, 0], 9), ([4, 3, 5], 9)])
def test_only_the_smaller_gram_is_decomposed(ranks, k, monkeypatch):
    """Q (k x k) is never formed for R = sum r_n <= k: the eigensolvers (numpy and torch)
    see the R x R matrix G = M M^T; for R > k they see Q.  (This is also what makes the
    sign-flip patches of the invariance test reach the decomposition.)"""
    rng = np.random.default_rng(17)
    As, prev = clients(rng, ranks, k), prevs(rng, [2, 3], k)
    seen: list[tuple[int, ...]] = []
    np_eigh, torch_eigh = np.linalg.eigh, torch.linalg.eigh

    def np_spy(a, *args, **kwargs):
        seen.append(np.shape(a))
        return np_eigh(a, *args, **kwargs)

    def torch_spy(a, *args, **kwargs):
        seen.append(tuple(a.shape))
        return torch_eigh(a, *args, **kwargs)

    monkeypatch.setattr(np.linalg, "eigh", np_spy)
    monkeypatch.setattr(torch.linalg, "eigh", torch_spy)
    aggregate_florg_ranks(As, None, prev)
    aggregate_florg_ranks_layers({"a": As, "b": As}, None, {"a": prev, "b": prev}, "cpu")
    n = min(sum(ranks), k)
    assert seen == [(n, n), (2, n, n)]


# --------------------------------------------------------------------------- homogeneous


@pytest.mark.parametrize("procrustes,rank_mismatch", MODES)
@pytest.mark.parametrize(
    "n,r,k,deficient", [(3, 2, 12, False), (4, 3, 9, False), (2, 4, 20, True), (1, 3, 7, False)]
)
def test_homogeneous_ranks_reduce_to_aggregate_florg(n, r, k, deficient, procrustes, rank_mismatch):
    rng = np.random.default_rng(n * 31 + r * 7 + k)
    if deficient:
        basis = rng.standard_normal((1, k))
        As = [rng.standard_normal((r, 1)) @ basis for _ in range(n)]
    else:
        As = clients(rng, [r] * n, k)
    prev = rng.standard_normal((r, k))
    w = rng.random(n) + 0.1
    new, info = aggregate_florg_ranks(As, w, {r: prev}, procrustes, rank_mismatch)
    ref, ref_info = aggregate_florg(As, w, prev, procrustes, rank_mismatch=rank_mismatch)
    assert rel(new[r], ref) < TOL
    assert set(ref_info) < set(info[r])
    for key, value in ref_info.items():
        assert info[r][key] == pytest.approx(value, rel=TOL, abs=TOL), key
    assert info[r]["rank"] == (1 if deficient else min(n * r, k))


# --------------------------------------------------------------------------- torch, batched


def mixed_layers(rng: np.random.Generator):
    """Layers sharing 4 clients: equal k with the same and with other client ranks (batched
    together or apart), R > k, a rank-deficient layer, an all-zero layer, every client rank 0."""
    layers: dict[str, tuple[list[np.ndarray], dict[int, np.ndarray]]] = {}
    ranks = [2, 4, 0, 1]
    wanted = [1, 2, 4]
    for name in ("q.0", "v.0", "q.1"):
        layers[name] = (clients(rng, ranks, 16), prevs(rng, wanted, 16))
    layers["other_ranks"] = (clients(rng, [3, 3, 1, 2], 16), prevs(rng, wanted, 16))
    layers["other_wanted"] = (clients(rng, ranks, 16), prevs(rng, [3, 7], 16))
    layers["rows_gt_k"] = (clients(rng, [2, 4, 3, 1], 6), prevs(rng, [1, 2, 4], 6))
    basis = rng.standard_normal((1, 16))
    low = [rng.standard_normal((r, 1)) @ basis for r in ranks]
    layers["deficient"] = (low, prevs(rng, wanted, 16))
    layers["zero"] = ([np.zeros((r, 16)) for r in ranks], prevs(rng, wanted, 16))
    layers["all_rank0"] = ([np.zeros((0, 16))] * 4, prevs(rng, wanted, 16))
    return {n: v[0] for n, v in layers.items()}, {n: v[1] for n, v in layers.items()}


def assert_layers_match_reference(client_As, w, prev, procrustes, rank_mismatch, device, **kw):
    new, infos = aggregate_florg_ranks_layers(
        client_As, w, prev, device, procrustes, rank_mismatch, **kw
    )
    assert list(new) == list(prev) and list(infos) == list(prev)
    for name in prev:
        ref, ref_info = aggregate_florg_ranks(
            client_As[name], w, prev[name], procrustes, rank_mismatch
        )
        assert list(new[name]) == list(prev[name])
        for r_t in prev[name]:
            assert new[name][r_t].shape == ref[r_t].shape and new[name][r_t].dtype == np.float64
            if np.linalg.norm(ref[r_t]) == 0:
                assert np.all(new[name][r_t] == 0), (name, r_t)
            else:
                assert rel(new[name][r_t], ref[r_t]) < TOL, (name, r_t)
            assert infos[name][r_t].keys() == ref_info[r_t].keys() == INFO_KEYS
            for key, value in ref_info[r_t].items():
                assert abs(infos[name][r_t][key] - value) <= TOL * max(1.0, abs(value)), (
                    name,
                    r_t,
                    key,
                )
    return new, infos


@pytest.mark.parametrize("procrustes,rank_mismatch", MODES)
@pytest.mark.parametrize("uniform", [True, False])
def test_batched_layers_equal_the_reference(procrustes, rank_mismatch, uniform):
    rng = np.random.default_rng(19)
    client_As, prev = mixed_layers(rng)
    w = None if uniform else rng.random(4) + 0.1
    _, infos = assert_layers_match_reference(client_As, w, prev, procrustes, rank_mismatch, "cpu")
    assert infos["q.0"][4]["rank"] == 7 and infos["rows_gt_k"][1]["rank"] == 6
    assert infos["deficient"][4]["rank"] == 1 and infos["zero"][2]["rank"] == 0
    assert infos["all_rank0"][1]["rank"] == 0
    # One layer per batched call gives the same numbers.
    assert_layers_match_reference(
        client_As, w, prev, procrustes, rank_mismatch, "cpu", max_stack_bytes=1
    )


@settings(max_examples=15, deadline=None)
@given(
    st.lists(st.integers(0, 4), min_size=1, max_size=4),  # client ranks
    st.lists(st.integers(4, 20), min_size=1, max_size=3),  # k per layer
    st.lists(st.integers(1, 5), min_size=1, max_size=3, unique=True),  # requested ranks
    st.sampled_from(MODES),
    st.integers(0, 2**31 - 1),
)
def test_random_batched_layers_equal_the_reference(ranks, ks, wanted, mode, seed):
    rng = np.random.default_rng(seed)
    client_As, prev = {}, {}
    for i, k in enumerate(ks):
        kk = max(k, *ranks, *wanted)
        client_As[f"l{i}"] = clients(rng, ranks, kk)
        prev[f"l{i}"] = prevs(rng, wanted, kk)
    w = rng.integers(1, 100, size=len(ranks)).astype(float)
    assert_layers_match_reference(client_As, w, prev, mode[0], mode[1], "cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA not available")
@pytest.mark.parametrize("procrustes,rank_mismatch", MODES)
def test_cuda_equals_the_reference(procrustes, rank_mismatch):
    rng = np.random.default_rng(23)
    client_As, prev = mixed_layers(rng)
    assert_layers_match_reference(client_As, None, prev, procrustes, rank_mismatch, "cuda")


# --------------------------------------------------------------------------- bad inputs


def test_bad_inputs_raise_naming_the_problem():
    rng = np.random.default_rng(29)
    k = 6
    As = clients(rng, [2, 1], k)
    prev = prevs(rng, [1, 2], k)
    bad = [
        ([As[0], rng.standard_normal((1, 5))], None, prev, r"client 1\].*k=5.*client 0's k=6"),
        (As, None, {2: rng.standard_normal((2, 7)), 1: prev[1]}, r"prev_by_rank\[2\]: k=7"),
        (
            [As[0], rng.standard_normal((7, k))],
            None,
            prev,
            r"client 1\].*r_n=7 exceeds k=min\(d_in, d_out\)=6",
        ),
        (
            As,
            None,
            {**prev, 7: rng.standard_normal((7, k))},
            r"requested rank 7 exceeds k=min\(d_in, d_out\)=6",
        ),
        (As, None, {0: np.zeros((0, k))}, "requested rank 0 is below 1"),
        (As, None, {2: prev[1]}, r"prev_by_rank\[2\]: has 1 rows"),
        (As, None, {1.5: prev[1]}, "rank 1.5 is not an integer"),
        ([As[0], np.full((1, k), np.nan)], None, prev, r"client 1\].*NaN"),
        (As, None, {1: np.full((1, k), np.inf)}, r"prev_by_rank\[1\].*NaN/Inf"),
        (As, [1.0, -1.0], prev, "non-negative"),
        (As, [0.0, 0.0], prev, "all zero"),
        (As, [1.0], prev, "1 weights for 2 client"),
        (As, None, {}, "non-empty mapping"),
        ([], None, prev, "no client matrices"),
        ([np.ones(k)], None, prev, "2-D matrix"),
    ]
    for client_As, w, p, message in bad:
        with pytest.raises(AggregationInputError, match=message):
            aggregate_florg_ranks(client_As, w, p)
        if len(client_As):
            with pytest.raises(AggregationInputError, match=message):
                aggregate_florg_ranks_layers({"x": client_As}, w, {"x": p}, "cpu")
    with pytest.raises(ValueError, match="rank_mismatch"):
        aggregate_florg_ranks(As, None, prev, rank_mismatch="svd")
    with pytest.raises(AggregationInputError, match=r"^up\.3: client_As\[client 1\]"):
        aggregate_florg_ranks_layers(
            {"a": As, "up.3": [As[0], np.full((1, k), np.nan)]}, None, {"a": prev, "up.3": prev}
        )
    with pytest.raises(AggregationInputError, match="different layers"):
        aggregate_florg_ranks_layers({"a": As}, None, {"b": prev})
    with pytest.raises(AggregationInputError, match="numbers of clients"):
        aggregate_florg_ranks_layers({"a": As, "b": As[:1]}, None, {"a": prev, "b": prev})
    with pytest.raises(ValueError, match="rank_mismatch"):
        aggregate_florg_ranks_layers({"a": As}, None, {"a": prev}, rank_mismatch="svd")
