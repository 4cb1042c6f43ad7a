"""Central DP mechanisms (strategies/server/central_dp.py, strategies/florg/dp.py and
dp_torch.py; docs/privacy.md): noise calibration, clipping, post-processing, accounting
against the libraries, settings."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from scipy import stats

from flower_app.privacy import accounting as accounting
from flower_app.privacy import checks as dp_checks
from strategies.federa.rule import aggregate_federa
from strategies.florg import dp as gram_dp
from strategies.florg.dp_torch import private_florg_layers_torch
from strategies.florg.rule import aggregate_florg_reference
from strategies.server import central_dp as dp
from strategies.server import product_mean

ALPHA = 1e-6  # two-sided level of the chi-square checks (the seeds are fixed anyway)


def assert_std(samples: np.ndarray, sigma: float) -> None:
    """Zero-mean iid N(0, sigma^2) samples: sum x^2 / sigma^2 ~ chi2(N), two-sided at ALPHA;
    and the mean within 5 standard errors of 0."""
    x = np.asarray(samples, np.float64).ravel()
    n = x.size
    stat = float(np.sum(x**2)) / sigma**2
    lo, hi = stats.chi2.ppf(ALPHA / 2, n), stats.chi2.isf(ALPHA / 2, n)
    assert lo < stat < hi, (n, stat / n, lo / n, hi / n)
    assert abs(x.mean()) < 5 * sigma / np.sqrt(n)


def client_updates(rng, m: int, scale: float = 1.0) -> list[dict[str, np.ndarray]]:
    return [
        {
            "l0.lora_A": scale * rng.standard_normal((4, 25)),
            "l0.lora_B": scale * rng.standard_normal((30, 4)),
            "head.bias": scale * rng.standard_normal(3),
        }
        for _ in range(m)
    ]


def gram_sum_upper(g: np.ndarray) -> np.ndarray:
    return g[np.triu_indices(g.shape[0])]


# --------------------------------------------------------------------------- mean mechanism


def test_clip_update_scales_jointly_and_matches_flower():
    from flwr.supercore.differential_privacy import clip_inputs_inplace

    rng = np.random.default_rng(0)
    update = client_updates(rng, 1)[0]
    norm = dp.flat_norm(update)
    clipped = dp.clip_update(update, norm / 3)
    assert dp.flat_norm(clipped) == pytest.approx(norm / 3, rel=1e-12)
    assert list(clipped) == list(update)  # mapping in, mapping out, same order
    for key in update:  # one common factor for every array
        np.testing.assert_allclose(clipped[key], update[key] / 3, rtol=1e-12)
    flower = [a.copy() for a in update.values()]
    clip_inputs_inplace(flower, norm / 3)
    for a, b in zip(flower, clipped.values(), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-12)
    as_list = dp.clip_update(list(update.values()), 10 * norm)  # inside the ball: unchanged
    assert isinstance(as_list, list)
    for a, b in zip(as_list, update.values(), strict=True):
        np.testing.assert_array_equal(a, b)
    # a zero update: Flower's helper divides by its norm, ours returns it unchanged
    zero = [np.zeros((2, 3))]
    with pytest.raises(ZeroDivisionError):
        clip_inputs_inplace([z.copy() for z in zero], 1.0)
    np.testing.assert_array_equal(dp.clip_update(zero, 1.0)[0], zero[0])


def test_noise_std_is_flowers_compute_stdv():
    from flwr.supercore.differential_privacy import compute_stdv

    assert dp.noise_std_mean(0.7, 1.3, 6) == pytest.approx(compute_stdv(1.3, 0.7, 6), rel=1e-15)


def test_noised_mean_noise_is_calibrated():
    rng = np.random.default_rng(1)
    C, z, m = 0.5, 1.3, 5
    ups = [dp.clip_update(u, C) for u in client_updates(rng, m)]
    exact = {k: np.mean([u[k] for u in ups], axis=0) for k in ups[0]}
    sigma = z * C / m
    residuals = []
    for _ in range(25):  # 25 draws x 253 coordinates
        noised = dp.noised_mean(ups, C, z, rng)
        residuals += [noised[k] - exact[k] for k in exact]
    assert_std(np.concatenate([r.ravel() for r in residuals]), sigma)
    # one public m for the denominator and sigma (Flower's num_sampled_clients)
    fixed = dp.noised_mean(ups, C, 0.0, rng, num_sampled=2 * m)
    np.testing.assert_allclose(fixed["l0.lora_A"], exact["l0.lora_A"] / 2, rtol=1e-12)


def test_noised_mean_clipping_bounds_one_clients_influence():
    rng = np.random.default_rng(2)
    C, m = 0.3, 4
    others = [dp.clip_update(u, C) for u in client_updates(rng, m - 1)]
    huge = dp.clip_update(client_updates(rng, 1, scale=1e6)[0], C)
    with_it = dp.noised_mean([*others, huge], C, 0.0, rng, num_sampled=m)
    without = dp.noised_mean(others, C, 0.0, rng, num_sampled=m)
    moved = dp.flat_norm({k: with_it[k] - without[k] for k in with_it})
    assert moved <= C / m * (1 + 1e-12)
    assert moved == pytest.approx(C / m, rel=1e-9)  # the bound is attained
    with pytest.raises(ValueError, match="exceeds the clipping bound"):
        dp.noised_mean([*others, client_updates(rng, 1, scale=1e6)[0]], C, 1.0, rng)


def test_federa_product_mechanism_is_federa_without_noise():
    rng = np.random.default_rng(3)
    d_out, d_in, r, n = 9, 7, 2, 3
    B0, A0 = rng.standard_normal((d_out, r)), rng.standard_normal((r, d_in))
    Bs = [B0 + 0.1 * rng.standard_normal((d_out, r)) for _ in range(n)]
    As = [A0 + 0.1 * rng.standard_normal((r, d_in)) for _ in range(n)]
    ups = [
        dp.clip_update({"l": product_mean.product_update(B, A, B0, A0)}, 1e6)
        for B, A in zip(Bs, As, strict=True)
    ]
    mean = dp.noised_mean(ups, 1e6, 0.0, rng)["l"] + B0 @ A0
    B, A, info = product_mean.refactor_noised_product(mean, r)
    B_ref, A_ref, ref_info = aggregate_federa(Bs, As, None)
    np.testing.assert_allclose(B @ A, B_ref @ A_ref, atol=1e-10)
    assert info["trunc_rel_error"] == pytest.approx(ref_info["trunc_rel_error"], abs=1e-10)


# --------------------------------------------------------------------------- FLoRG


def test_gram_noise_is_symmetric_and_calibrated():
    rng = np.random.default_rng(4)
    r, k, m, C, z = 2, 24, 3, 0.8, 0.9
    prev = 0.3 * rng.standard_normal((r, k))
    As = [gram_dp.clip_florg(prev + rng.standard_normal((r, k)), C, prev) for _ in range(m)]
    stacked = np.concatenate(As)
    exact = stacked.T @ stacked / m
    delta = gram_dp.florg_sensitivity(C, prev)
    assert delta == pytest.approx(C * (2 * np.linalg.norm(prev, 2) + C))
    diag, off = [], []
    iu = np.triu_indices(k, 1)
    for _ in range(40):  # 40 draws: 960 diagonal, 11040 off-diagonal entries
        Q = gram_dp.noised_gram_sum(As, C, z, rng, prev_A=prev)
        assert np.array_equal(Q, Q.T)  # exactly symmetric
        E = Q - exact
        diag.append(np.diag(E))
        off.append(E[iu])
    sigma = z * delta / m
    assert_std(np.concatenate(diag), sigma)
    assert_std(np.concatenate(off), sigma)
    # clip-A-itself: Delta = C^2
    own = [gram_dp.clip_florg(rng.standard_normal((r, k)), C) for _ in range(m)]
    E = gram_dp.noised_gram_sum(own, C, z, rng) - sum(a.T @ a for a in own) / m
    assert_std(gram_sum_upper(E), z * C**2 / m)


def test_gram_clipping_bounds_one_clients_influence():
    rng = np.random.default_rng(5)
    r, k, m, C = 3, 10, 4, 0.5
    prev = rng.standard_normal((r, k))
    for anchor in (None, prev):  # clip A itself (Delta = C^2) or the update (centred)
        others = [gram_dp.clip_florg(rng.standard_normal((r, k)), C, anchor) for _ in range(m - 1)]
        huge = gram_dp.clip_florg(1e6 * rng.standard_normal((r, k)), C, anchor)
        with_it = gram_dp.noised_gram_sum(
            [*others, huge], C, 0.0, rng, prev_A=anchor, num_sampled=m
        )
        without = gram_dp.noised_gram_sum(others, C, 0.0, rng, prev_A=anchor, num_sampled=m)
        moved = np.linalg.norm(with_it - without)
        delta = gram_dp.florg_sensitivity(C, anchor)
        assert moved <= delta / m * (1 + 1e-12), (anchor is None, moved, delta / m)
        assert moved > 0.3 * delta / m  # and the bound is not vacuous
    assert gram_dp.florg_sensitivity(C) == C**2
    with pytest.raises(ValueError, match="exceeds the clipping bound"):
        gram_dp.noised_gram_sum([rng.standard_normal((r, k))], 1e-3, 1.0, rng)


def test_sensitivity_bounds_hold_for_worst_looking_updates():
    rng = np.random.default_rng(6)
    C = 0.7
    prevs = {"q": rng.standard_normal((3, 8)), "v": 2.0 * rng.standard_normal((3, 8))}
    delta = gram_dp.florg_sensitivity(C, prevs)
    p = max(np.linalg.norm(P, 2) for P in prevs.values())
    assert delta == pytest.approx(C * (2 * p + C))
    top = {n: np.linalg.svd(P)[0][:, :1] @ np.linalg.svd(P)[2][:1] for n, P in prevs.items()}
    candidates = [
        top,
        *({n: rng.standard_normal(P.shape) for n, P in prevs.items()} for _ in range(50)),
    ]
    for D in candidates:
        clipped = gram_dp.clip_florg({n: prevs[n] + D[n] for n in prevs}, C, prevs)
        terms = [clipped[n].T @ clipped[n] - prevs[n].T @ prevs[n] for n in prevs]
        assert np.sqrt(sum(np.sum(t**2) for t in terms)) <= delta * (1 + 1e-12)
    # the head clipped in the same unit: one Gaussian mechanism with multiplier z
    head = {"classifier.weight": 50 * rng.standard_normal((2, 8))}
    A, h = gram_dp.clip_florg_with_head({n: prevs[n] + top[n] for n in prevs}, head, C, 0.2, prevs)
    gram = np.sqrt(sum(np.sum((A[n].T @ A[n] - prevs[n].T @ prevs[n]) ** 2) for n in prevs))
    assert (gram / delta) ** 2 + (dp.flat_norm(h) / 0.2) ** 2 <= 1 + 1e-12


@pytest.mark.parametrize("centred", [False, True])
@pytest.mark.parametrize("procrustes", [True, False])
def test_private_step_without_noise_is_the_reference_truncate(centred, procrustes):
    rng = np.random.default_rng(7)
    r, k, n, C = 3, 16, 4, 1.5
    prev = rng.standard_normal((r, k))
    raw = [prev + 0.8 * rng.standard_normal((r, k)) for _ in range(n)]
    anchor = prev if centred else None
    clipped = [gram_dp.clip_florg(a, C, anchor) for a in raw]
    assert any(
        np.linalg.norm(a - b) > 1e-6 for a, b in zip(clipped, raw, strict=True)
    )  # clipping active
    Q = gram_dp.noised_gram_sum(clipped, C, 0.0, rng, prev_A=anchor)
    new, info = gram_dp.florg_private_step(Q, prev, r, procrustes=procrustes)
    ref, _ = aggregate_florg_reference(clipped, None, prev, procrustes, rank_mismatch="truncate")
    np.testing.assert_allclose(new, ref, atol=1e-10, rtol=0)
    assert info["rank"] == r and info["dropped"] == 0


def test_private_step_drops_non_positive_eigenvalues():
    prev = np.eye(3, 6)
    Q = np.diag([2.0, -1.0, 0.5, 0.0, -3.0, 0.1])
    new, info = gram_dp.florg_private_step(Q, prev)
    # top 3 in descending order: 2.0, 0.5, 0.1 -- all positive
    assert info["rank"] == 3 and info["negative_eigenvalues"] == 2
    np.testing.assert_allclose(new.T @ new, np.diag([2.0, 0, 0.5, 0, 0, 0.1]), atol=1e-12)
    new, info = gram_dp.florg_private_step(-np.eye(6), prev)  # all negative: nothing kept
    assert info["rank"] == 0 and info["dropped"] == 3 and not new.any()


def mixed_layers(rng, n=3):
    shapes = {"l0.q": (2, 12), "l0.v": (2, 12), "l1.q": (2, 12), "head.x": (3, 7)}
    prevs = {name: 0.5 * rng.standard_normal(s) for name, s in shapes.items()}
    raw = [{name: p + rng.standard_normal(p.shape) for name, p in prevs.items()} for _ in range(n)]
    return prevs, raw


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize(("centred", "procrustes"), [(True, True), (False, True), (True, False)])
def test_torch_batched_step_equals_numpy(device, centred, procrustes):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    rng = np.random.default_rng(8)
    C, z, n = 1.2, 0.7, 3
    prevs, raw = mixed_layers(rng, n)
    clipped = [gram_dp.clip_florg(c, C, prevs if centred else None) for c in raw]
    client_As = {name: [c[name] for c in clipped] for name in prevs}
    kwargs = dict(centred=centred, procrustes=procrustes, num_sampled=n + 1)
    ref, ref_info = gram_dp.private_florg_layers(
        client_As, prevs, C, z, np.random.default_rng(9), **kwargs
    )
    got, info = private_florg_layers_torch(
        client_As, prevs, C, z, np.random.default_rng(9), device=device, max_gram_bytes=1, **kwargs
    )
    assert list(got) == list(prevs)
    for name in prevs:
        np.testing.assert_allclose(got[name], ref[name], atol=1e-10, rtol=0)
        assert info[name]["rank"] == ref_info[name]["rank"]
        for key in ("eigengap", "drift", "noise_std"):
            assert info[name][key] == pytest.approx(ref_info[name][key], abs=1e-10)
    # the reference itself is the per-layer functions with one joint Delta
    delta = gram_dp.florg_sensitivity(C, prevs if centred else None)
    rng2 = np.random.default_rng(9)
    for name, prev in prevs.items():
        Q = gram_dp.noised_gram_sum(
            client_As[name], C, z, rng2, prev_A=prev if centred else None,
            sensitivity=delta, num_sampled=n + 1,
        )  # fmt: skip
        one, _ = gram_dp.florg_private_step(Q, prev, procrustes=procrustes)
        np.testing.assert_allclose(one, ref[name], atol=1e-12, rtol=0)


def test_layers_refuse_unclipped_clients():
    rng = np.random.default_rng(10)
    prevs, raw = mixed_layers(rng, 2)
    client_As = {name: [c[name] for c in raw] for name in prevs}
    with pytest.raises(ValueError, match="client 0"):
        gram_dp.private_florg_layers(client_As, prevs, 0.1, 1.0, rng)


# --------------------------------------------------------------------------- accounting


def test_epsilon_matches_dp_accounting_and_flowers_accountant():
    import dp_accounting as dpa
    from flwr.serverapp import (
        GaussianPrivacyEvent,
        NeighboringRelation,
        PrivacyConfig,
        RdpAccountant,
        SamplingMethod,
    )

    delta = 1e-5
    for z, (m, population), steps in [(1.1, (8, 8), 60), (1.0, (2, 8), 20)]:
        q = m / population
        ours = accounting.epsilon_for(z, q, steps, delta)
        direct = dpa.rdp.RdpAccountant()
        direct.compose(dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(z)), steps)
        sampling = SamplingMethod.NO_AMPLIFICATION if q == 1 else SamplingMethod.POISSON
        flower = RdpAccountant(
            PrivacyConfig(delta, population, NeighboringRelation.ADD_OR_REMOVE_ONE, sampling)
        )
        flower.compose(GaussianPrivacyEvent(z, m, population), count=steps)
        assert ours == pytest.approx(direct.get_epsilon(delta), rel=1e-12)
        assert ours == pytest.approx(flower.get_epsilon(delta), rel=1e-12)
    assert accounting.epsilon_for(1.0, 1.0, 0, delta) == 0.0
    # more noise, fewer rounds or rarer sampling: less epsilon
    assert accounting.epsilon_for(2.0, 1.0, 60, delta) < accounting.epsilon_for(1.1, 1.0, 60, delta)


def test_accountant_state_is_json_and_a_resumed_run_continues_the_count():
    acc = accounting.DpAccountant(1e-5)
    for _ in range(3):
        acc.record(1.2, 1.0)
    state = json.loads(json.dumps(acc.state_dict()))
    assert state == {"delta": 1e-5, "compositions": [[1.2, 1.0, 3]]}
    resumed = accounting.DpAccountant.from_state_dict(state)
    resumed.record(1.2, 1.0, 2)
    resumed.record(0.9, 1.0)
    assert resumed.steps == 6
    assert resumed.compositions == [(1.2, 1.0, 5), (0.9, 1.0, 1)]
    straight = accounting.DpAccountant(1e-5, [(1.2, 1.0, 5), (0.9, 1.0, 1)])
    assert resumed.epsilon() == straight.epsilon() > accounting.epsilon_for(1.2, 1.0, 5, 1e-5)
    with pytest.raises(ValueError, match="DpAccountant state"):
        accounting.DpAccountant.from_state_dict({"compositions": []})


def test_noise_multiplier_for_meets_the_target():
    z = accounting.noise_multiplier_for(3.0, 1.0, 30, 1e-5, tol=1e-4)
    assert accounting.epsilon_for(z, 1.0, 30, 1e-5) <= 3.0
    assert accounting.epsilon_for(z - 1e-3, 1.0, 30, 1e-5) > 3.0


# --------------------------------------------------------------------------- settings


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        (dict(clipping_norm=0.0), "dp-clipping-norm"),
        (dict(clipping_norm=-1.0), "dp-clipping-norm"),
        (dict(clipping_norm=float("nan")), "dp-clipping-norm"),
        (dict(clipping_norm=True), "dp-clipping-norm"),
        (dict(noise_multiplier=0.0), "dp-noise-multiplier"),
        (dict(noise_multiplier=-0.5), "dp-noise-multiplier"),
        (dict(noise_multiplier=float("inf")), "dp-noise-multiplier"),
        (dict(delta=0.0), "dp-delta"),
        (dict(delta=1.0), "dp-delta"),
        (dict(delta=2.0), "dp-delta"),
        (dict(delta="1e-5"), "dp-delta"),
        (dict(aggregation_weights="num-examples"), "aggregation-weights"),
    ],
)
def test_bad_settings_name_their_key(kwargs, key):
    settings = {**dict(clipping_norm=1.0, noise_multiplier=1.0, delta=1e-5), **kwargs}
    with pytest.raises(ValueError, match=key):
        dp_checks.check_dp_settings(**settings)


def test_mechanisms_and_accounting_name_the_bad_setting():
    rng = np.random.default_rng(11)
    ups = client_updates(rng, 2)
    with pytest.raises(ValueError, match="dp-clipping-norm"):
        dp.clip_update(ups[0], 0)
    with pytest.raises(ValueError, match="dp-noise-multiplier"):
        dp.noised_mean(ups, 1e6, -1.0, rng)
    with pytest.raises(ValueError, match="dp-clipping-norm"):
        gram_dp.clip_florg(np.ones((2, 3)), -1.0)
    with pytest.raises(ValueError, match="dp-noise-multiplier"):
        accounting.epsilon_for(0.0, 1.0, 10, 1e-5)
    with pytest.raises(ValueError, match="dp-delta"):
        accounting.epsilon_for(1.0, 1.0, 10, 0.0)
    with pytest.raises(ValueError, match="dp-delta"):
        accounting.DpAccountant(1.5)
    with pytest.raises(ValueError, match="sample rate"):
        accounting.epsilon_for(1.0, 0.0, 10, 1e-5)
    with pytest.raises(ValueError, match="dp must be one of"):
        dp_checks.check_dp_mode("local")
    assert dp_checks.check_dp_mode("central") == "central"
    dp_checks.check_dp_settings(clipping_norm=0.5, noise_multiplier=1, delta=1e-6)


def test_fedex_is_refused_with_the_reason():
    from flower_app.methods.registry import get_method
    from strategies.shared.base_method import BaseMethod

    with pytest.raises(ValueError, match="fedex-lora") as err:
        get_method("fedex-lora").check_dp_supported()
    assert "quadratic" in str(err.value) and "W0" in str(err.value)
    made_up = BaseMethod(name="made-up", summary="", adapter="lora", shared=("A",))
    with pytest.raises(ValueError, match="no differential-privacy mechanism"):
        made_up.check_dp_supported()
    assert get_method("florg").check_dp_supported() == "gram"
    assert get_method("federa").check_dp_supported() == "product-mean"
    mean = {get_method(m).check_dp_supported() for m in ("fedit", "ffa-lora", "fedsa-lora")}
    assert mean == {"mean"}
