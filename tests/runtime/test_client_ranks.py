"""Issue 30: clients of different rank. The settings (``client-ranks``, a node's ``rank``),
the server's checks of a reply's declared rank, and FLoRG's mixed-rank step on the
strategy (hand-built Flower messages through the real ``aggregate_train``); HetLoRA's and
FlexLoRA's rules are tests/runtime/test_hetero_baselines.py, the simulation
tests/runtime/test_app_e2e.py.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
from flwr.app import Message, MessageType, MetricRecord, RecordDict
from flwr.supercore.task_identity import TaskIdentity

from flower_app.methods.communication import client_communication
from flower_app.settings.client_ranks import (
    config_at_rank,
    largest_rank,
    node_rank,
    parse_client_ranks,
    server_model_config,
)
from flower_app.settings.config import ConfigError, resolve_config
from flower_app.wire.ranks import truncate_to_rank
from flower_app.wire.records import from_array_record, to_array_record
from strategies.florg.ranks import aggregate_florg_ranks
from strategies.florg.rule_torch import aggregate_florg_layers
from tests.harness.strategy_helpers import strategy_for

TaskIdentity.run_id = 1
TaskIdentity.task_id = 1

K = 6
R_MAX = 4
rng = np.random.default_rng(30)
FLORG_STATE = {
    "enc.q.A": rng.standard_normal((R_MAX, K)),
    "enc.v.A": rng.standard_normal((R_MAX, K)),
    "classifier.weight": rng.standard_normal((2, K)),
}


def reply(node: int, arrays: dict, rank: int | None, partition: int) -> Message:
    """A training reply from ``node`` (its id is Flower's TaskIdentity when built)."""
    TaskIdentity.node_id = node
    metrics = {"num-examples": 10, "train-loss": 1.0, "partition-id": partition}
    if rank is not None:
        metrics["rank"] = rank
    content = RecordDict({"arrays": to_array_record(arrays), "metrics": MetricRecord(metrics)})
    return Message(content=content, dst_node_id=0, message_type=MessageType.TRAIN)


def client_state(rank: int, state=FLORG_STATE) -> dict[str, np.ndarray]:
    """What a client of ``rank`` sends after training from the global state."""
    start = truncate_to_rank(state, rank)
    return {k: v + 0.1 * rng.standard_normal(v.shape) for k, v in start.items()}


# -- settings -----------------------------------------------------------------------------
def test_client_ranks_cycle_over_partitions_and_node_config_wins():
    config = resolve_config({}, {"client-ranks": "2,4,8"})
    assert parse_client_ranks(config.client_ranks) == (2, 4, 8)
    assert [node_rank(config, {}, p) for p in range(5)] == [2, 4, 8, 2, 4]
    assert node_rank(config, {"rank": 8}, 0) == 8  # node-config over client-ranks
    assert node_rank(resolve_config({}, {}), {}, 3) == 4  # empty: everyone uses rank
    assert largest_rank(config) == 8 and largest_rank(resolve_config({}, {})) == 4


def test_every_client_keeps_the_runs_scaling():
    config = resolve_config({}, {"client-ranks": "2,8", "alpha": 16.0, "rank": 4})
    for r in (2, 8):
        at = config_at_rank(config, r)
        assert at.rank == r and at.alpha / at.rank == pytest.approx(16.0 / 4, rel=1e-15)
    assert config_at_rank(config, 4) is config  # homogeneous: the same settings object
    assert server_model_config(config).rank == 8


@pytest.mark.parametrize(
    "settings,fragment",
    [
        ({"client-ranks": "2,x"}, "client-ranks"),
        ({"client-ranks": "2,0"}, "client-ranks"),
        ({"client-ranks": "2,4", "method": "fedit"}, "client-ranks: method 'fedit'"),
        ({"client-ranks": "2,4", "method": "florg-signed"}, "one common rank"),
        ({"client-ranks": "2,4", "dp": "central"}, "client-ranks: dp=central"),
        ({"client-ranks": "2,4", "subtract-init": True}, "subtract-init=true subtracts"),
    ],
)
def test_bad_client_ranks_fail_naming_the_setting(settings, fragment):
    with pytest.raises(ConfigError, match=fragment):
        resolve_config({}, settings)


def test_subtract_init_needs_every_node_at_the_runs_largest_rank():
    # each node would subtract its own rank's s L A1^T A1 R from W0: W0 would differ by rank
    config = resolve_config({}, {"rank": 8, "subtract-init": True})
    assert node_rank(config, {"rank": 8}, 0) == 8  # the server's rank: the same W0
    with pytest.raises(ConfigError, match="node-config rank=2: subtract-init=true"):
        node_rank(config, {"rank": 2}, 0)
    lora = resolve_config({}, {"rank": 8, "subtract-init": True, "method": "fedit"})
    assert node_rank(lora, {"rank": 2}, 0) == 2  # a LoRA adapter has no initial Gram


@pytest.mark.parametrize("value", ["0", "x", "16"])
def test_a_bad_node_config_rank_fails_naming_it(value):
    config = resolve_config({}, {"client-ranks": "2,8"})
    with pytest.raises(ConfigError, match="node-config rank"):
        node_rank(config, {"rank": value}, 0)


# -- the server: checks, node ranks, FLoRG's mixed step ------------------------------------
def test_florg_mixed_ranks_aggregate_every_layer_and_send_each_node_its_factor():
    strategy = strategy_for("florg", FLORG_STATE, rank_mismatch="truncate")
    assert strategy.router.largest_rank == R_MAX
    sent = {1: client_state(2), 2: client_state(4), 3: client_state(2)}
    ranks = {1: 2, 2: 4, 3: 2}
    replies = [reply(n, sent[n], ranks[n], partition=n - 1) for n in sent]
    arrays, metrics = strategy.aggregate_train(1, replies)
    assert metrics["clients"] == 3 and metrics["rejected"] == 0
    assert strategy.router.node_ranks == ranks
    new = from_array_record(arrays)
    for key in ("enc.q.A", "enc.v.A"):
        As = [sent[n][key].astype(np.float32) for n in sorted(sent)]
        prev = {2: FLORG_STATE[key][:2], 4: FLORG_STATE[key]}
        expected, _ = aggregate_florg_ranks(As, None, prev, rank_mismatch="truncate")
        assert new[key].shape == (R_MAX, K)
        np.testing.assert_allclose(new[key], expected[4], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(strategy.factors_by_rank[2][key], expected[2], atol=1e-12)
        # each node receives the factor of its own rank
        TaskIdentity.node_id = 0
        out = Message(content=RecordDict({"arrays": arrays}), dst_node_id=1, message_type="train")
        to_rank_2 = from_array_record(strategy.at_node_rank(2, out).content["arrays"])
        np.testing.assert_allclose(to_rank_2[key], expected[2], rtol=1e-6, atol=1e-7)
    assert (
        metrics["up-params-r2"] == 2 * 2 * K + 2 * K
        and metrics["up-params-r4"] == 4 * 2 * K + 2 * K
    )
    assert metrics["clients_r2"] == 2 and np.isfinite(metrics["gram_rel_error_r2"])
    # the counts from the arrays that travelled equal the formula (round 1: sent at r_max)
    shapes, head = {"enc.q": (K, K), "enc.v": (K, K)}, 2 * K
    for r in (2, 4):
        c = client_communication("florg", shapes, r, head, sent_rank=R_MAX)
        assert metrics[f"up-params-r{r}"] == c.up_params
    assert metrics["up-params-per-client"] == pytest.approx((2 * 36 + 60) / 3)


def test_homogeneous_florg_takes_the_unchanged_path():
    strategy = strategy_for("florg", FLORG_STATE)
    sent = [client_state(R_MAX) for _ in range(2)]
    arrays, metrics = strategy.aggregate_train(
        1, [reply(n + 1, s, R_MAX, n) for n, s in enumerate(sent)]
    )
    keys = ["enc.q.A", "enc.v.A"]
    expected, _ = aggregate_florg_layers(
        {k: [s[k].astype(np.float32) for s in sent] for k in keys},
        None,
        {k: FLORG_STATE[k] for k in keys},
        True,
        device="cpu",
        rank_mismatch="procrustes",
    )
    new = from_array_record(arrays)
    for k in keys:
        np.testing.assert_array_equal(new[k], expected[k].astype(np.float32))
    assert strategy.factors_by_rank == {} and "up-params-r4" not in metrics


@pytest.mark.parametrize(
    "declared,rows,reason",
    [
        (7, 7, "exceeds k=min(d_in, d_out)=6"),
        (5, 5, "exceeds the run's largest rank 4"),
        (2, 3, "shape (3, 6) != expected (2, 6)"),
        (0, 2, "rank must be an integer >= 1"),
        (2.5, 2, "rank must be an integer >= 1"),
    ],
)
def test_a_reply_not_matching_its_rank_is_rejected_and_the_rest_kept(
    declared, rows, reason, caplog
):
    strategy = strategy_for("florg", FLORG_STATE)
    bad_arrays = {
        k: (rng.standard_normal((rows, K)) if k.endswith(".A") else v)
        for k, v in FLORG_STATE.items()
    }
    good = client_state(2)
    with caplog.at_level(logging.WARNING, logger="flwr.florg"):
        arrays, metrics = strategy.aggregate_train(
            1, [reply(1, bad_arrays, declared, 0), reply(2, good, 2, 1)]
        )
    assert metrics["rejected"] == 1 and metrics["clients"] == 1
    lines = [r.getMessage() for r in caplog.records if "rejected update" in r.getMessage()]
    assert len(lines) == 1 and reason in lines[0], lines
    assert strategy.router.node_ranks == {2: 2}  # the rejected node's rank is not learnt
    assert from_array_record(arrays)["enc.q.A"].shape == (R_MAX, K)


def test_a_single_rank_method_rejects_another_rank():
    state = {"l.lora_A": np.zeros((4, 6)), "l.lora_B": np.zeros((5, 4))}
    strategy = strategy_for("fedit", state)
    small = truncate_to_rank({k: v + 1 for k, v in state.items()}, 2)
    _, metrics = strategy.aggregate_train(
        1, [reply(1, small, 2, 0), reply(2, {k: v + 1 for k, v in state.items()}, 4, 1)]
    )
    assert metrics["rejected"] == 1 and metrics["clients"] == 1


def test_hetlora_strategy_sends_each_node_its_top_rows():
    state = {
        "l.lora_A": rng.standard_normal((4, 6)),
        "l.lora_B": np.zeros((5, 4)),
        "classifier.weight": rng.standard_normal((2, 6)),
    }
    strategy = strategy_for("hetlora", state)
    sent = {1: client_state(2, state), 2: client_state(4, state)}
    arrays, metrics = strategy.aggregate_train(
        1, [reply(n, sent[n], r, n) for n, r in ((1, 2), (2, 4))]
    )
    assert metrics["clients"] == 2
    new = from_array_record(arrays)
    pad = np.zeros((2, 6))
    expected_A = 0.5 * np.vstack([sent[1]["l.lora_A"], pad]) + 0.5 * sent[2]["l.lora_A"]
    np.testing.assert_allclose(new["l.lora_A"], expected_A, rtol=1e-6)
    TaskIdentity.node_id = 0
    out = Message(content=RecordDict({"arrays": arrays}), dst_node_id=1, message_type="train")
    mine = from_array_record(strategy.at_node_rank(2, out).content["arrays"])
    assert mine["l.lora_A"].shape == (2, 6) and mine["l.lora_B"].shape == (5, 2)
    np.testing.assert_allclose(mine["l.lora_A"], expected_A[:2], rtol=1e-6)


class FakeGrid:
    """The nodes a round samples (what FedAvg's ``configure_train`` asks a Grid)."""

    def __init__(self, nodes):
        self.nodes = nodes

    def get_node_ids(self):
        return list(self.nodes)


def test_the_next_round_sends_each_node_its_own_rank_and_counts_it():
    from flwr.app import ConfigRecord

    strategy = strategy_for("florg", FLORG_STATE, min_train_nodes=3, min_available_nodes=3)
    ranks = {1: 2, 2: 4, 3: 2}
    replies = [reply(n, client_state(r), r, n - 1) for n, r in ranks.items()]
    arrays, _ = strategy.aggregate_train(1, replies)
    TaskIdentity.node_id = 0
    messages = strategy.configure_train(2, arrays, ConfigRecord(), FakeGrid([1, 2, 3, 4]))
    shapes, head = {"enc.q": (K, K), "enc.v": (K, K)}, 2 * K
    seen = {}
    for m in messages:
        node = m.metadata.dst_node_id
        sent = from_array_record(m.content["arrays"])
        rank = sent["enc.q.A"].shape[0]
        assert rank == ranks.get(node, R_MAX)  # node 4 is unknown: r_max
        assert (
            sum(v.size for v in sent.values())
            == client_communication("florg", shapes, rank, head).down_params
        )
        if node in ranks and rank < R_MAX:
            np.testing.assert_allclose(
                sent["enc.q.A"], strategy.factors_by_rank[rank]["enc.q.A"], rtol=1e-6
            )
        seen[node] = rank
    assert seen == {1: 2, 2: 4, 3: 2, 4: R_MAX}
    # round 2's replies: down counted per rank from the messages that went out
    replies = [reply(n, client_state(r), r, n - 1) for n, r in ranks.items()]
    _, metrics = strategy.aggregate_train(2, replies)
    assert metrics["down-params-r2"] == client_communication("florg", shapes, 2, head).down_params
    assert metrics["down-params-r4"] == client_communication("florg", shapes, 4, head).down_params


def test_a_checkpoint_carries_the_factors_and_node_ranks():
    strategy = strategy_for("florg", FLORG_STATE)
    replies = [reply(n, client_state(r), r, n - 1) for n, r in ((1, 2), (2, 4))]
    strategy.aggregate_train(1, replies)
    resumed = strategy_for("florg", FLORG_STATE)
    resumed.restore(strategy.state_arrays(), strategy.state_json())
    assert resumed.router.node_ranks == {1: 2, 2: 4}
    assert set(resumed.factors_by_rank) == {2}
    for key, value in strategy.factors_by_rank[2].items():
        np.testing.assert_array_equal(resumed.factors_by_rank[2][key], value)
    assert resumed.sent_state(2)["enc.q.A"].shape == (2, K)
