"""``product-gap``: ||Σ wₙ Bₙ Aₙ − B_new A_new||_F / ||Σ wₙ Bₙ Aₙ||_F per layer from the factors
alone equals the dense formula; FedIT's, FedRot-LoRA's, RoLoRA's and a buffered round's rows
carry it when on and are unchanged when off; a non-LoRA method's rows carry none; dp=central
and secure aggregation are refused."""

from __future__ import annotations

import numpy as np
import pytest

import strategies.registry  # noqa: F401  (the methods register)
from flower_app.methods.registry import get_method
from flower_app.settings.config import ConfigError, resolve_config
from strategies.server.buffered_update import AsyncSettings, moved_replies
from strategies.server.product_gap import (
    GAP_KEY,
    GAP_MAX_KEY,
    layer_gaps,
    product_gap_norms,
)
from strategies.server.replies import Reply
from strategies.server.strategy import AdapterStrategy
from strategies.shared.validation import normalize_weights

HEAD = "classifier.weight"
SIZES = [3, 1, 2, 5]  # num-examples weighting: unequal wₙ
SHAPES = {"l0": (7, 9, 2), "l1": (5, 11, 3)}  # layer: (d_out, d_in, r), r differing per layer


def dense_rel_gap(Bs, As, w, B_new, A_new) -> float:
    """The definition, with every d_out x d_in product formed."""
    mean = sum(wn * B @ A for wn, B, A in zip(w, Bs, As, strict=True))
    return float(np.linalg.norm(mean - B_new @ A_new) / np.linalg.norm(mean))


def lora_state(rng: np.random.Generator) -> dict[str, np.ndarray]:
    state = {}
    for layer, (d_out, d_in, r) in SHAPES.items():
        state[f"{layer}.lora_A"] = rng.normal(size=(r, d_in))
        state[f"{layer}.lora_B"] = rng.normal(size=(d_out, r))
    state[HEAD] = rng.normal(size=(2, 5))
    return state


def replies(rng, start, *, stale: bool = False, keys=None) -> list[Reply]:
    """One reply per SIZES entry, each a perturbed ``start`` (float32, as on the wire);
    ``keys``: the keys it carries (all of them by default)."""
    out = []
    for i, n in enumerate(SIZES):
        arrays = {
            k: (v + 0.3 * rng.normal(size=v.shape)).astype(np.float32)
            for k, v in start.items()
            if keys is None or k in keys
        }
        extra = {"start": start, "staleness": i % 2} if stale else {}
        out.append(Reply(node=10 + i, partition=i, arrays=arrays, num_examples=float(n),
                         train_loss=0.5, **extra))  # fmt: skip
    return out


def strategy(method: str, state, **options) -> AdapterStrategy:
    common = {"screen_updates": False, "weighting": "num-examples", **options}
    if method == "fedrot-lora":
        from strategies.fedrot_lora.strategy import FedRotLoRAStrategy

        return FedRotLoRAStrategy(state, method=get_method(method), **common)
    return AdapterStrategy(state, method=get_method(method), **common)


def expected_row(sent, payloads, w, new_state) -> tuple[float, float]:
    """(mean, max) over layers of the dense relative gap; a factor a reply lacks is
    ``sent``'s."""
    gaps = []
    for layer in SHAPES:
        kb, ka = f"{layer}.lora_B", f"{layer}.lora_A"
        Bs = [np.asarray(p.get(kb, sent[kb]), np.float64) for p in payloads]
        As = [np.asarray(p.get(ka, sent[ka]), np.float64) for p in payloads]
        gaps.append(dense_rel_gap(Bs, As, w, new_state[kb], new_state[ka]))
    return float(np.mean(gaps)), float(np.max(gaps))


# -- the formula ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("d_out", "d_in", "ranks", "r_new"),
    [(6, 8, [2, 2, 2], 2), (30, 4, [1, 3, 2, 4], 4), (3, 50, [5, 5], 5), (16, 16, [4], 2)],
)
@pytest.mark.parametrize("seed", [0, 1])
def test_the_low_rank_norms_equal_the_dense_ones(d_out, d_in, ranks, r_new, seed):
    rng = np.random.default_rng(seed)
    Bs = [rng.normal(size=(d_out, r)) for r in ranks]
    As = [rng.normal(size=(r, d_in)) for r in ranks]
    w = rng.dirichlet(np.ones(len(ranks)))
    B_new, A_new = rng.normal(size=(d_out, r_new)), rng.normal(size=(r_new, d_in))
    mean = sum(wn * B @ A for wn, B, A in zip(w, Bs, As, strict=True))
    gap, norm = product_gap_norms(Bs, As, w, B_new, A_new)
    assert gap == pytest.approx(np.linalg.norm(mean - B_new @ A_new), rel=1e-10)
    assert norm == pytest.approx(np.linalg.norm(mean), rel=1e-10)
    if len(set(ranks)) == 1:  # FedIT's product of the means: the classic aggregation bias
        B_bar = sum(wn * B for wn, B in zip(w, Bs, strict=True))
        A_bar = sum(wn * A for wn, A in zip(w, As, strict=True))
        gap, norm = product_gap_norms(Bs, As, w, B_bar, A_bar)
        assert gap / norm == pytest.approx(dense_rel_gap(Bs, As, w, B_bar, A_bar), rel=1e-10)


def test_an_exact_product_gives_zero_and_a_zero_mean_product_is_handled():
    rng = np.random.default_rng(3)
    B, A = rng.normal(size=(6, 2)), rng.normal(size=(2, 7))
    # one client: its own factors are the exact mean product (0 up to the 1e-8 resolution)
    gap, norm = product_gap_norms([B], [A], [1.0], B, A)
    assert gap <= 1e-7 * norm
    zero_B = np.zeros_like(B)
    sent = {"l0.lora_B": zero_B, "l0.lora_A": A}
    payloads = [{"l0.lora_B": zero_B, "l0.lora_A": A + 1.0}, {"l0.lora_B": zero_B}]
    w = np.array([0.5, 0.5])
    # every B zero and B_new A_new zero: gap 0; B_new A_new nonzero: the layer left out
    assert layer_gaps(sent, payloads, w, {"l0.lora_B": zero_B, "l0.lora_A": A}) == {"l0": 0.0}
    assert layer_gaps(sent, payloads, w, {"l0.lora_B": B, "l0.lora_A": A}) == {}


# -- the strategy's rows -------------------------------------------------------------------
@pytest.mark.parametrize("method", ["fedit", "fedrot-lora", "federa"])
def test_the_round_records_the_dense_gap(method):
    rng = np.random.default_rng(0)
    sent = lora_state(rng)
    kept = replies(rng, sent)
    s = strategy(method, sent, product_gap=True)
    s.aggregate_replies(2, kept)
    row = s.round_metrics[2]
    w = normalize_weights(SIZES, len(SIZES))
    mean, worst = expected_row(sent, [r.arrays for r in kept], w, s.global_state)
    assert row[GAP_KEY] == pytest.approx(mean, rel=1e-10)
    assert row[GAP_MAX_KEY] == pytest.approx(worst, rel=1e-10)
    assert 0 < row[GAP_KEY] <= row[GAP_MAX_KEY]
    if method == "fedit":  # the product of the means, checked from the factors themselves
        for key in sent:
            mean = sum(wn * r.arrays[key].astype(np.float64) for wn, r in zip(w, kept, strict=True))
            np.testing.assert_allclose(s.global_state[key], mean, rtol=1e-12)


def test_off_by_default_the_rows_are_unchanged():
    rng = np.random.default_rng(1)
    sent = lora_state(rng)
    kept = replies(rng, sent)
    off, on = strategy("fedit", sent), strategy("fedit", sent, product_gap=True)
    off.aggregate_replies(1, kept)
    on.aggregate_replies(1, kept)
    assert GAP_KEY not in off.round_metrics[1] and GAP_MAX_KEY not in off.round_metrics[1]
    row_off = {k: v for k, v in off.round_metrics[1].items() if k != "agg-seconds"}
    row_on = {k: v for k, v in on.round_metrics[1].items() if k != "agg-seconds"}
    assert row_on.pop(GAP_KEY) > 0 and row_on.pop(GAP_MAX_KEY) > 0
    assert row_on == row_off
    for key, value in off.global_state.items():
        np.testing.assert_array_equal(on.global_state[key], value)


def test_a_one_factor_round_takes_the_other_factor_from_the_global_state():
    rng = np.random.default_rng(2)
    sent = lora_state(rng)
    s = strategy("rolora", sent, product_gap=True)
    trained = s.method.trained_parts(1)
    keys = {k for k in sent if k == HEAD or any(k.endswith(f".lora_{p}") for p in trained)}
    kept = replies(rng, sent, keys=keys)
    assert all(set(r.arrays) == keys for r in kept) and len(keys) < len(sent)
    s.aggregate_replies(1, kept)
    w = normalize_weights(SIZES, len(SIZES))
    mean, _ = expected_row(sent, [r.arrays for r in kept], w, s.global_state)
    # averaging one factor with the other fixed is exact: a gap of 0 up to rounding
    assert mean < 1e-12 and s.round_metrics[1][GAP_KEY] < 1e-7


def test_a_buffered_round_measures_the_replies_the_rule_took():
    rng = np.random.default_rng(4)
    sent = lora_state(rng)
    kept = replies(rng, sent, stale=True)
    s = strategy("fedit", sent, product_gap=True,
                 async_rounds=AsyncSettings(staleness_exponent=0.5))  # fmt: skip
    moved = moved_replies(sent, kept, 0.5, server_lr=1.0)
    s.aggregate_replies(3, kept)
    w = normalize_weights(SIZES, len(SIZES))
    mean, worst = expected_row(sent, moved, w, s.global_state)
    assert s.round_metrics[3][GAP_KEY] == pytest.approx(mean, rel=1e-10)
    assert s.round_metrics[3][GAP_MAX_KEY] == pytest.approx(worst, rel=1e-10)


# -- the setting -----------------------------------------------------------------------------
def test_the_setting_reaches_the_strategy():
    config = resolve_config({}, {"method": "fedrot-lora", "product-gap": True})
    assert get_method("fedrot-lora").strategy_settings(config)["product_gap"] is True
    state = lora_state(np.random.default_rng(5))
    assert get_method("fedrot-lora").build_strategy(config, state).product_gap is True
    default = resolve_config({}, {"method": "fedit"})
    assert default.product_gap is False
    assert get_method("fedit").build_strategy(default, state).product_gap is False


def test_a_method_without_lora_factors_records_no_gap():
    """FLoRG's counterpart, gram_rel_error, is in every row; product-gap adds nothing."""
    from tests.harness.strategy_helpers import strategy_for

    rng = np.random.default_rng(9)
    state = {"enc.q.A": rng.normal(size=(2, 6)), HEAD: rng.normal(size=(2, 6))}
    florg = strategy_for("florg", state, product_gap=True, screen_updates=False)
    payloads = [{k: v + 0.1 * rng.normal(size=v.shape) for k, v in state.items()} for _ in "ab"]
    _, info = florg.aggregate_adapter(1, payloads, np.full(2, 0.5))
    assert "gram_rel_error" in info and GAP_KEY not in info and GAP_MAX_KEY not in info


def test_secure_aggregation_is_refused():
    with pytest.raises(ConfigError, match="product-gap"):
        resolve_config(
            {}, {"method": "fedit", "product-gap": True, "secure-aggregation": "secaggplus"}
        )


def test_central_dp_is_refused():
    with pytest.raises(ConfigError, match="product-gap") as err:
        resolve_config({}, {"method": "fedit", "product-gap": True, "dp": "central"})
    assert "dp=central" in str(err.value)
