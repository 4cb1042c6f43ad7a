"""secure-aggregation=secaggplus on the common strategy: a round of ``SecureRounds`` through the
ClientApp's mod (flower_app/secure/client_mod.py) over an in-process grid gives every method
that takes it the state its plain round gives, within the quantisation's error (FedEx-LoRA's
folds into W0 and each node's folded round included); FLoRG's Gram contribution and step; the
refusals. End to end on the real engine:
tests/runtime/test_secure_aggregation_app.py."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.supercore.task_identity import TaskIdentity

from florg_tools.in_process_grid import InProcessGrid
from flower_app.methods.registry import get_method, method_names
from flower_app.secure.client_mod import secure_aggregation_mod
from flower_app.settings.checks import ConfigError
from flower_app.wire.records import from_array_record, to_array_record
from strategies.florg.secure import gram_contribution, gram_shapes, unpack_gram
from strategies.server.secure_rounds import SecureRounds, contribution_bytes
from tests.harness.strategy_helpers import run_settings, strategy_for

SECURE = {"secure_aggregation": "secaggplus", "screen_updates": False}
# fedrot-lora: round 1 rotates nothing (its rotated rounds: the FedRot-LoRA tests below)
MEAN_METHODS = ["fedit", "ffa-lora", "fedsa-lora", "rolora", "fedsvd", "hetlora", "fedrot-lora"]
PRODUCT_METHODS = ["federa", "flexlora"]
FOLDING_METHODS = ["fedex-lora"]  # secure_sum 'mean-and-product': A, B and each BₙAₙ
# secure_sum 'gram': each layer's Gram; florg-signed's one per sign block of A
FLORG_METHODS = ["florg", "florg-no-procrustes", "florg-signed"]
NODES = [11, 12, 13, 14]


@pytest.fixture(autouse=True)
def server_identity(monkeypatch):
    for name in ("_run_id", "_task_id", "_node_id"):
        monkeypatch.setattr(TaskIdentity, name, 1)


def lora_state(rng, method="fedit", rank=3, d=8) -> dict[str, np.ndarray]:
    """A LoRA state of the parts ``method`` shares (the global state a server holds)."""
    shared = get_method(method).shared
    state = {}
    for layer in ("enc.q", "enc.v"):
        if "A" in shared:
            state[f"{layer}.lora_A"] = 0.3 * rng.standard_normal((rank, d))
        if "B" in shared:
            state[f"{layer}.lora_B"] = 0.3 * rng.standard_normal((d, rank))
    return {**state, "classifier.weight": 0.3 * rng.standard_normal((2, d))}


def florg_state(rng, rank=3, k=8) -> dict[str, np.ndarray]:
    return {
        "enc.q.A": 0.3 * rng.standard_normal((rank, k)),
        "enc.v.A": 0.3 * rng.standard_normal((rank, 6)),
        "classifier.weight": 0.3 * rng.standard_normal((2, k)),
    }


class ClientGrid(InProcessGrid):
    """The in-process grid (florg_tools/in_process_grid.py) with partitions by position in
    NODES; a node in ``failing`` raises in training (after it shared its keys); a node in
    ``folded`` reports that round as its last folded one ('residual-round', a folding
    method's metric); ``train_examples`` and ``metrics`` change what every reply carries."""

    def __init__(self, trained, method: str, failing=(), folded=None, **run_config):
        super().__init__(trained, method, **run_config)
        self.failing = set(failing)
        self.folded: dict[int, int] = dict(folded or {})
        self.train_examples: dict[int, int] = {}  # node -> num-examples (default 10)
        self.extra_metrics: dict[str, float] = {}  # more metrics every reply carries

    def metrics(self, node: int) -> MetricRecord:
        metrics = MetricRecord({"partition-id": NODES.index(node),
                                "num-examples": self.train_examples.get(node, 10),
                                "train-loss": 0.5})  # fmt: skip
        if node in self.folded:
            metrics["residual-round"] = self.folded[node]
        for key, value in self.extra_metrics.items():
            metrics[key] = value
        return metrics

    def train(self, msg: Message, context: Context) -> Message:
        if msg.metadata.dst_node_id in self.failing:
            raise RuntimeError("the node died while training")
        return super().train(msg, context)


def uploads(strategy, rng, nodes=NODES) -> dict[int, dict[str, np.ndarray]]:
    """What each node uploads in round 1: the global state moved a little (float32, as a
    reply travels)."""
    up = strategy.uplink_state(1)
    return {
        n: {k: (v + 0.05 * rng.standard_normal(v.shape)).astype(np.float32) for k, v in up.items()}
        for n in nodes
    }


def plain_reply(arrays, node) -> Message:
    metrics = MetricRecord({"partition-id": NODES.index(node), "num-examples": 10,
                            "train-loss": 0.5})  # fmt: skip
    msg = Message(RecordDict({"arrays": to_array_record(arrays), "metrics": metrics}),
                  dst_node_id=node, message_type="train")  # fmt: skip
    return Message(msg.content, reply_to=msg)


def secure_round(method, state, trained, failing=(), folded=None, server_round=1, **settings):
    strategy = strategy_for(method, state, **SECURE, **settings, min_available_nodes=len(trained))
    if strategy.dp is not None:
        strategy.dp.noise_multiplier = 0.0  # tests only: the release without noise
    run_config = {key.replace("_", "-"): value for key, value in settings.items()}
    grid = ClientGrid(trained, method, failing, folded, **run_config)
    arrays, metrics = strategy.round_loop.round(
        grid, server_round, to_array_record(state), RecordDict(), 60
    )
    return strategy, grid, arrays, metrics


def products_and_splits(state: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A LoRA state as what its SVD re-factorisation fixes: each layer's product B A and
    BᵀB (= S_r, diagonal, whichever sign each singular pair takes), the head as it is."""
    out = {}
    for key, value in state.items():
        if key.endswith(".lora_A"):
            layer = key[: -len(".lora_A")]
            B = state[f"{layer}.lora_B"]
            out[f"{layer}.BA"], out[f"{layer}.BtB"] = B @ value, B.T @ B
        elif not key.endswith(".lora_B"):
            out[key] = value
    return out


@pytest.mark.parametrize(
    "method",
    MEAN_METHODS + FLORG_METHODS + PRODUCT_METHODS + FOLDING_METHODS,
)
def test_a_secure_round_gives_the_plain_rounds_state_within_the_quantisation(method):
    rng = np.random.default_rng(len(method))
    state = florg_state(rng) if method.startswith("florg") else lora_state(rng, method)
    plain = strategy_for(method, state, screen_updates=False, min_available_nodes=4)
    trained = uploads(plain, rng)
    expected, _ = plain.aggregate_train(1, [plain_reply(trained[n], n) for n in NODES])
    # each node's last folded round, as a folding method's client reports it (clear metrics)
    folded = {n: i for i, n in enumerate(NODES)} if method in FOLDING_METHODS else None
    strategy, grid, arrays, metrics = secure_round(method, state, trained, folded=folded)
    got, want = from_array_record(arrays), from_array_record(expected)
    assert set(got) == set(want)
    settings = strategy.round_loop.settings.secaggplus
    step = 2 * settings.clipping_range / settings.quantization_range  # per value and client
    # a mean of 4: each value rounded by under one step (their mean too), divided by the
    # rounded weight sum (relative error under one step): within 2 steps of the plain mean
    tol = 2 * step
    if method.startswith("florg"):
        # FLoRG's factor through its Gram (florg-signed's: each sign block's through its own),
        # aligned by Procrustes with the previous factor (block), so comparable as it is
        tol = 50 * step
    if method in PRODUCT_METHODS:
        # The mean product is within one step a value, then truncated to rank r by SVD, whose
        # factors are fixed only up to each singular pair's sign: compare each layer's B A and
        # BᵀB = S_r (the split S_r^½ to each side), and the head. With the gap s_r - s_r+1
        # (about 0.4 here) far above the error E, the truncation moves E by a factor of order
        # s_1 / (s_r - s_r+1) at worst (Wedin); measured: under one step a value. A server that
        # averaged the factors instead is off by hundreds of steps.
        got, want = products_and_splits(got), products_and_splits(want)
        tol = 10 * step
    for key in want:
        np.testing.assert_allclose(got[key], want[key], atol=tol, rtol=0, err_msg=key)
    if method in FOLDING_METHODS:
        # FedEx-LoRA's fold: residual = avg(BA) - avg(B) avg(A), each mean within 2 steps; the
        # product of the means moves by |ΔB| |A| + |B| |ΔA| over r = 3 terms of entries ~0.3,
        # so under 2 + 2 · 3 · 0.5 · 2 = 8 steps. A server that folded nothing (or the
        # residual of the mean factors alone, zero) is off by the residual itself, ~6·10⁻³.
        fold_tol = 8 * step
        assert set(strategy.residuals) == set(plain.residuals) == {1}
        for layer, residual in plain.residuals[1].items():
            np.testing.assert_allclose(strategy.residuals[1][layer].to_dense(),
                                       residual.to_dense(), atol=fold_tol, rtol=0)  # fmt: skip
            np.testing.assert_allclose(strategy.cumulative[layer], plain.cumulative[layer],
                                       atol=fold_tol, rtol=0)  # fmt: skip
            assert np.abs(residual.to_dense()).max() > 100 * fold_tol  # a fold worth checking
        assert metrics["residual_norm"] == pytest.approx(plain.round_metrics[1]["residual_norm"],
                                                         rel=1e-3)  # fmt: skip
        # each node's 'residual-round' reached the server with its masked vector
        assert strategy.node_synced == folded
    assert metrics["clients"] == 4 and metrics["secure-failed"] == 0
    assert metrics["partitions"] == [0, 1, 2, 3] and metrics["train-loss"] == 0.5
    assert metrics["uplink-bytes"] > 0 and metrics["downlink-bytes"] > 0
    # what the server received from each node: a masked vector and metrics, no arrays
    for reply in grid.collected.values():
        assert not reply.content.array_records
        assert set(reply.content.metric_records) == {"metrics"}


@pytest.mark.parametrize("d", [8, 20])
def test_floras_secure_round_folds_the_plain_rounds_update_within_the_quantisation(d):
    """FLoRA's clients add their products BₙAₙ; the server factors the mean at the stack's
    width N r = 12: with d = 8 the factors are exact (12 >= 8), with d = 20 the SVD cuts the
    quantisation beyond rank 12 (the update's rank). The fold P Q, the cumulative fold and the
    update's norm are the plain round's, the fresh LoRA the same draw, the head the mean."""
    rng = np.random.default_rng(d)
    state = lora_state(rng, "flora", d=d)
    plain = strategy_for("flora", state, screen_updates=False, min_available_nodes=4)
    trained = uploads(plain, rng)
    expected, _ = plain.aggregate_train(1, [plain_reply(trained[n], n) for n in NODES])
    folded = {n: 0 for n in NODES}
    strategy, grid, arrays, metrics = secure_round("flora", state, trained, folded=folded)
    settings = strategy.round_loop.settings.secaggplus
    step = 2 * settings.clipping_range / settings.quantization_range
    got, want = from_array_record(arrays), from_array_record(expected)
    assert set(got) == set(want)
    for key in want:  # the fresh LoRA drawn alike; the head's mean within 2 steps
        np.testing.assert_allclose(got[key], want[key], atol=2 * step, rtol=0, err_msg=key)
    assert set(strategy.residuals) == set(plain.residuals) == {1}
    for layer, residual in plain.residuals[1].items():
        secure_fold = strategy.residuals[1][layer]
        assert secure_fold.P.shape[1] <= residual.P.shape[1]  # never wider than the stack
        # each entry of the mean product within 2 steps; with d = 20 the cut removes noise
        # only (the update's rank is 12), a few steps at most
        np.testing.assert_allclose(secure_fold.to_dense(), residual.to_dense(),
                                   atol=10 * step, rtol=0)  # fmt: skip
        np.testing.assert_allclose(strategy.cumulative[layer], plain.cumulative[layer],
                                   atol=10 * step, rtol=0)  # fmt: skip
        assert np.abs(residual.to_dense()).max() > 100 * 10 * step  # a fold worth checking
    assert metrics["update_norm"] == pytest.approx(plain.round_metrics[1]["update_norm"],
                                                   rel=1e-4)  # fmt: skip
    assert metrics["clients"] == 4 and metrics["secure-failed"] == 0
    assert strategy.node_synced == folded
    for reply in grid.collected.values():  # a masked vector and metrics, no arrays
        assert not reply.content.array_records


def test_the_server_rule_is_never_handed_a_single_reply():
    rng = np.random.default_rng(1)
    state = lora_state(rng)
    strategy = strategy_for("fedit", state, **SECURE, min_available_nodes=4)
    calls = []
    original = strategy.aggregate_adapter
    strategy.aggregate_adapter = lambda r, payloads, w: (
        calls.append(len(payloads)) or original(r, payloads, w)
    )
    grid = ClientGrid(uploads(strategy, rng), "fedit")
    strategy.round_loop.round(grid, 1, to_array_record(state), RecordDict(), 60)
    assert calls == [1]  # one mean, never the replies


def test_a_node_lost_after_sharing_its_keys_leaves_the_sum_of_the_others():
    rng = np.random.default_rng(2)
    state = lora_state(rng)
    plain = strategy_for("fedit", state, screen_updates=False, min_available_nodes=3)
    trained = uploads(plain, rng)
    survivors = [n for n in NODES if n != 13]
    expected, _ = plain.aggregate_train(1, [plain_reply(trained[n], n) for n in survivors])
    _, _, arrays, metrics = secure_round("fedit", state, trained, failing={13})
    got, want = from_array_record(arrays), from_array_record(expected)
    for key in want:
        np.testing.assert_allclose(got[key], want[key], atol=1e-5, rtol=0)
    assert metrics["clients"] == 3 and metrics["failures"] == 1
    assert metrics["secure-dropped-after-keys"] == 1 and metrics["secure-failed"] == 0


def test_too_few_survivors_fail_the_round_cleanly_and_keep_the_model():
    rng = np.random.default_rng(3)
    state = lora_state(rng)
    trained = uploads(strategy_for("fedit", state), rng, NODES[:3])
    strategy, _, arrays, metrics = secure_round("fedit", state, trained, failing={11, 12})
    assert arrays is None and metrics["secure-failed"] == 1 and metrics["clients"] == 0
    for key, value in state.items():
        np.testing.assert_array_equal(strategy.global_state[key], value)


def test_florgs_contribution_is_the_upper_triangle_of_each_gram():
    rng = np.random.default_rng(4)
    state = florg_state(rng)
    contribution = gram_contribution(state)
    assert {k: v.shape for k, v in contribution.items()} == gram_shapes(state)
    a = state["enc.q.A"]
    np.testing.assert_allclose(unpack_gram(contribution["enc.q.A-gram"], 8), a.T @ a)
    np.testing.assert_array_equal(contribution["classifier.weight"], state["classifier.weight"])
    # 8 bytes a masked value, the weight included
    assert contribution_bytes(gram_shapes(state)) == 8 * (1 + 36 + 21 + 16)


def test_florg_signeds_contribution_is_one_gram_per_sign_block():
    """A_bᵀA_b of each sign block b (rows 0-1 and 2 of r = 3), under the names of the
    strategy's blocks; the blocks' Grams add up to the whole A's, the core is their
    difference (A₊ᵀA₊ − A₋ᵀA₋)."""
    rng = np.random.default_rng(4)
    state = florg_state(rng)
    method = get_method("florg-signed")
    contribution = method.secure_contribution(state, 1)
    assert {k: v.shape for k, v in contribution.items()} == method.secure_shapes(state)
    blocks = strategy_for("florg-signed", state).blocks()
    grams = {k: v for k, v in contribution.items() if k != "classifier.weight"}
    assert set(grams) == {f"{name}-gram" for name in blocks}
    a = state["enc.q.A"]
    plus, minus = (unpack_gram(contribution[f"enc.q.A#{i}-gram"], 8) for i in (0, 1))
    np.testing.assert_allclose(plus, a[:2].T @ a[:2])
    np.testing.assert_allclose(minus, a[2:].T @ a[2:])
    np.testing.assert_allclose(plus + minus, a.T @ a)
    np.testing.assert_array_equal(contribution["classifier.weight"], state["classifier.weight"])
    assert contribution_bytes(method.secure_shapes(state)) == 8 * (1 + 2 * 36 + 2 * 21 + 16)


def test_a_message_without_secaggplus_configs_passes_through():
    msg = Message(RecordDict(), dst_node_id=5, message_type="train")
    context = Context(run_id=1, node_id=5, node_config={}, state=RecordDict(), run_config={})
    sentinel = Message(RecordDict(), reply_to=msg)
    assert secure_aggregation_mod(msg, context, lambda m, c: sentinel) is sentinel


def test_the_received_state_is_decoded_once_and_only_when_read():
    """The state a training message carried reaches a method's contribution undecoded; the
    first read decodes it (as the client's own decoder does), later reads reuse it."""
    from flower_app.secure.client_mod import ReceivedState
    from flower_app.wire.encoding import decode_record, encode_record

    state = lora_state(np.random.default_rng(3))
    record = encode_record(state, "bf16")
    received = ReceivedState(record, "bf16")
    assert not received.decoded
    want = from_array_record(decode_record(record, "bf16"))
    assert set(received) == set(state) and received.decoded
    first = received["enc.q.lora_A"]
    assert first is received["enc.q.lora_A"]  # decoded once
    for key, value in want.items():
        np.testing.assert_array_equal(received[key], value)
    assert not np.array_equal(received["enc.q.lora_A"], state["enc.q.lora_A"])  # bf16 rounding


def test_every_method_either_declares_a_secure_sum_or_says_why_not():
    refused = set()
    for name in method_names():
        method = get_method(name)
        assert method.secure_sum in {"mean", "gram", "product", "mean-and-product"} or (
            method.secure_sum is None and method.secure_refusal
        ), name
        if method.secure_sum is None:
            refused.add(name)
    assert refused == set()  # FLoRA: its stack's product, summed (secure_sum 'product')
    # florg-signed: FLoRG's Gram sum, one Gram per sign block; with dp=central on it
    assert get_method("florg-signed").secure_sum == "gram"
    assert run_settings("florg-signed", secure_aggregation="secaggplus", dp="central").dp


@pytest.mark.parametrize(
    ("settings", "key"),
    [
        ({"method": "flora", "dp": "central"}, "^dp: dp=central is not supported"),
        ({"round_mode": "async"}, "round-mode"),
        ({"round_mode": "sync-overselect"}, "round-mode"),
        ({"uplink_encoding": "int8-g"}, "uplink-encoding"),
        ({"save_client_updates": True}, "save-client-updates"),
        ({"method": "fedrot-lora", "dp_clipping_norm": 9.0, "dp": "central"}, "dp-clipping-norm"),
        ({"method": "fed-sb", "secaggplus_max_weight": 10.0}, "fed-sb-init-examples"),
        ({"method": "fedex-lora", "fedex_residual": "factored"}, "fedex-residual"),
        ({"method": "fedex-lora", "dp": "central"}, "^dp: dp=central is not supported"),
        ({"method": "federa", "dp": "central", "dp_clipping_norm": 9.0}, "dp-clipping-norm"),
        ({"dp": "central", "dp_clipping_norm": 9.0}, "dp-clipping-norm"),
        ({"virtual_clock": True}, "virtual-clock"),
        ({"secaggplus_num_shares": 2.5}, "secaggplus-num-shares"),
        ({"secaggplus_reconstruction_threshold": 1.5}, "secaggplus-reconstruction-threshold"),
        ({"secaggplus_modulus_range": 1000}, "secaggplus-modulus-range"),
    ],
)
def test_settings_that_need_single_replies_are_refused_before_launch(settings, key):
    settings = {"method": "fedit", **settings}
    with pytest.raises(ConfigError, match=key):
        run_settings(settings.pop("method"), secure_aggregation="secaggplus", **settings)


@pytest.mark.parametrize("method", PRODUCT_METHODS)
def test_dp_central_is_taken_for_the_product_sum_and_refused_off_it(method, monkeypatch):
    """The product-mean mechanism runs on the product sum; a mechanism on a sum it is not
    built for (here the product-mean one on FedEx-LoRA's 'mean-and-product') is refused."""
    from dataclasses import replace

    import flower_app.settings.cross_checks as cross_checks

    assert run_settings(method, secure_aggregation="secaggplus", dp="central").dp == "central"
    other = replace(get_method(method), secure_sum="mean-and-product")
    monkeypatch.setattr(cross_checks, "get_method", lambda name: other)
    with pytest.raises(ConfigError, match="^dp: .*'product-mean' on 'mean-and-product'"):
        run_settings(method, secure_aggregation="secaggplus", dp="central")


def test_fedex_lora_dense_takes_secure_aggregation_and_refuses_what_it_cannot():
    """Dense (the default) is accepted; factored (stacked factors, no sum) and dp=central
    (FedEx's own refusal: a noised residual would accumulate in W0) are refused, each naming
    its key and the reason."""
    assert run_settings("fedex-lora", secure_aggregation="secaggplus").fedex_residual == "dense"
    with pytest.raises(ConfigError, match="fedex-residual") as err:
        run_settings("fedex-lora", secure_aggregation="secaggplus", fedex_residual="factored")
    assert "stacks each client's factors" in str(err.value)
    with pytest.raises(ConfigError, match="^dp: .*fedex-lora"):
        run_settings("fedex-lora", secure_aggregation="secaggplus", dp="central")


def test_a_strategy_whose_own_aggregate_train_would_be_skipped_is_refused():
    """The folding strategy's aggregate_train (it only reads each reply's folded round,
    which the secure loop hands it) is taken; any other override is refused, with why."""
    rng = np.random.default_rng(9)
    strategy = strategy_for("fedex-lora", lora_state(rng, "fedex-lora"), **SECURE)
    assert isinstance(strategy.round_loop, SecureRounds)

    class OwnAggregateTrain(type(strategy)):
        def aggregate_train(self, server_round, replies):
            return super().aggregate_train(server_round, replies)

    strategy.__class__ = OwnAggregateTrain
    with pytest.raises(ValueError, match="aggregate_train of its own"):
        SecureRounds(strategy, strategy.round_loop.settings)


def test_a_contribution_above_the_uplink_limit_is_refused_before_any_round():
    rng = np.random.default_rng(5)
    state = {"enc.q.A": rng.standard_normal((2, 1024))}  # a Gram of 524,800 values: 4 MB
    with pytest.raises(ValueError, match="secure-uplink-limit-mb"):
        strategy_for("florg", state, **SECURE, secure_uplink_limit_mb=1.0)
    assert strategy_for("florg", state, **SECURE, secure_uplink_limit_mb=5.0).round_loop


def test_the_docs_uplink_table_is_what_the_command_prints(capsys):
    from pathlib import Path

    from benchmarks.core.secure_uplink import main, rows

    by = {(name, shape): (plain, secure) for name, shape, plain, secure, _ in rows()}
    assert by[("fedit", "7B decoder (r=16)")] == (64 * 2 * 16 * 4096, 64 * 2 * 16 * 4096)
    assert by[("florg", "MiniLM-L12 (r=8)")] == (24 * 8 * 384, 24 * 384 * 385 // 2)
    main([])
    printed = capsys.readouterr().out.strip().splitlines()
    doc = (Path(__file__).parents[2] / "docs" / "secure-aggregation.md").read_text()
    assert all(line in doc.splitlines() for line in printed)


@pytest.mark.parametrize(
    "method",
    ["fedit", "rolora", "fedsvd", "fedrot-lora", "florg", "florg-signed", *PRODUCT_METHODS],
)
def test_dp_central_on_the_masked_sum_is_the_plain_private_round(method):
    """Clipped on the clients, released from the sum: with z = 0 the plain private round's
    state within the quantisation (the same clipping, the same divisor m); every update here
    is above C, so every client clipped. The product methods' re-factored factors are fixed
    only up to each singular pair's sign: their B A, BᵀB and head are compared."""
    rng = np.random.default_rng(6)
    state = florg_state(rng) if method.startswith("florg") else lora_state(rng, method)
    dp = {"dp": "central", "dp_clipping_norm": 0.05}
    plain = strategy_for(method, state, screen_updates=False, min_available_nodes=4, **dp)
    plain.dp.noise_multiplier = 0.0
    trained = uploads(plain, rng)
    messages = plain.configure_train(
        1, to_array_record(state), ConfigRecord(), ClientGrid(trained, method)
    )
    expected, _ = plain.aggregate_train(1, [plain_reply(trained[n], n) for n in NODES])
    strategy, _, arrays, metrics = secure_round(method, state, trained, **dp)
    got, want = from_array_record(arrays), from_array_record(expected)
    assert messages and set(got) == set(want)
    if method in PRODUCT_METHODS:
        got, want = products_and_splits(got), products_and_splits(want)
        assert metrics["trunc_rel_error"] == pytest.approx(
            plain.round_metrics[1]["trunc_rel_error"], abs=1e-4
        )
    for key in want:
        np.testing.assert_allclose(got[key], want[key], atol=1e-4, rtol=0, err_msg=key)
    assert metrics["dp-clipped"] == 4 and metrics["dp-noise-std"] == 0.0
    assert strategy.dp.clipped == 0  # counted into the row, then reset by the release
    if method.startswith("florg"):  # Δ over the same units (florg-signed's sign blocks)
        assert metrics["dp-sensitivity"] == pytest.approx(
            plain.round_metrics[1]["dp-sensitivity"], rel=1e-12
        )


@pytest.mark.parametrize("method", ["florg", "florg-signed"])
def test_a_gram_methods_secure_noise_is_the_plain_mechanisms_draws(method):
    """The Gram mechanism on the masked sum draws its noise from the strategy's source in the
    plain mechanism's order (every block's Gram, then the head) and scale: from the same
    source, the plain private round's A and head within the quantisation, with z = 1."""
    rng = np.random.default_rng(12)
    state = florg_state(rng)
    dp = {"dp": "central", "dp_clipping_norm": 0.05}
    plain = strategy_for(method, state, screen_updates=False, min_available_nodes=4, **dp)
    strategy = strategy_for(method, state, **SECURE, **dp, min_available_nodes=4)
    plain.dp.rng, strategy.dp.rng = np.random.default_rng(0), np.random.default_rng(0)
    trained = uploads(plain, rng)
    expected, plain_metrics = plain.aggregate_train(1, [plain_reply(trained[n], n) for n in NODES])
    grid = ClientGrid(trained, method, dp="central", **{"dp-clipping-norm": 0.05})
    arrays, metrics = strategy.round_loop.round(grid, 1, to_array_record(state), RecordDict(), 60)
    got, want = from_array_record(arrays), from_array_record(expected)
    assert metrics["dp-noise-std"] == pytest.approx(plain_metrics["dp-noise-std"], rel=1e-12)
    for key in want:
        np.testing.assert_allclose(got[key], want[key], atol=1e-4, rtol=0, err_msg=key)
    assert np.abs(got["enc.q.A"] - state["enc.q.A"]).max() > 100 * 1e-4  # the noise moved it


@pytest.mark.parametrize(("method", "key"), [("fedit", "enc.q.lora_A"),
                                             ("federa", "classifier.weight")])  # fmt: skip
def test_dp_central_noise_on_the_masked_sum_has_the_mechanisms_scale(method, key):
    """N(0, (zC)²) on the sum, divided by m: each released entry (FedIT's A; FeDeRA's head,
    released as the noised mean like its product update, before the re-factorisation
    truncates the product's noise) moves by noise of std zC/m."""
    rng = np.random.default_rng(7)
    state = lora_state(rng, method)
    strategy = strategy_for(method, state, **SECURE, dp="central", dp_clipping_norm=0.05,
                            dp_noise_multiplier=2.0, min_available_nodes=4)  # fmt: skip
    trained = uploads(strategy, rng)
    grid = ClientGrid(trained, method, dp="central", **{"dp-clipping-norm": 0.05})
    arrays, metrics = strategy.round_loop.round(grid, 1, to_array_record(state), RecordDict(), 60)
    assert metrics["dp-noise-std"] == pytest.approx(2.0 * 0.05 / 4)
    assert 0 < metrics["dp-epsilon"] < float("inf")
    moved = from_array_record(arrays)[key] - state[key]
    # the clipped mean moves at most C; the noise of std zC/m = 0.025 moves each entry
    assert 0.005 < float(np.std(moved)) < 0.06


@pytest.mark.parametrize("method", PRODUCT_METHODS)
def test_a_product_methods_secure_noise_is_the_plain_mechanisms_draws(method):
    """The product-mean mechanism on the masked sum draws its noise from the strategy's
    source in the plain mechanism's order (every layer's product update, then the head) and
    scale: from the same source, the plain private round's B A and head within the
    quantisation, with z = 1 (a release that moves them)."""
    rng = np.random.default_rng(11)
    state = lora_state(rng, method)
    dp = {"dp": "central", "dp_clipping_norm": 0.05}
    plain = strategy_for(method, state, screen_updates=False, min_available_nodes=4, **dp)
    strategy = strategy_for(method, state, **SECURE, **dp, min_available_nodes=4)
    plain.dp.rng, strategy.dp.rng = np.random.default_rng(0), np.random.default_rng(0)
    trained = uploads(plain, rng)
    replies = [plain_reply(trained[n], n) for n in NODES]
    expected, plain_metrics = plain.aggregate_train(1, replies)
    grid = ClientGrid(trained, method, dp="central", **{"dp-clipping-norm": 0.05})
    arrays, metrics = strategy.round_loop.round(grid, 1, to_array_record(state), RecordDict(), 60)
    got = products_and_splits(from_array_record(arrays))
    want = products_and_splits(from_array_record(expected))
    assert metrics["dp-noise-std"] == plain_metrics["dp-noise-std"] == pytest.approx(0.05 / 4)
    for key in want:
        np.testing.assert_allclose(got[key], want[key], atol=1e-4, rtol=0, err_msg=key)
    moved = got["enc.q.BA"] - state["enc.q.lora_B"] @ state["enc.q.lora_A"]
    assert np.abs(moved).max() > 100 * 1e-4  # the noise moved it: a comparison worth making


# ------------------------------------------------- FedRot-LoRA: the clients rotate their pairs
def rotated_uploads(state, rng) -> dict[int, dict[str, np.ndarray]]:
    """Each node's reply: the global state moved a little, each layer's pair then put in a
    frame of the node's own, (B Qₙ, Qₙᵀ A) with a random orthogonal Qₙ (det ±1), float32:
    the aligned pairs are near the global ones, a factor-wise mean of the raw ones is not."""
    out = {}
    for n in NODES:
        reply = {k: v + 0.05 * rng.standard_normal(v.shape) for k, v in state.items()}
        for layer in ("enc.q", "enc.v"):
            q, _ = np.linalg.qr(rng.standard_normal((3, 3)))
            q[:, 0] *= (-1) ** n  # numpy's 3 × 3 Q has det +1: a reflection on odd nodes
            kb, ka = f"{layer}.lora_B", f"{layer}.lora_A"
            reply[kb], reply[ka] = reply[kb] @ q, q.T @ reply[ka]
        out[n] = {k: v.astype(np.float32) for k, v in reply.items()}
    return out


@pytest.mark.parametrize(
    ("server_round", "rotation", "dp"),
    [(2, "orthogonal", False), (2, "proper", False), (3, "orthogonal", False),
     (2, "orthogonal", True), (3, "proper", True)],
)  # fmt: skip
def test_fedrot_loras_clients_rotate_so_the_secure_round_is_the_plain_rotated_one(
    server_round, rotation, dp
):
    """Round 2 aligns A, round 3 B: each client rotates its pair toward the state it was
    sent as the plain server would (the same Rₙ, factor and group), the server averages the
    sum without rotating again, so the plain round's state within the quantisation; under
    dp=central (z = 0) the rotated updates are clipped on the clients, the plain private
    round's state. The rotation matters: the plain round is far from the raw replies' mean
    (under dp: of their clipped updates)."""
    from strategies.server.central_dp import clip_update

    rng = np.random.default_rng(30 + server_round)
    state = lora_state(rng, "fedrot-lora")
    settings = {"fedrot_rotation": rotation}
    if dp:
        settings.update(dp="central", dp_clipping_norm=0.3)
    plain = strategy_for("fedrot-lora", state, screen_updates=False, min_available_nodes=4,
                         **settings)  # fmt: skip
    if dp:
        plain.dp.noise_multiplier = 0.0
    trained = rotated_uploads(state, rng)
    plain.configure_train(server_round, to_array_record(state), ConfigRecord(),
                          ClientGrid(trained, "fedrot-lora"))  # fmt: skip
    replies = [plain_reply(trained[n], n) for n in NODES]
    expected, plain_metrics = plain.aggregate_train(server_round, replies)
    strategy, grid, arrays, metrics = secure_round(
        "fedrot-lora", state, trained, server_round=server_round, **settings
    )
    got, want = from_array_record(arrays), from_array_record(expected)
    assert set(got) == set(want) == set(state)
    step = (
        2
        * strategy.round_loop.settings.secaggplus.clipping_range
        / (strategy.round_loop.settings.secaggplus.quantization_range)
    )
    tol = 1e-4 if dp else 2 * step
    for key in want:
        np.testing.assert_allclose(got[key], want[key], atol=tol, rtol=0, err_msg=key)
    raw = [{k: np.asarray(v, np.float64) for k, v in trained[n].items()} for n in NODES]
    if dp:
        clipped = [clip_update({k: r[k] - state[k] for k in state}, 0.3) for r in raw]
        unrotated = {k: state[k] + np.mean([c[k] for c in clipped], axis=0) for k in state}
        assert metrics["dp-clipped"] == plain_metrics["dp-clipped"] == 4
    else:
        unrotated = {k: np.mean([r[k] for r in raw], axis=0) for k in state}
        assert plain_metrics["rotation_norm"] > 0.1
    assert max(np.abs(want[k] - unrotated[k]).max() for k in state) > 100 * tol
    assert metrics["clients"] == 4 and metrics["secure-failed"] == 0
    for reply in grid.collected.values():  # a masked vector and metrics, no arrays
        assert not reply.content.array_records


def test_fedrot_loras_secure_contribution_needs_the_sent_state_after_round_1():
    """Round 1 rotates nothing; a later round's contribution without the state the client was
    sent (or the run's settings) is refused, not left unrotated."""
    rng = np.random.default_rng(33)
    state = lora_state(rng, "fedrot-lora")
    method = get_method("fedrot-lora")
    contribution = method.secure_contribution(state, 1)
    for key, value in state.items():
        np.testing.assert_array_equal(contribution[key], value)
    with pytest.raises(ValueError, match="pass received and config"):
        method.secure_contribution(state, 2)


def test_fedrot_loras_secure_server_averages_without_rotating_again():
    """The mean contribution is the new state as it is: the strategy's own rule would rotate
    it toward the global factor (a mean in another frame here), which the clients did."""
    rng = np.random.default_rng(34)
    state = lora_state(rng, "fedrot-lora")
    strategy = strategy_for("fedrot-lora", state, **SECURE)
    q, _ = np.linalg.qr(rng.standard_normal((3, 3)))
    mean = dict(state)
    mean["enc.q.lora_B"], mean["enc.q.lora_A"] = (
        state["enc.q.lora_B"] @ q,
        q.T @ state["enc.q.lora_A"],
    )
    new, _ = strategy.method.aggregate_secure(strategy, 2, mean, 4)
    for key, value in mean.items():
        np.testing.assert_array_equal(new[key], value)
    rotated, _ = strategy.aggregate_adapter(2, [mean], np.ones(1))
    assert np.abs(rotated["enc.q.lora_A"] - mean["enc.q.lora_A"]).max() > 0.1


def test_num_examples_weights_give_the_plain_weighted_round():
    """Each client's weight is its examples / secaggplus-max-weight (capped at 1): the secure
    mean is the plain round's num-examples mean; a client above the cap counts as the cap."""
    rng = np.random.default_rng(8)
    state = lora_state(rng)
    weights = {"aggregation_weights": "num-examples", "secaggplus_max_weight": 40.0}
    plain = strategy_for("fedit", state, screen_updates=False, min_available_nodes=4, **weights)
    trained = uploads(plain, rng)
    examples = {11: 5, 12: 10, 13: 20, 14: 80}  # 80 is above the cap of 40: counts as 40
    replies = []
    for n in NODES:
        reply = plain_reply(trained[n], n)
        reply.content["metrics"]["num-examples"] = min(examples[n], 40)
        replies.append(reply)
    expected, _ = plain.aggregate_train(1, replies)
    strategy = strategy_for("fedit", state, **SECURE, **weights, min_available_nodes=4)
    grid = ClientGrid(trained, "fedit", **{k.replace("_", "-"): v for k, v in weights.items()})
    grid.train_examples = examples
    arrays, _ = strategy.round_loop.round(grid, 1, to_array_record(state), ConfigRecord(), 60)
    got, want = from_array_record(arrays), from_array_record(expected)
    for key in want:
        np.testing.assert_allclose(got[key], want[key], atol=2e-5, rtol=0, err_msg=key)
    uniform = np.mean([trained[n]["enc.q.lora_A"] for n in NODES], axis=0)
    assert np.abs(got["enc.q.lora_A"] - uniform).max() > 1e-3  # the weights mattered


@pytest.mark.parametrize(("method", "rank"), [("florg", 8), ("florg-signed", 4)])
def test_florgs_secure_rank_ignores_the_quantisations_rounding(method, rank):
    """N r = 8 < k = 24: the mean Gram has rank 8 (florg-signed's: each sign block of one
    row, rank N = 4); rounding fills the other eigenvalues with noise, which the secure step
    counts as zero (the plain step's rank, not k)."""
    rng = np.random.default_rng(10)
    state = {"enc.q.A": 0.3 * rng.standard_normal((2, 24))}
    plain = strategy_for(method, state, screen_updates=False, min_available_nodes=4)
    trained = uploads(plain, rng)
    _, plain_metrics = plain.aggregate_train(1, [plain_reply(trained[n], n) for n in NODES])
    _, _, arrays, metrics = secure_round(method, state, trained)
    assert plain_metrics["rank"] == rank
    assert metrics["rank"] == rank


# -------------------------------------------------------------------- Fed-SB: round 0 and R
SB_SHAPES = {"enc.q": (12, 16), "enc.v": (10, 12)}  # W0's (d_out, d_in) by layer
SB_SIZES = {11: 10, 12: 30, 13: 20, 14: 64}  # each node's examples in round 0


def sb_state(rng, rank=8) -> dict[str, np.ndarray]:
    state = {f"{layer}.R": np.zeros((rank, rank)) for layer in SB_SHAPES}
    return {**state, "classifier.weight": 0.3 * rng.standard_normal((2, 16))}


def sb_gradients(rng) -> dict[int, dict[str, np.ndarray]]:
    """Each node's summed gradient (its examples times a per-example mean whose entries are
    at least 0.1 away from 0, so that rounding flips no sign of the pooled mean)."""
    out = {}
    for node, n in SB_SIZES.items():
        out[node] = {}
        for layer, shape in SB_SHAPES.items():
            g = rng.choice([-1.0, 1.0], shape) * (0.1 + rng.random(shape))
            out[node][f"{layer}.grad"] = (n * g).astype(np.float32)
    return out


class QueryGrid:
    """Round 0 in the clear: each node answers the QUERY with its gradient sum."""

    def __init__(self, grads):
        self.grads = grads

    def get_node_ids(self):
        return list(self.grads)

    def send_and_receive(self, messages, *, timeout=None):
        out = []
        for msg in messages:
            node = msg.metadata.dst_node_id
            metrics = MetricRecord({"num-examples": SB_SIZES[node],
                                    "partition-id": NODES.index(node)})  # fmt: skip
            content = RecordDict({"arrays": to_array_record(self.grads[node]), "metrics": metrics})
            out.append(Message(content, reply_to=msg))
        return out


def sb_round_0(rng, grads, **settings):
    """(plain, secure) Fed-SB strategies after round 0 on ``grads`` (z = 0 under dp)."""
    common = {"min_available_nodes": 4, "min_train_nodes": 4, "learning_rate": 0.01, **settings}
    plain = strategy_for("fed-sb", sb_state(rng), screen_updates=False, **common)
    secure = strategy_for("fed-sb", sb_state(rng), **SECURE, **common)
    for strategy in (plain, secure):
        if strategy.dp is not None:
            strategy.dp.noise_multiplier = 0.0
    plain.initialise(QueryGrid(grads), timeout=10)
    secure.base_shapes = SB_SHAPES
    secure.check_gradients = lambda replies: pytest.fail("a plain query reply reached the server")
    run_config = {key.replace("_", "-"): value for key, value in settings.items()}
    grid = ClientGrid(grads, "fed-sb", **run_config)
    grid.train_examples = SB_SIZES
    secure.initialise(grid, timeout=10)
    return plain, secure, grid


@pytest.mark.parametrize("dp", [{}, {"dp": "central", "dp_clipping_norm": 0.5}])
def test_fed_sbs_secure_round_0_gives_the_plain_factors_from_the_sum_alone(dp):
    """One SecAgg+ sum of QUERY messages: each client's mean gradient weighted by its examples
    (under dp=central its clipped sum, the server dividing by m), so the same sign step and
    the same B, A and R; the server never holds one client's gradient."""
    rng = np.random.default_rng(20)
    grads = sb_gradients(rng)
    plain, secure, grid = sb_round_0(rng, grads, **dp)
    for layer in SB_SHAPES:
        for i in (0, 1):
            np.testing.assert_allclose(secure.basis[layer][i], plain.basis[layer][i], atol=1e-9)
        np.testing.assert_allclose(secure.global_state[f"{layer}.R"],
                                   plain.global_state[f"{layer}.R"], atol=1e-9)  # fmt: skip
    assert secure.basis and not np.allclose(secure.global_state["enc.q.R"], 0)
    for reply in grid.collected.values():  # a masked vector and metrics, no arrays
        assert reply.metadata.message_type == "query"
        assert not reply.content.array_records
    row = secure.round_metrics[0]
    assert row["clients"] == 4 and row["secure-failed"] == 0 and row["examples"] == 124
    assert row["up-params"] == 4 * (12 * 16 + 10 * 12)
    if dp:
        assert row["dp-clipped"] == plain.round_metrics[0]["dp-clipped"] == 4
        assert row["dp-noise-std"] == 0.0


def test_fed_sbs_round_0_above_the_uplink_limit_is_refused():
    rng = np.random.default_rng(21)
    strategy = strategy_for("fed-sb", sb_state(rng), **SECURE, secure_uplink_limit_mb=0.002,
                            min_available_nodes=4)  # fmt: skip
    strategy.base_shapes = SB_SHAPES
    with pytest.raises(ValueError, match="secure-uplink-limit-mb: fed-sb's round 0"):
        strategy.initialise(ClientGrid(sb_gradients(rng), "fed-sb"), timeout=10)


def test_a_fed_sb_secure_round_is_the_plain_one_and_learns_who_holds_the_basis():
    """After round 0: a secure training round averages R and the head as the plain round, the
    training messages carry B and A, and each node's clear 'basis-held' reaches node_synced
    (``observe_replies``), so the next round sends no basis."""
    rng = np.random.default_rng(22)
    plain, secure, _ = sb_round_0(rng, sb_gradients(rng))
    state = plain.global_state
    trained = uploads(plain, rng)
    replies = []
    for n in NODES:
        reply = plain_reply(trained[n], n)
        reply.content["metrics"]["basis-held"] = 1
        replies.append(reply)
    expected, _ = plain.aggregate_train(1, replies)
    grid = ClientGrid(trained, "fed-sb")
    grid.extra_metrics = {"basis-held": 1}
    sent = list(secure.configure_train(1, to_array_record(state), ConfigRecord(), grid))
    assert all("basis" in m.content.array_records for m in sent)
    arrays, metrics = secure.round_loop.round(grid, 1, to_array_record(state), RecordDict(), 60)
    got, want = from_array_record(arrays), from_array_record(expected)
    assert set(got) == set(want)
    for key in want:
        np.testing.assert_allclose(got[key], want[key], atol=1e-5, rtol=0, err_msg=key)
    assert metrics["secure-failed"] == 0 and metrics["clients"] == 4
    assert secure.node_synced == plain.node_synced == set(NODES)
    again = secure.configure_train(2, to_array_record(state), ConfigRecord(), grid)
    assert not any("basis" in m.content.array_records for m in again)
