"""round-mode=sync-overselect's loop (strategies/server/overselected_rounds.py) on the stand-in
grid of tests/runtime/test_async_loop.py, some nodes slow: a round sends ceil(K (1 + f))
tasks and closes at K kept replies (failed and rejected ones do not count) or at its
deadline; later replies are discarded and counted, their nodes left alone while busy; with
f = 0, no deadline and every node fast it is the synchronous round; its settings' refusals
and its checkpoint."""

from __future__ import annotations

import json

import numpy as np
import pytest
from flwr.app import Message, MetricRecord, RecordDict

import strategies.server.overselected_rounds as overselected_rounds
from flower_app.settings.config import ConfigError, resolve_config
from flower_app.wire.encoding import UP, encode_record, encoding_rng
from flower_app.wire.records import from_array_record, to_array_record
from strategies.server.overselected_rounds import round_sizes
from tests.harness.strategy_helpers import strategy_for
from tests.runtime.test_async_loop import Grid, failed, initial_state, run, trained

OVERSELECT = {"round-mode": "sync-overselect"}
# this loop's own keys in a row, beside a synchronous round's; and the timing
OWN_KEYS = {"sent", "kept", "late-discarded", "deadline-hit", "agg-seconds"}


class SlowGrid(Grid):
    """The stand-in grid, with slow nodes: node n of ``slow`` answers a task only after
    ``slow[n]`` polls (``pull_messages`` calls); ``reverse``: a poll returns its replies
    in the reverse order. ``send_and_receive`` is Flower's synchronous round on it."""

    def __init__(self, nodes, answer=trained, slow=None, reverse=False) -> None:
        super().__init__(nodes, answer)
        self.slow, self.reverse = dict(slow or {}), reverse
        self.held: dict[str, list] = {}  # message id -> [polls left, reply]

    def push_messages(self, messages) -> list[str]:
        messages = list(messages)
        ids = super().push_messages(messages)
        for message_id, message in zip(ids, messages, strict=True):
            polls = self.slow.get(message.metadata.dst_node_id, 0)
            if polls and message_id in self.waiting:
                self.held[message_id] = [polls, self.waiting.pop(message_id)]
        return ids

    def pull_messages(self, message_ids) -> list[Message]:
        for message_id, held in list(self.held.items()):
            held[0] -= 1
            if held[0] <= 0:
                self.waiting[message_id] = self.held.pop(message_id)[1]
        pulled = super().pull_messages(message_ids)
        return pulled[::-1] if self.reverse else pulled

    def send_and_receive(self, messages, timeout=None) -> list[Message]:
        return self.pull_messages(self.push_messages(messages))

    def rounds(self) -> dict[int, list[int]]:
        """Each round's nodes sent a task, in sending order."""
        out: dict[int, list[int]] = {}
        for node, server_round in self.sent:
            out.setdefault(server_round, []).append(node)
        return out


def overselect_strategy(nodes: int, *, fraction: float = 0.3, deadline: float = 0.0, **settings):
    return strategy_for(
        "fedit",
        initial_state(),
        round_mode="sync-overselect",
        overselect_fraction=fraction,
        round_deadline=deadline,
        min_available_nodes=nodes,
        screen_updates=False,
        **settings,
    )


@pytest.fixture
def fast_polls(monkeypatch):
    monkeypatch.setattr(overselected_rounds, "POLL_SECONDS", 0.01)


def rejected_for(bad: int, failing: int):
    """Node ``bad`` replies with NaN arrays, node ``failing`` with an error, the rest train."""

    def answer(message: Message) -> Message | None:
        node = message.metadata.dst_node_id
        if node == failing:
            return failed(message)
        reply = trained(message)
        if node == bad:
            arrays = from_array_record(reply.content["arrays"])
            arrays = {k: np.full_like(v, np.nan) for k, v in arrays.items()}
            reply = Message(
                RecordDict(
                    {"arrays": to_array_record(arrays), "metrics": reply.content["metrics"]}
                ),
                reply_to=message,
            )
        return reply

    return answer


# -- how many are sent and kept ------------------------------------------------------------


def test_the_round_sizes_are_fedavgs_k_and_ceil_k_one_plus_f_capped_at_the_nodes():
    assert round_sizes(10, 0.5, 2, 0.3) == (5, 7)  # ceil(6.5)
    assert round_sizes(20, 0.5, 2, 0.3) == (10, 13)  # not the float's ceil(13.000000000000002)
    assert round_sizes(20, 0.5, 2, 0.1) == (10, 11)  # not ceil(11.000000000000002)
    assert round_sizes(10, 1.0, 2, 0.3) == (10, 10)  # every node: nobody left to add
    assert round_sizes(3, 0.5, 5, 0.3) == (3, 3)  # min-train-nodes above the connected
    assert round_sizes(10, 0.5, 2, 0.0) == (5, 5)


def test_a_round_sends_ceil_k_one_plus_f_tasks_and_keeps_k_in_partition_order(fast_polls):
    """Six fast nodes, K = 3, f = 0.3: four tasks a round, all four replies in one poll; the
    three of the lowest partitions are kept whatever order the poll returns them in, the
    fourth discarded and counted in the same row."""
    kept = []
    for reverse in (False, True):
        grid = SlowGrid([1, 2, 3, 4, 5, 6], reverse=reverse)
        strategy = overselect_strategy(6, fraction_train=0.5)
        result, _ = run(strategy, grid, 3)
        sent = grid.rounds()
        assert [len(sent[r]) for r in (1, 2, 3)] == [4, 4, 4]
        for r in (1, 2, 3):
            row = strategy.round_metrics[r]
            assert (row["sent"], row["kept"], row["clients"]) == (4, 3, 3)
            assert (row["late-discarded"], row["deadline-hit"]) == (1, 0)
            assert row["partitions"] == sorted(n - 1 for n in sent[r])[:3]
        kept.append((sent, from_array_record(result.arrays)))
    (sent, arrays), (sent_reversed, arrays_reversed) = kept
    assert sent == sent_reversed  # the same picks: one seed
    assert all(np.array_equal(arrays[k], arrays_reversed[k]) for k in arrays)


def test_failed_and_rejected_replies_do_not_count_toward_k(fast_polls):
    """Four nodes, K = 3, f = 0.3: all four sent; node 1 fails and node 2's arrays are NaN,
    so two replies are kept and, no task of the round left, the round closes with them."""
    grid = SlowGrid([1, 2, 3, 4], answer=rejected_for(bad=2, failing=1))
    strategy = overselect_strategy(4, fraction_train=0.75)
    run(strategy, grid, 1)
    row = strategy.round_metrics[1]
    assert (row["sent"], row["kept"], row["clients"], row["failures"], row["rejected"]) == (
        4, 2, 2, 1, 1,
    )  # fmt: skip
    assert (row["late-discarded"], row["deadline-hit"]) == (0, 0)


def test_a_slow_nodes_reply_is_discarded_counted_next_row_and_it_gets_no_task_meanwhile(
    fast_polls,
):
    """Four nodes, K = 3, f = 0.3: node 4 answers three polls after its task. Round 1 closes
    at the other three's replies; round 2 goes to the three idle nodes only; node 4's reply
    comes during round 2 and is discarded, counted there; round 3 sends to all four again.
    The update of round 2 is the synchronous step over its three fresh replies alone."""
    grid = SlowGrid([1, 2, 3, 4], slow={4: 3})
    strategy = overselect_strategy(4, fraction_train=0.75)
    states = {}

    def evaluate(server_round, arrays):
        states[server_round] = dict(strategy.global_state)
        return MetricRecord({})

    strategy.start(grid, to_array_record(strategy.global_state), 3, 60.0, evaluate_fn=evaluate)
    sent = grid.rounds()
    assert sent == {1: [1, 2, 3, 4], 2: [1, 2, 3], 3: [1, 2, 3, 4]}
    rows = strategy.round_metrics
    assert [(rows[r]["sent"], rows[r]["kept"], rows[r]["late-discarded"]) for r in (1, 2, 3)] == [
        (4, 3, 0), (3, 3, 1), (4, 3, 0),
    ]  # fmt: skip
    assert [rows[r]["partitions"] for r in (1, 2, 3)] == [[0, 1, 2]] * 3
    assert rows[2]["uplink-bytes"] > rows[1]["uplink-bytes"]  # the discarded reply travelled
    # round 2 again: a synchronous step over the three replies to round 2's model
    check = overselect_strategy(4, fraction_train=0.75)
    check.global_state = dict(states[1])
    messages = [
        trained(sent_message(check, node, 2)) for node in (1, 2, 3)
    ]  # what nodes 1-3 sent back
    check.aggregate_replies(2, [check.check_reply(m, 2) for m in messages])
    assert all(np.array_equal(check.global_state[k], states[2][k]) for k in states[2])


def sent_message(strategy, node: int, server_round: int) -> Message:
    """The training message ``node`` gets in ``server_round`` from ``strategy``'s model."""
    message = Message(
        RecordDict({"arrays": to_array_record(strategy.global_state)}),
        dst_node_id=node,
        message_type="train",
    )
    message.metadata.__dict__["_message_id"] = f"check-{node}-{server_round}"
    return message


def int8_reply(message: Message) -> Message:
    """A node's reply, its arrays sent as uplink-encoding=int8 sends them."""
    reply = trained(message)
    rng = encoding_rng(0, int(message.content["config"]["server-round"]), UP)
    encoded = encode_record(from_array_record(reply.content["arrays"]), "int8", rng)
    return Message(
        RecordDict({"arrays": encoded, "metrics": reply.content["metrics"]}), reply_to=message
    )


@pytest.mark.parametrize("uplink", ["fp32", "int8"])
def test_without_overselection_or_deadline_a_round_is_the_synchronous_round(uplink):
    """f = 0, no deadline, five fast nodes: each row is the synchronous round's (Flower's
    loop on the same grid) plus this loop's own keys, the bytes of an encoded uplink counted
    as they travelled, and the arrays are equal bit for bit."""
    nodes, answer = [1, 2, 3, 4, 5], trained if uplink == "fp32" else int8_reply
    sync = strategy_for("fedit", initial_state(), min_available_nodes=5, min_train_nodes=5,
                        screen_updates=False, uplink_encoding=uplink)  # fmt: skip
    sync_result, _ = run(sync, SlowGrid(nodes, answer), 3)
    over = overselect_strategy(5, fraction=0.0, min_train_nodes=5, uplink_encoding=uplink)
    over_result, _ = run(over, SlowGrid(nodes, answer), 3)
    for r in (1, 2, 3):
        row, sync_row = over.round_metrics[r], sync.round_metrics[r]
        assert (row["sent"], row["kept"], row["late-discarded"], row["deadline-hit"]) == (
            5, 5, 0, 0,
        )  # fmt: skip
        assert {k: v for k, v in row.items() if k not in OWN_KEYS} == {
            k: v for k, v in sync_row.items() if k != "agg-seconds"
        }
    final, sync_final = from_array_record(over_result.arrays), from_array_record(sync_result.arrays)
    assert all(np.array_equal(final[k], sync_final[k]) for k in sync_final)
    state, sync_state = over.global_state, sync.global_state
    assert all(np.array_equal(state[k], sync_state[k]) for k in sync_state)


# -- the deadline ------------------------------------------------------------------------------


def test_the_deadline_closes_a_round_with_fewer_than_k_replies(fast_polls):
    """Four nodes, K = 4, node 4 far slower than the 0.1 s deadline: the round closes with
    three replies and says so; the update is the step over those three."""
    grid = SlowGrid([1, 2, 3, 4], slow={4: 10**6})
    strategy = overselect_strategy(4, fraction=0.0, deadline=0.1, min_train_nodes=4)
    start = dict(strategy.global_state)
    run(strategy, grid, 1)
    row = strategy.round_metrics[1]
    assert (row["sent"], row["kept"], row["clients"], row["deadline-hit"]) == (4, 3, 3, 1)
    assert row["partitions"] == [0, 1, 2]
    assert not all(np.array_equal(start[k], strategy.global_state[k]) for k in start)


def test_no_reply_by_the_deadline_leaves_the_model_unchanged_and_the_row_says_so(fast_polls):
    """No node answers in time: round 1 keeps nothing and invents no update (the model as
    it was, ``clients`` 0, ``deadline-hit`` 1); its tasks time out (0.3 s) while round 2
    waits for an idle node, and round 2 counts them lost."""
    grid = SlowGrid([1, 2, 3], slow={1: 10**6, 2: 10**6, 3: 10**6})
    strategy = overselect_strategy(3, deadline=0.1)
    start = {k: v.copy() for k, v in strategy.global_state.items()}
    result, checkpoints = run(strategy, grid, 2, timeout=0.3)
    rows = strategy.round_metrics
    assert (rows[1]["sent"], rows[1]["kept"], rows[1]["clients"], rows[1]["deadline-hit"]) == (
        3, 0, 0, 1,
    )  # fmt: skip
    assert "train-loss" not in rows[1] and "examples" not in rows[1]
    assert all(np.array_equal(start[k], strategy.global_state[k]) for k in start)
    assert sorted(checkpoints.saved) == [0, 1, 2]
    assert sorted(result.train_metrics_clientapp) == [1, 2]
    assert (rows[2]["lost-nodes"], rows[2]["sent"], rows[2]["kept"]) == (3, 3, 0)
    assert grid.rounds() == {1: [1, 2, 3], 2: [1, 2, 3]}


# -- checkpoints -------------------------------------------------------------------------------


def test_the_state_round_trips_and_a_resumed_run_counts_the_tasks_it_lost(fast_polls):
    """Node 4 is still training when round 1's checkpoint is taken: a run resumed from it
    counts that task in ``lost-in-flight`` (and sends node 4 a task at once: nothing of the
    old run is in flight); the picking generator comes back as saved."""
    grid = SlowGrid([1, 2, 3, 4], slow={4: 3})
    _, checkpoints = run(overselect_strategy(4, fraction_train=0.75), grid, 2)
    saved = checkpoints.saved[1][1]["async"]
    assert saved["in-flight"] == 1 and saved["rng"]["bit_generator"] == "PCG64"
    resumed = overselect_strategy(4, fraction_train=0.75)
    resumed.restore(*checkpoints.saved[1])
    loop = resumed.round_loop
    assert loop.lost_in_flight == 1 and loop.pick_rng.bit_generator.state == saved["rng"]
    # saved again before it runs: the generator as it was, nothing of its own in flight
    assert json.loads(json.dumps(loop.state_json())) == {**saved, "in-flight": 0}
    again = SlowGrid([1, 2, 3, 4])
    run(resumed, again, 2, first_round=2)
    assert resumed.round_metrics[2]["lost-in-flight"] == 1
    assert again.rounds() == {2: [1, 2, 3, 4]}


def test_a_resumed_run_picks_the_nodes_the_uninterrupted_run_picks(fast_polls):
    """Six fast nodes, K = 3, four tasks a round (random picks): a run resumed after round 1
    sends the same tasks and ends at the same model as the run that went on."""
    nodes = [1, 2, 3, 4, 5, 6]
    whole = overselect_strategy(6, fraction_train=0.5)
    grid = SlowGrid(nodes)
    result, checkpoints = run(whole, grid, 3)
    resumed = overselect_strategy(6, fraction_train=0.5)
    resumed.restore(*checkpoints.saved[1])
    again = SlowGrid(nodes)
    resumed_result, _ = run(resumed, again, 3, first_round=2)
    assert again.sent == grid.sent[4:]
    final, resumed_final = (from_array_record(r.arrays) for r in (result, resumed_result))
    assert all(np.array_equal(final[k], resumed_final[k]) for k in final)


# -- the settings -----------------------------------------------------------------------------


def test_the_settings_reach_the_loop():
    strategy = overselect_strategy(4, fraction=0.5, deadline=30.0, seed=7)
    settings = strategy.round_loop.settings
    assert (settings.fraction, settings.deadline, settings.seed) == (0.5, 30.0, 7)
    assert strategy.server_lr == 1.0 and strategy.staleness_exponent == 0.0


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize(
    "settings", [{"overselect-fraction": 0.5}, {"overselect-fraction": 0.0}, {"round-deadline": 5}]
)
def test_the_overselect_settings_are_refused_in_the_other_modes(mode, settings):
    key = next(iter(settings))
    with pytest.raises(ConfigError, match=f"{key}: set only with round-mode=sync-overselect"):
        resolve_config({"round-mode": mode, **settings})


@pytest.mark.parametrize(
    "settings",
    [{"async-concurrency": 2}, {"async-buffer-size": 2}, {"async-server-lr": 0.5}],
)
def test_the_async_settings_are_refused_under_it(settings):
    key = next(iter(settings))
    with pytest.raises(ConfigError, match=key):
        resolve_config({**OVERSELECT, **settings})


@pytest.mark.parametrize(
    ("settings", "key", "reason"),
    [
        ({"dp": "central", "dp-clipping-norm": 1.0, "dp-noise-multiplier": 1.0}, "dp",
         "uniform sample"),
        ({"client-sampling": "poisson", "fraction-train": 0.5}, "client-sampling",
         "fixed sample size"),
        ({"client-eval": "on"}, "client-eval", "no client evaluation"),
        ({"method": "fedex-lora"}, "round-mode", "folds into W0"),
        ({"overselect-fraction": -0.1}, "overselect-fraction", ">= 0"),
        ({"round-deadline": -1.0}, "round-deadline", ">= 0"),
        ({"round-deadline": float("inf")}, "round-deadline", "finite"),
    ],
)  # fmt: skip
def test_what_it_cannot_run_is_refused_naming_the_key(settings, key, reason):
    with pytest.raises(ConfigError, match=key) as err:
        resolve_config({**OVERSELECT, **settings})
    assert reason in str(err.value)


def test_a_strategy_with_its_own_aggregate_train_is_refused_when_built():
    """Its aggregate_train would never run (Fed-SB learns from it which nodes hold B, A)."""
    with pytest.raises(ValueError, match="aggregate_train of its own"):
        strategy_for("fed-sb", initial_state(), round_mode="sync-overselect")


def test_it_runs_dp_sgd_on_the_clients_and_defaults_as_documented():
    config = resolve_config({**OVERSELECT, "dp": "example", "dp-sgd-target-epsilon": 8.0})
    assert config.round_mode == "sync-overselect" and config.dp == "example"
    assert (config.overselect_fraction, config.round_deadline) == (0.3, 0.0)
