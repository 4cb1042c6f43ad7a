"""``async-server-lr``, FedBuff's server learning rate η_g (Nguyen et al., AISTATS 2022):
x_{t+1} = x_t + η_g Σ wₙ cₙ (xₙ − x_vₙ) for a mean method, Q = A_tᵀA_t + η_g Σ wₙ cₙ
(AₙᵀAₙ − A_vₙᵀA_vₙ) for FLoRG. η_g = 1 is the update as it was, bit for bit; another rate
steps a buffer of fresh replies too; a synchronous run refuses any other rate."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import pytest

import strategies.registry  # noqa: F401  (the methods register)
from flower_app.methods.registry import get_method
from flower_app.settings.config import ConfigError, resolve_config
from strategies.florg.buffered_rule import aggregate_florg_buffered
from strategies.florg.strategy import FLoRGStrategy
from strategies.server.buffered_update import AsyncSettings, staleness_factor, staleness_factors
from strategies.server.replies import Reply
from strategies.server.strategy import AdapterStrategy
from strategies.shared.averaging import weighted_average
from strategies.shared.validation import normalize_weights

HEAD = "classifier.weight"
EXPONENT = 0.5
SIZES = [3, 1, 2]  # num-examples weighting: unequal wₙ
LAYERS = ("l0.A", "l1.A")


def lora_state(rng: np.random.Generator) -> dict[str, np.ndarray]:
    return {
        "l0.lora_A": rng.normal(size=(2, 6)),
        "l0.lora_B": rng.normal(size=(5, 2)),
        HEAD: rng.normal(size=(2, 5)),
    }


def florg_state(rng: np.random.Generator) -> dict[str, np.ndarray]:
    return {"l0.A": rng.normal(size=(2, 6)), "l1.A": rng.normal(size=(2, 6)),
            HEAD: rng.normal(size=(2, 5))}  # fmt: skip


def strategy(
    method: str, state: dict[str, np.ndarray], procrustes: bool = True, **settings: float
) -> AdapterStrategy:
    common = {
        "method": get_method(method),
        "screen_updates": False,
        "weighting": "num-examples",
        "async_rounds": AsyncSettings(staleness_exponent=EXPONENT, **settings),
    }
    if method == "florg":
        return FLoRGStrategy(
            state, procrustes=procrustes, fedavg_gap="off", server_device="cpu", **common
        )
    return AdapterStrategy(state, **common)


def replies(rng, starts, staleness) -> list[Reply]:
    return [
        Reply(node=10 + i, partition=i, num_examples=float(n), train_loss=0.5,
              arrays={k: (v + 0.1 * rng.normal(size=v.shape)).astype(np.float32)
                      for k, v in start.items()},
              start=start, staleness=tau)
        for i, (start, tau, n) in enumerate(zip(starts, staleness, SIZES, strict=True))
    ]  # fmt: skip


def stale_buffer(make, seed: int):
    rng = np.random.default_rng(seed)
    old, older, current = make(rng), make(rng), make(rng)
    return current, replies(rng, [old, current, older], [1, 0, 3])


def weights() -> np.ndarray:
    return normalize_weights(SIZES, len(SIZES))


def old_moved_replies(current: Mapping[str, np.ndarray], kept: list[Reply], keys=None):
    """``moved_replies`` as it was before the server rate: x_t + cₙ (xₙ − x_vₙ)."""
    return [
        {k: current[k] + c * (np.asarray(r.arrays[k], np.float64) - r.start[k])
         for k in (r.arrays if keys is None else keys)}
        for r, c in zip(kept, [staleness_factor(r.staleness, EXPONENT) for r in kept],
                        strict=True)
    ]  # fmt: skip


def fedbuff_step(current, kept, server_lr: float) -> dict[str, np.ndarray]:
    """x_t + η_g Σ wₙ cₙ (xₙ − x_vₙ), directly in float64."""
    w = weights()
    return {
        key: current[key] + server_lr * sum(
            wn * staleness_factor(r.staleness, EXPONENT)
            * (r.arrays[key].astype(np.float64) - r.start[key])
            for wn, r in zip(w, kept, strict=True))
        for key in current
    }  # fmt: skip


def gram_target(current, kept, key: str, server_lr: float) -> tuple[np.ndarray, np.ndarray]:
    """Q = A_tᵀA_t + η_g Σ wₙ cₙ (AₙᵀAₙ − A_vₙᵀA_vₙ) formed in float64, and its best
    rank-r PSD approximation (its top r eigenpairs, negatives at 0): A_newᵀA_new without
    Procrustes, which keeps the top r rows of Λ^½ Pᵀ (eq. Gram_decompose)."""
    A = current[key]
    Q = A.T @ A
    for wn, r in zip(weights(), kept, strict=True):
        An, Av = r.arrays[key].astype(np.float64), r.start[key]
        Q += server_lr * wn * staleness_factor(r.staleness, EXPONENT) * (An.T @ An - Av.T @ Av)
    lam, P = np.linalg.eigh(Q)
    lam, P = np.clip(lam[::-1][: A.shape[0]], 0.0, None), P[:, ::-1][:, : A.shape[0]]
    return Q, (P * lam) @ P.T


# -- η_g = 1: the update as it was, bit for bit -----------------------------------------------
@pytest.mark.parametrize("settings", [{}, {"server_lr": 1.0}])
def test_a_rate_of_one_is_the_mean_methods_old_update_bit_for_bit(settings):
    current, buffer = stale_buffer(lora_state, 0)
    s = strategy("fedit", current, **settings)
    s.aggregate_replies(4, buffer)
    moved = old_moved_replies(current, buffer)
    expected, _ = get_method("fedit").aggregate(current, moved, weights())
    expected[HEAD] = weighted_average([m[HEAD] for m in moved], weights(), HEAD)
    for key in current:
        assert s.global_state[key].tobytes() == expected[key].tobytes(), key


@pytest.mark.parametrize("settings", [{}, {"server_lr": 1.0}])
def test_a_rate_of_one_is_florgs_old_update_bit_for_bit(settings):
    current, buffer = stale_buffer(florg_state, 1)
    s = strategy("florg", current, **settings)
    s.aggregate_replies(4, buffer)
    factors = [staleness_factor(r.staleness, EXPONENT) for r in buffer]  # cₙ, no rate
    for key in LAYERS:
        expected, _ = aggregate_florg_buffered(
            [r.arrays[key] for r in buffer], [r.start[key] for r in buffer], weights(),
            factors, current[key],
        )  # fmt: skip
        assert s.global_state[key].tobytes() == expected.tobytes(), key
    head = old_moved_replies(current, buffer, [HEAD])
    expected_head = weighted_average([h[HEAD] for h in head], weights(), HEAD)
    assert s.global_state[HEAD].tobytes() == expected_head.tobytes()


def test_the_factors_of_a_rate_of_one_are_the_staleness_factors_themselves():
    _, buffer = stale_buffer(lora_state, 2)
    plain = [staleness_factor(r.staleness, EXPONENT) for r in buffer]
    assert staleness_factors(buffer, EXPONENT, 1.0) == plain
    assert staleness_factors(buffer, EXPONENT, 0.5) == [0.5 * c for c in plain]


# -- η_g = 0.5: FedBuff's update ------------------------------------------------------------
def test_a_mean_method_moves_by_the_rate_times_the_weighted_stale_deltas():
    current, buffer = stale_buffer(lora_state, 3)
    s = strategy("fedit", current, server_lr=0.5)
    s.aggregate_replies(4, buffer)
    expected, full = fedbuff_step(current, buffer, 0.5), fedbuff_step(current, buffer, 1.0)
    for key in current:
        assert np.allclose(s.global_state[key], expected[key], rtol=0, atol=1e-12), key
        assert not np.allclose(s.global_state[key], full[key]), key  # the rate did act


def test_florgs_gram_average_moves_by_the_rate_times_the_weighted_gram_deltas():
    """Without Procrustes A_newᵀA_new is Q's rank-r part; with it (a rotation onto A_t that
    mixes in Q's other positive eigenpairs: rule.factor_for_rank) the step reports its
    error against the directly formed Q."""
    current, buffer = stale_buffer(florg_state, 4)
    plain = strategy("florg", current, procrustes=False, server_lr=0.5)
    aligned = strategy("florg", current, server_lr=0.5)
    plain.aggregate_replies(4, buffer)
    aligned.aggregate_replies(4, buffer)
    for key in LAYERS:
        Q, rank_r = gram_target(current, buffer, key, 0.5)
        A = plain.global_state[key]
        assert np.allclose(A.T @ A, rank_r, rtol=0, atol=1e-10), key
        _, full = gram_target(current, buffer, key, 1.0)
        assert not np.allclose(A.T @ A, full, atol=1e-6), key  # the rate did act
        A = aligned.global_state[key]
        _, info = aggregate_florg_buffered(
            [r.arrays[key] for r in buffer], [r.start[key] for r in buffer], weights(),
            staleness_factors(buffer, EXPONENT, 0.5), current[key],
        )  # fmt: skip
        rel = np.linalg.norm(A.T @ A - Q) / np.linalg.norm(Q)
        assert info["gram_rel_error"] == pytest.approx(rel, rel=1e-8, abs=1e-12), key
    assert np.allclose(
        aligned.global_state[HEAD], fedbuff_step(current, buffer, 0.5)[HEAD], rtol=0, atol=1e-12
    )


# -- a fresh buffer under η_g != 1 ----------------------------------------------------------
def test_a_fresh_buffer_under_another_rate_is_not_the_synchronous_step():
    """All replies trained from x_t: the update is x_t + η_g (mean − x_t), not the mean."""
    rng = np.random.default_rng(5)
    current = lora_state(rng)
    buffer = replies(rng, [current] * 3, [0, 0, 0])
    s, sync = strategy("fedit", current, server_lr=0.5), strategy("fedit", current)
    s.aggregate_replies(1, buffer)
    sync.aggregate_replies(1, buffer)
    for key in current:
        mean = weighted_average([r.arrays[key] for r in buffer], weights(), key)
        expected = current[key] + 0.5 * (mean - current[key])
        assert np.allclose(s.global_state[key], expected, rtol=0, atol=1e-12), key
        assert np.allclose(sync.global_state[key], mean, rtol=0, atol=1e-12), key


def test_a_fresh_florg_buffer_under_another_rate_steps_half_way_in_the_gram_average():
    rng = np.random.default_rng(6)
    current = florg_state(rng)
    buffer = replies(rng, [current] * 3, [0, 0, 0])
    s = strategy("florg", current, procrustes=False, server_lr=0.5)
    sync = strategy("florg", current, procrustes=False)
    s.aggregate_replies(1, buffer)
    sync.aggregate_replies(1, buffer)
    for key in LAYERS:
        Q, rank_r = gram_target(current, buffer, key, 0.5)
        fresh = [r.arrays[key].astype(np.float64) for r in buffer]
        average = sum(wn * a.T @ a for wn, a in zip(weights(), fresh, strict=True))
        half_way = 0.5 * current[key].T @ current[key] + 0.5 * average
        assert np.allclose(Q, half_way, rtol=0, atol=1e-12)
        A = s.global_state[key]
        assert np.allclose(A.T @ A, rank_r, rtol=0, atol=1e-10), key
        B = sync.global_state[key]  # the synchronous step: the Gram average itself
        assert not np.allclose(A.T @ A, B.T @ B, atol=1e-6), key


# -- the setting ------------------------------------------------------------------------------
def test_the_rate_reaches_the_strategy_from_the_run_settings():
    config = resolve_config({"round-mode": "async", "async-server-lr": 0.5})
    assert config.async_server_lr == 0.5
    assert get_method("fedit").strategy_settings(config)["async_rounds"].server_lr == 0.5
    default = resolve_config({"round-mode": "async"})
    assert get_method("florg").strategy_settings(default)["async_rounds"].server_lr == 1.0


def test_a_synchronous_run_refuses_another_rate_naming_the_key():
    with pytest.raises(ConfigError, match="async-server-lr") as err:
        resolve_config({"async-server-lr": 0.5})
    assert "only with round-mode=async" in str(err.value)
    assert resolve_config({"async-server-lr": 1.0}).async_server_lr == 1.0


@pytest.mark.parametrize("bad", [0.0, -0.5, float("inf")])
def test_a_rate_that_is_not_finite_and_positive_is_refused(bad):
    with pytest.raises(ConfigError, match="async-server-lr: .*finite and > 0"):
        resolve_config({"round-mode": "async", "async-server-lr": bad})
