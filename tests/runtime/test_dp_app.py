"""Central differential privacy wired into the app (issue 29; docs/privacy.md): the settings
and their refusals, each method's mechanism as its strategy runs it (z = 0 equals the
mechanism of strategies/server/central_dp.py on the clipped inputs; z > 0 differs, with noise that
no setting reproduces), the accountant in the metrics and the checkpoint. Hand-built Flower
messages, no simulation (the runs: tests/runtime/test_app_e2e.py)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from flwr.app import Message, MessageType, MetricRecord, RecordDict
from flwr.supercore.task_identity import TaskIdentity

from flower_app.methods.registry import get_method, method_names
from flower_app.privacy.accounting import epsilon_for
from flower_app.run_output.recorder import RunRecorder
from flower_app.settings.config import ConfigError, resolve_config
from flower_app.wire.records import from_array_record, to_array_record
from strategies.fedex_lora.method import FEDEX_REFUSAL
from strategies.fedsvd.rule import refactorise
from strategies.flora.method import FLORA_REFUSAL
from strategies.florg.dp import clip_florg_with_head, private_florg_layers
from strategies.florg_signed.rule import sign_blocks
from strategies.server.central_dp import CentralDP, clip_update
from strategies.server.product_mean import product_update, refactor_noised_product
from tests.harness.strategy_helpers import strategy_for

# Each method's central-DP mechanism, as docs/privacy.md derives it (the methods declare it
# in their folders, ``Method.dp_mechanism``; FedEx-LoRA declares none and refuses).
MECHANISMS = {
    "fedit": "mean",
    "ffa-lora": "mean",
    "fedsa-lora": "mean",
    "hetlora": "mean",
    "federa": "product-mean",
    "flexlora": "product-mean",
    "florg": "gram",
    "florg-no-procrustes": "gram",
    "florg-signed": "gram",
    "rolora": "mean",  # over the round's trained factor and the head
    "fedsvd": "mean",  # over B and the head, then the re-factorisation (post-processing)
    "fed-sb": "mean",  # over R and the head (round 0's gradients: tests/runtime/test_fed_sb.py)
    "fedrot-lora": "mean",  # on the rotated replies (round 2 on: tests/runtime/test_fedrot_lora.py)
}

TaskIdentity.run_id = 1
TaskIdentity.task_id = 1
TaskIdentity.node_id = 1

C, Z, DELTA = 0.5, 1.3, 1e-4
DP = {"dp": "central", "dp_clipping_norm": C, "dp_noise_multiplier": Z, "dp_delta": DELTA}
HEAD = "classifier.weight"


def initial_state(method: str, rng: np.random.Generator) -> dict[str, np.ndarray]:
    head = {HEAD: rng.standard_normal((3, 8))}
    if get_method(method).adapter == "florg":
        r = 4 if method == "florg-signed" else 2
        return {
            "l1.A": 0.3 * rng.standard_normal((r, 8)),
            "l2.A": rng.standard_normal((r, 6)),
            **head,
        }
    if get_method(method).adapter == "lora-sb":
        return {"l1.R": 0.3 * rng.standard_normal((2, 2)), **head}
    shapes = {"A": (2, 8), "B": (6, 2)}
    parts = get_method(method).shared
    lora = {f"l1.lora_{p}": 0.3 * rng.standard_normal(shapes[p]) for p in parts}
    return {**lora, **head}


def uplink(method: str, state: dict[str, np.ndarray], server_round: int = 1) -> dict:
    """What a client of ``method`` sends up in ``server_round`` (``Method.uplink``)."""
    return dict(get_method(method).uplink(state, server_round))


def reply(state: dict[str, np.ndarray], pid: int, **metrics) -> Message:
    content = RecordDict(
        {
            "arrays": to_array_record(state),
            "metrics": MetricRecord(
                {"num-examples": 10, "train-loss": 1.0, "partition-id": pid, **metrics}
            ),
        }
    )
    return Message(content=content, dst_node_id=1, message_type=MessageType.TRAIN)


def client_states(initial, rng, n=3, scale=0.4):
    return [
        {k: v + scale * rng.standard_normal(v.shape) for k, v in initial.items()} for _ in range(n)
    ]


def f32(state):
    """What the server receives: the arrays as float32, widened."""
    return {k: np.asarray(v, np.float32).astype(np.float64) for k, v in state.items()}


def expected_private(method, sent, clients, m, strategy):
    """The method's mechanism with z = 0 on the clipped replies, m sampled."""
    clients = [f32(c) for c in clients]
    head = [HEAD]
    mechanism = MECHANISMS[method]
    if mechanism == "mean":
        up = get_method(method).uplink(sent, 1)  # round 1's trained parts and the head
        updates = [clip_update({k: c[k] - sent[k] for k in up}, C) for c in clients]
        new = {**sent, **{k: sent[k] + sum(u[k] for u in updates) / m for k in up}}
        if method == "fedsvd":
            new["l1.lora_B"], new["l1.lora_A"] = refactorise(new["l1.lora_B"], sent["l1.lora_A"])
        return new
    if mechanism == "product-mean":
        kb, ka = "l1.lora_B", "l1.lora_A"
        units = [
            clip_update(
                {"p": product_update(c[kb], c[ka], sent[kb], sent[ka]), HEAD: c[HEAD] - sent[HEAD]},
                C,
            )
            for c in clients
        ]
        product = sent[kb] @ sent[ka] + sum(u["p"] for u in units) / m
        B, A, _ = refactor_noised_product(product, 2)
        return {kb: B, ka: A, HEAD: sent[HEAD] + sum(u[HEAD] for u in units) / m}
    keys = [k for k in sent if k.endswith(".A")]
    prev = {k: sent[k] for k in keys}
    clipped = [
        clip_florg_with_head(
            {k: c[k] for k in keys}, {h: c[h] - sent[h] for h in head}, C, prev_A=prev
        )
        for c in clients
    ]
    blocks = {
        f"{k}#{i}": (k, rows)
        for k in keys
        for i, rows in enumerate(
            sign_blocks(sent[k].shape[0]) if method == "florg-signed" else [slice(None)]
        )
    }
    new_blocks, _ = private_florg_layers(
        {n: [cA[k][rows] for cA, _ in clipped] for n, (k, rows) in blocks.items()},
        {n: prev[k][rows] for n, (k, rows) in blocks.items()},
        C,
        0.0,
        np.random.default_rng(0),
        num_sampled=m,
        procrustes=strategy.procrustes,
    )
    new = {
        k: np.concatenate([new_blocks[n] for n, (kk, _) in blocks.items() if kk == k]) for k in keys
    }
    new[HEAD] = sent[HEAD] + sum(ch[HEAD] for _, ch in clipped) / m
    return new


REFUSED = {"fedex-lora", "flora"}  # each refuses dp=central with its reason
DP_METHODS = [m for m in method_names() if m not in REFUSED]


# --------------------------------------------------------------------------- settings


@pytest.mark.parametrize(
    ("settings", "key"),
    [
        ({"dp": "maybe"}, "dp"),
        ({"dp": "central", "dp-clipping-norm": 0.0}, "dp-clipping-norm"),
        ({"dp": "central", "dp-noise-multiplier": 0.0}, "dp-noise-multiplier"),
        ({"dp": "central", "dp-noise-multiplier": -1.0}, "dp-noise-multiplier"),
        ({"dp": "central", "dp-delta": 0.0}, "dp-delta"),
        ({"dp": "central", "dp-delta": 1.0}, "dp-delta"),
        ({"dp": "central", "aggregation-weights": "num-examples"}, "aggregation-weights"),
        ({"dp": "central", "save-client-updates": True}, "save-client-updates"),
    ],
)
def test_bad_dp_settings_fail_at_resolution_naming_the_key(settings, key):
    with pytest.raises(ConfigError, match=key):
        resolve_config({}, settings)


def test_fedex_lora_is_refused_with_its_reason_and_the_others_declare_their_mechanism():
    with pytest.raises(ConfigError) as err:
        resolve_config({}, {"dp": "central", "method": "fedex-lora"})
    assert str(err.value) == FEDEX_REFUSAL and "quadratic" in str(err.value)
    resolve_config({}, {"method": "fedex-lora", "save-client-updates": True})  # dp=off: fine
    with pytest.raises(ConfigError) as err:
        resolve_config({}, {"dp": "central", "method": "flora"})
    assert str(err.value) == FLORA_REFUSAL and "full-rank" in str(err.value)
    assert {m for m in method_names() if get_method(m).dp_mechanism is None} == REFUSED
    for name in DP_METHODS:
        assert get_method(name).dp_mechanism == MECHANISMS[name], name
        config = resolve_config({}, {"dp": "central", "method": name})
        assert config.dp_delta == 1e-5 and config.dp_noise_multiplier == 1.0


def test_a_method_without_a_declared_mechanism_is_refused():
    from strategies.shared.base_method import BaseMethod

    toy = BaseMethod(name="toy", summary="", adapter="lora", shared=("A",))
    with pytest.raises(ValueError, match="^dp: .*'toy'"):
        toy.check_settings(resolve_config({}, {"dp": "central"}))


# --------------------------------------------------------------------------- mechanisms


@pytest.mark.parametrize("method", DP_METHODS)
def test_the_strategys_private_round_is_the_mechanism_on_the_clipped_replies(method):
    """z = 0: the strategy's release equals strategies/server/central_dp.py's mechanism on the
    clipped replies (clipping active: C below most update norms), divided by the m clients sampled
    (4, one of them silent); z > 0: it differs, and two runs of the same settings differ."""
    rng = np.random.default_rng(1)
    sent = initial_state(method, rng)
    clients = client_states(sent, rng)
    noiseless = strategy_for(method, sent, fingerprint=None, **DP)
    assert noiseless.dp.mechanism == MECHANISMS[method] and not noiseless.gate.screen_updates
    noiseless.dp = CentralDP(MECHANISMS[method], C, 0.0, DELTA, np.random.default_rng(5))
    noiseless.communication.sampled[1] = 4  # as configure_train records it: 4 sampled, 3 replied
    arrays, metrics = noiseless.aggregate_train(
        1, [reply(uplink(method, c), i) for i, c in enumerate(clients)]
    )
    got = from_array_record(arrays)
    want = expected_private(method, sent, clients, 4, noiseless)
    assert got.keys() == want.keys()
    for key, value in want.items():
        np.testing.assert_allclose(got[key], value.astype(np.float32), rtol=2e-5, atol=2e-6)
        np.testing.assert_allclose(noiseless.global_state[key], value, rtol=1e-8, atol=1e-10)
    assert metrics["dp-clipped"] == 3 and metrics["dp-sampled"] == 4
    assert metrics["clients"] == 3 and metrics["screened"] == 0

    noised = [strategy_for(method, sent, **DP) for _ in range(2)]
    outs = []
    for s in noised:
        s.communication.sampled[1] = 4
        arrays, metrics = s.aggregate_train(
            1, [reply(uplink(method, c), i) for i, c in enumerate(clients)]
        )
        outs.append(s.global_state)
        assert metrics["dp-epsilon"] == pytest.approx(epsilon_for(Z, 1.0, 1, DELTA), rel=1e-12)
        assert metrics["dp-noise-std"] > 0
    for key in uplink(method, want):  # the parts released this round
        assert np.linalg.norm(outs[0][key] - want[key]) > 1e-6, key
        assert np.linalg.norm(outs[0][key] - outs[1][key]) > 1e-6, key  # OS entropy


def test_an_outlier_is_clipped_not_screened_and_a_round_without_replies_still_releases():
    rng = np.random.default_rng(2)
    sent = initial_state("fedit", rng)
    clients = client_states(sent, rng, scale=0.01)
    clients[1] = {k: v + 100.0 for k, v in sent.items()}  # screening would drop it
    strategy = strategy_for("fedit", sent, **DP)
    strategy.dp.noise_multiplier = 0.0
    _, metrics = strategy.aggregate_train(1, [reply(c, i) for i, c in enumerate(clients)])
    assert metrics["screened"] == 0 and metrics["clients"] == 3 and metrics["dp-clipped"] == 1
    assert metrics["screen-ratio-max"] > 100  # still measured
    # Each honest update has norm ~0.07 < C: the outlier moved the mean by at most C / m.
    move = sum(float(np.sum((strategy.global_state[k] - sent[k]) ** 2)) for k in sent) ** 0.5
    assert move <= (C + 2 * 0.1) / 3

    # Every reply rejected (NaN): the round still releases noise and is accounted.
    strategy = strategy_for("florg", initial_state("florg", rng), **DP)
    before = dict(strategy.global_state)
    bad = {k: np.full_like(v, np.nan) for k, v in before.items()}
    strategy.communication.sampled[1] = 2
    arrays, metrics = strategy.aggregate_train(1, [reply(bad, 0), reply(bad, 1)])
    assert arrays is not None and metrics["rejected"] == 2 and metrics["clients"] == 0
    assert metrics["dp-epsilon"] == pytest.approx(epsilon_for(Z, 1.0, 1, DELTA))
    assert np.linalg.norm(strategy.global_state[HEAD] - before[HEAD]) > 0


def test_the_strategy_refuses_what_the_settings_refuse():
    rng = np.random.default_rng(3)
    from strategies.fedex_lora.strategy import FedExLoRAStrategy
    from strategies.server.strategy import AdapterStrategy

    lora = initial_state("fedit", rng)
    fedit = get_method("fedit")
    with pytest.raises(ValueError, match="quadratic"):
        FedExLoRAStrategy(lora, method=get_method("fedex-lora"), dp=CentralDP("mean", C, Z, DELTA))
    with pytest.raises(ValueError, match="implements the mechanism 'mean', not 'gram'"):
        AdapterStrategy(lora, method=fedit, dp=CentralDP("gram", C, Z, DELTA))
    with pytest.raises(ValueError, match="uniform"):
        AdapterStrategy(
            lora, method=fedit, weighting="num-examples", dp=CentralDP("mean", C, Z, DELTA)
        )
    with pytest.raises(ValueError, match="save-client-updates"):
        AdapterStrategy(lora, method=fedit, updates_dir="x", dp=CentralDP("mean", C, Z, DELTA))


# --------------------------------------------------------------------------- accounting


def test_epsilon_in_every_round_and_the_ledger_in_the_checkpoint(tmp_path):
    rng = np.random.default_rng(4)
    sent = initial_state("florg", rng)
    strategy = strategy_for("florg", sent, **DP)
    assert strategy.round_metrics[0] == {"dp-epsilon": 0.0}
    for t in (1, 2):
        strategy.aggregate_train(t, [reply(c, i) for i, c in enumerate(client_states(sent, rng))])
        assert strategy.round_metrics[t]["dp-epsilon"] == pytest.approx(
            epsilon_for(Z, 1.0, t, DELTA), rel=1e-12
        )
    state = json.loads(json.dumps(strategy.state_json()))
    assert state["dp"] == {"delta": DELTA, "compositions": [[Z, 1.0, 2]]}
    resumed = strategy_for("florg", sent, **DP)
    resumed.restore(strategy.state_arrays(), state)
    _, metrics = resumed.aggregate_train(
        3, [reply(c, i) for i, c in enumerate(client_states(sent, rng))]
    )
    assert metrics["dp-epsilon"] == pytest.approx(epsilon_for(Z, 1.0, 3, DELTA), rel=1e-12)
    assert metrics["dp-epsilon"] > strategy.round_metrics[2]["dp-epsilon"]
    with pytest.raises(ValueError, match="dp"):
        strategy_for("florg", sent).restore(strategy.state_arrays(), state)
    plain = strategy_for("florg", sent).state_json()
    with pytest.raises(ValueError, match="dp"):
        strategy_for("florg", sent, **DP).restore(strategy.state_arrays(), plain)

    # metrics.jsonl and the summary carry it; the console line prints it.
    config = resolve_config({}, {k.replace("_", "-"): v for k, v in DP.items()})
    recorder = RunRecorder(tmp_path, config)
    for t in range(3):
        metrics = strategy.round_metrics.get(t) or resumed.round_metrics[t]
        recorder.record(t, {"accuracy": 0.5, "loss": 1.0, "score": 0.5}, metrics)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["dp-epsilon"] for r in rows] == [0.0] + [
        pytest.approx(epsilon_for(Z, 1.0, t, DELTA), rel=1e-12) for t in (1, 2)
    ]
    summary = recorder.write_summary({})
    assert summary["dp-delta"] == DELTA and summary["dp-epsilon"] == rows[-1]["dp-epsilon"]
    assert math.isfinite(summary["dp-epsilon"])
