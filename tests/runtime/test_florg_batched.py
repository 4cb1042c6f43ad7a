"""The batched torch FLoRG step (``aggregate_florg_layers``) against the numpy reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from strategies.florg.device import batched_eigh
from strategies.florg.rule import aggregate_florg
from strategies.florg.rule_torch import (
    _polar,
    aggregate_florg_layers,
    aggregate_layers_torch,
    resolve_server_device,
)
from strategies.shared.validation import AggregationInputError

TOL = 1e-12
ALL_MODES = [(True, "procrustes"), (True, "truncate"), (False, "procrustes")]


def rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-300))


def assert_matches_reference(client_As, weights, prev_As, procrustes, rank_mismatch, device):
    new, infos = aggregate_florg_layers(
        client_As, weights, prev_As, procrustes, device=device, rank_mismatch=rank_mismatch
    )
    assert list(new) == list(prev_As) and list(infos) == list(prev_As)
    for name, prev in prev_As.items():
        ref, ref_info = aggregate_florg(
            client_As[name], weights, prev, procrustes, rank_mismatch=rank_mismatch
        )
        assert new[name].shape == prev.shape and new[name].dtype == np.float64
        if np.linalg.norm(ref) == 0:
            assert np.all(new[name] == 0), name
        else:
            assert rel(new[name], ref) < TOL, name
        assert set(infos[name]) == set(ref_info)
        assert infos[name]["rank"] == ref_info["rank"], name
        for key in ("gram_rel_error", "drift", "eigengap", "eigengap_rel"):
            assert abs(infos[name][key] - ref_info[key]) <= TOL * max(1.0, abs(ref_info[key])), (
                name,
                key,
            )
    return new, infos


def mixed_layers(rng: np.random.Generator, n: int = 4, r: int = 3):
    """Layers of several shapes and every rank regime, all with the same n clients.

    k = min(d_in, d_out): a square 24 x 24 layer and 24 x 10 / 10 x 24 ones (both k = 10,
    batched together), r' > r (generic), r' = r and r' < r (clients in a shared row space),
    rank 0 (all clients zero), and n r > k (Q is the smaller matrix)."""
    layers: dict[str, tuple[list[np.ndarray], np.ndarray]] = {}

    def near(k, scale=0.3):
        prev = scale * rng.standard_normal((r, k))
        return [prev + 0.1 * scale * rng.standard_normal((r, k)) for _ in range(n)], prev

    def shared(k, r_true):
        basis = rng.standard_normal((r_true, k))
        return [rng.standard_normal((r, r_true)) @ basis for _ in range(n)], rng.standard_normal(
            (r, k)
        )

    layers["q.square"] = near(24)
    layers["v.square"] = near(24)
    layers["up.24x10"] = near(10)
    layers["down.10x24"] = near(10)
    layers["r_prime_eq_r"] = shared(24, r)
    layers["r_prime_lt_r"] = shared(24, 1)
    layers["rank0"] = ([np.zeros((r, 24)) for _ in range(n)], rng.standard_normal((r, 24)))
    layers["nr_gt_k"] = near(5 if n * r > 5 else n * r - 1)  # n r rows > k columns
    layers["heterogeneous"] = (
        [rng.standard_normal((r, 24)) for _ in range(n)],
        rng.standard_normal((r, 24)),
    )
    return {k: v[0] for k, v in layers.items()}, {k: v[1] for k, v in layers.items()}


@pytest.mark.parametrize("procrustes,rank_mismatch", ALL_MODES)
@pytest.mark.parametrize("uniform", [True, False])
def test_mixed_shapes_and_ranks_equal_the_reference(procrustes, rank_mismatch, uniform):
    rng = np.random.default_rng(1)
    client_As, prev_As = mixed_layers(rng)
    weights = None if uniform else rng.random(4) + 0.1
    _, infos = assert_matches_reference(
        client_As, weights, prev_As, procrustes, rank_mismatch, "cpu"
    )
    ranks = {name: info["rank"] for name, info in infos.items()}
    assert ranks["q.square"] == 12 > 3 and ranks["r_prime_eq_r"] == 3
    assert ranks["r_prime_lt_r"] == 1 and ranks["rank0"] == 0 and ranks["nr_gt_k"] == 5


@settings(max_examples=40, deadline=None)
@given(
    st.integers(1, 5),  # N clients
    st.integers(1, 5),  # r
    st.lists(st.integers(5, 30), min_size=1, max_size=4),  # k of each layer
    st.sampled_from(ALL_MODES),
    st.integers(0, 2**31 - 1),
)
def test_random_layers_equal_the_reference(n, r, ks, mode, seed):
    rng = np.random.default_rng(seed)
    client_As, prev_As = {}, {}
    for i, k in enumerate(ks):
        kk = max(k, r)
        prev = rng.standard_normal((r, kk))
        client_As[f"layer{i}"] = [prev + 0.2 * rng.standard_normal((r, kk)) for _ in range(n)]
        prev_As[f"layer{i}"] = prev
    weights = rng.integers(1, 100, size=n).astype(float)
    assert_matches_reference(client_As, weights, prev_As, mode[0], mode[1], "cpu")


def test_float32_inputs_chunks_and_reused_buffers_do_not_change_results():
    rng = np.random.default_rng(2)
    client_As, prev_As = mixed_layers(rng)
    w = rng.random(4) + 0.1
    f32 = {name: [a.astype(np.float32) for a in As] for name, As in client_As.items()}
    first, first_info = aggregate_layers_torch(f32, w, prev_As, device="cpu")
    kept = {name: a.copy() for name, a in first.items()}
    # Tiny chunks (one layer per batched call) give the same numbers.
    chunked, chunked_info = aggregate_layers_torch(f32, w, prev_As, device="cpu", max_stack_bytes=1)
    for name in prev_As:
        assert rel(chunked[name], first[name]) < TOL or np.all(first[name] == 0)
        assert chunked_info[name]["rank"] == first_info[name]["rank"]
    # A second call with other data reuses the stacking buffer: earlier results are untouched.
    other = {name: [3 * a + 1 for a in As] for name, As in client_As.items()}
    aggregate_layers_torch(other, w, prev_As, device="cpu")
    for name in prev_As:
        np.testing.assert_array_equal(first[name], kept[name])
    # float32 inputs are taken exactly (float32 -> float64 is lossless).
    as64 = {name: [a.astype(np.float64) for a in As] for name, As in f32.items()}
    assert_matches_reference(as64, w, prev_As, True, "procrustes", "cpu")


def test_bad_inputs_are_rejected_naming_layer_and_client():
    rng = np.random.default_rng(3)
    prev = {"a": rng.standard_normal((2, 6)), "b": rng.standard_normal((2, 6))}
    good = {name: [p + 0.1, p - 0.1] for name, p in prev.items()}
    bad = {**good, "b": [good["b"][0], np.full((2, 6), np.nan)]}
    with pytest.raises(AggregationInputError, match=r"b\[client 1\].*NaN"):
        aggregate_florg_layers(bad, None, prev, device="cpu")
    with pytest.raises(AggregationInputError, match=r"a\[client 0\]: shape"):
        aggregate_florg_layers({**good, "a": [np.ones((2, 5)), np.ones((2, 6))]}, None, prev)
    with pytest.raises(AggregationInputError, match="different layers"):
        aggregate_florg_layers({"a": good["a"]}, None, prev)
    with pytest.raises(AggregationInputError, match="numbers of clients"):
        aggregate_florg_layers({**good, "a": good["a"][:1]}, None, prev)
    with pytest.raises(AggregationInputError, match="weights"):
        aggregate_florg_layers(good, [1.0, -1.0], prev)
    with pytest.raises(ValueError, match="rank_mismatch"):
        aggregate_florg_layers(good, None, prev, rank_mismatch="svd")
    with pytest.raises(ValueError, match="server device"):
        aggregate_florg_layers(good, None, prev, device="tpu")


def test_the_host_pool_eigen_route_equals_torchs_batched_call_and_restores_the_threads():
    # The route the CUDA step takes for 33..512-row Grams (strategies.florg.device.
    # batched_eigh), forced here on CPU tensors: the same numbers as the batched call,
    # and torch's thread count as it was.
    g = torch.Generator().manual_seed(0)
    X = torch.randn(37, 48, 60, generator=g, dtype=torch.float64)
    G = X @ X.mT
    threads = torch.get_num_threads()
    lam, U = batched_eigh(G, vectors=True, on_host=True)
    assert U is not None and torch.get_num_threads() == threads
    want_lam, want_U = torch.linalg.eigh(G)
    torch.testing.assert_close(lam, want_lam, rtol=1e-12, atol=1e-10)
    # eigenvectors up to sign: compare the reconstructions
    torch.testing.assert_close(U @ torch.diag_embed(lam) @ U.mT, G, rtol=1e-12, atol=1e-9)
    vals, none = batched_eigh(G, vectors=False, on_host=True)
    assert none is None
    torch.testing.assert_close(vals, want_lam, rtol=1e-12, atol=1e-10)


@pytest.mark.parametrize("r,n", [(8, 160), (3, 40), (8, 8)])
def test_the_polar_factor_through_qr_equals_the_svds(r, n):
    # Theorem 1's S = U V^T: the CUDA route (thin QR of X^T, then an r x r SVD) forced on
    # CPU tensors against the thin SVD of X; S has orthonormal rows either way.
    g = torch.Generator().manual_seed(r * n)
    X = torch.randn(5, r, n, generator=g, dtype=torch.float64)
    via_qr, via_svd = _polar(X, via_qr=True), _polar(X, via_qr=False)
    torch.testing.assert_close(via_qr, via_svd, rtol=0, atol=1e-12)
    eye = torch.eye(r, dtype=torch.float64).expand(5, r, r)
    torch.testing.assert_close(via_qr @ via_qr.mT, eye, rtol=0, atol=1e-12)


def test_device_resolution():
    assert resolve_server_device("cpu").type == "cpu"
    assert resolve_server_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            resolve_server_device("cuda")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA not available")
@pytest.mark.parametrize("procrustes,rank_mismatch", ALL_MODES)
def test_cuda_equals_the_reference(procrustes, rank_mismatch):
    rng = np.random.default_rng(4)
    client_As, prev_As = mixed_layers(rng)
    f32 = {name: [a.astype(np.float32) for a in As] for name, As in client_As.items()}
    as64 = {name: [a.astype(np.float64) for a in As] for name, As in f32.items()}
    new, _ = aggregate_florg_layers(
        f32, None, prev_As, procrustes, device="cuda", rank_mismatch=rank_mismatch
    )
    for name, prev in prev_As.items():
        ref, _ = aggregate_florg(as64[name], None, prev, procrustes, rank_mismatch=rank_mismatch)
        assert rel(new[name], ref) < TOL or np.all(ref == 0)
    assert_matches_reference(client_As, None, prev_As, procrustes, rank_mismatch, "cuda")


@pytest.mark.parametrize("procrustes,rank_mismatch", ALL_MODES)
def test_more_rows_than_columns_sum_the_gram_matrix_without_the_stack(
    procrustes, rank_mismatch, monkeypatch
):
    """N r > k: Q is summed over blocks of at most k rows (strategies/florg/gram_sum.py),
    never the (N r x k) stack, and the step still equals the reference."""
    from strategies.florg import gram_sum, rule_torch

    def no_stack(*args, **kwargs):
        raise AssertionError("the (N r x k) stack was built")

    monkeypatch.setattr(rule_torch, "stack_layers", no_stack)
    rng = np.random.default_rng(4)
    n, r = 40, 3
    prev_As = {"k10": rng.standard_normal((r, 10)), "k7": rng.standard_normal((r, 7))}
    client_As = {
        name: [p + 0.3 * rng.standard_normal(p.shape) for _ in range(n)]
        for name, p in prev_As.items()
    }
    weights = rng.random(n) + 0.1
    assert_matches_reference(client_As, weights, prev_As, procrustes, rank_mismatch, "cpu")
    w = weights / weights.sum()
    Q = gram_sum.gram_sum(["k10"], client_As, np.sqrt(w), torch.device("cpu"))[0].numpy()
    expected = sum(wi * a.T @ a for wi, a in zip(w, client_As["k10"], strict=True))
    assert rel(Q, expected) < TOL and gram_sum.clients_per_block(r, 10) == 3
    client_As["k7"][37] = np.full((r, 7), np.inf)  # in the 13th block of 3 clients
    with pytest.raises(AggregationInputError, match=r"k7\[client 37\].*NaN/Inf"):
        aggregate_florg_layers(client_As, weights, prev_As, device="cpu")
