"""round-mode=async's loop (strategies/server/buffered_rounds.py) on a stand-in grid, no
simulation: an empty buffer is never applied (the loop waits for a node, and stops after
the run's timeout when none comes); a checkpoint keeps what a resumed run needs to go on as
the uninterrupted one would (each node's version, the picking generator), and counts the
replies it loses. The runs: tests/runtime/test_async_rounds.py."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable

import numpy as np
import pytest
from flwr.app import ArrayRecord, Error, Message, MetricRecord, RecordDict
from flwr.supercore.task_identity import TaskIdentity

import strategies.server.buffered_rounds as buffered_rounds
from flower_app.wire.records import from_array_record, to_array_record
from tests.harness.strategy_helpers import strategy_for

# a Message needs them outside a Flower app (as tests/runtime/test_flora.py)
TaskIdentity.run_id = 1
TaskIdentity.task_id = 1
TaskIdentity.node_id = 1

HEAD = "classifier.weight"
SHAPES = {"l1.lora_A": (2, 8), "l1.lora_B": (6, 2), HEAD: (3, 8)}


def initial_state() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {k: 0.3 * rng.standard_normal(s) for k, s in SHAPES.items()}


def trained(message: Message) -> Message | None:
    """A node's reply: the arrays it received moved by a step of its own."""
    node = message.metadata.dst_node_id
    sent = from_array_record(message.content["arrays"])
    step = np.random.default_rng(node)
    arrays = {k: (v + 0.1 * step.standard_normal(v.shape)).astype(np.float32)
              for k, v in sent.items()}  # fmt: skip
    metrics = {"num-examples": 10, "train-loss": 1.0, "partition-id": node - 1}
    content = RecordDict({"arrays": to_array_record(arrays), "metrics": MetricRecord(metrics)})
    return Message(content, reply_to=message)


def failed(message: Message) -> Message | None:
    return Message(Error(code=0, reason="out of memory"), reply_to=message)


class Grid:
    """What the buffered loop asks of Flower's grid: a pushed task is answered at once by
    ``answer`` (None: never), the reply waiting in the SuperLink until pulled; ``nodes``
    is who is connected (a callable: asked each time)."""

    def __init__(
        self,
        nodes: list[int] | Callable[[], list[int]],
        answer: Callable[[Message], Message | None] = trained,
    ) -> None:
        self.nodes, self.answer = nodes, answer
        self.waiting: dict[str, Message] = {}
        self.sent: list[tuple[int, int]] = []  # (node, server-round) of each task

    def get_node_ids(self) -> list[int]:
        return list(self.nodes() if callable(self.nodes) else self.nodes)

    def push_messages(self, messages) -> list[str]:
        ids = []
        for message in messages:
            message_id = f"task-{len(self.sent)}"
            message.metadata.__dict__["_message_id"] = message_id  # the SuperLink's part
            self.sent.append(
                (message.metadata.dst_node_id, int(message.content["config"]["server-round"]))
            )
            reply = self.answer(message)
            if reply is not None:
                self.waiting[message_id] = reply
            ids.append(message_id)
        return ids

    def pull_messages(self, message_ids) -> list[Message]:
        return [self.waiting.pop(i) for i in message_ids if i in self.waiting]


def async_strategy(nodes: int, concurrency: int, buffer_size: int, state=None):
    return strategy_for(
        "fedit",
        initial_state() if state is None else state,
        round_mode="async",
        async_concurrency=concurrency,
        async_buffer_size=buffer_size,
        min_available_nodes=nodes,
        min_train_nodes=nodes,
        screen_updates=False,
    )


class Checkpoints:
    """The ServerApp's evaluate_fn, as far as the loop sees it: each version's
    strategy state, through JSON as a checkpoint writes it."""

    def __init__(self, strategy) -> None:
        self.strategy = strategy
        self.saved: dict[int, tuple[dict[str, np.ndarray], dict]] = {}

    def __call__(self, version: int, arrays: ArrayRecord) -> MetricRecord:
        state = json.loads(json.dumps(self.strategy.state_json()))
        self.saved[version] = (dict(self.strategy.state_arrays()), state)
        return MetricRecord({})


def run(strategy, grid: Grid, num_rounds: int, *, timeout: float = 60.0, first_round: int = 1):
    checkpoints = Checkpoints(strategy)
    arrays = to_array_record(strategy.global_state)
    result = strategy.start(grid, arrays, num_rounds, timeout, evaluate_fn=checkpoints,
                            first_round=first_round)  # fmt: skip
    return result, checkpoints


@pytest.fixture
def fast_polls(monkeypatch):
    monkeypatch.setattr(buffered_rounds, "POLL_SECONDS", 0.01)


# -- an empty buffer -------------------------------------------------------------------


def test_nodes_that_vanish_leave_no_empty_update_and_the_run_stops_after_the_timeout(
    fast_polls, caplog
):
    """Every node replies to its first task, then none is connected: update 1 is applied,
    then the loop waits the run's timeout for a node and stops, inventing no update."""
    connected = [1, 2, 3]
    grid = Grid(lambda: connected)
    strategy = async_strategy(3, 3, 3)
    evaluated: list[int] = []
    checkpoints = Checkpoints(strategy)

    def evaluate(version, arrays):
        evaluated.append(version)
        if version == 1:  # after the first update, every node is gone
            connected.clear()
        return checkpoints(version, arrays)

    timeout = 0.3
    started = time.monotonic()
    with caplog.at_level(logging.ERROR, logger="flwr.florg"):
        result = strategy.start(grid, to_array_record(strategy.global_state), 5, timeout,
                                evaluate_fn=evaluate)  # fmt: skip
    assert time.monotonic() - started >= timeout
    assert evaluated == [0, 1] and sorted(result.train_metrics_clientapp) == [1]
    assert sorted(strategy.round_metrics) == [1]
    assert len(strategy.round_metrics[1]["partitions"]) == 3
    assert any("no node could train" in r.getMessage() for r in caplog.records)


def test_nodes_that_all_fail_leave_no_empty_update(fast_polls):
    grid = Grid([1, 2, 3], answer=failed)
    strategy = async_strategy(3, 3, 3)
    result, checkpoints = run(strategy, grid, 3, timeout=0.2)
    assert not result.train_metrics_clientapp and sorted(checkpoints.saved) == [0]
    assert strategy.round_metrics == {}


def test_a_node_that_connects_while_the_loop_waits_is_sent_the_model(fast_polls):
    """The nodes vanish after update 1; a new node connects a few polls later: it trains
    from version 1 and each later update is its reply alone (a buffer that can fill no
    further holds a reply: applied)."""
    polls = {"n": 0}

    def nodes() -> list[int]:
        polls["n"] += 1
        return [1, 2] if len(grid.sent) < 2 else ([] if polls["n"] < 20 else [7])

    grid = Grid(nodes)
    strategy = async_strategy(2, 2, 2)
    result, _ = run(strategy, grid, 3, timeout=30.0)
    assert sorted(result.train_metrics_clientapp) == [1, 2, 3]
    assert [n for n, _ in grid.sent] == [1, 2, 7, 7]
    assert [strategy.round_metrics[v]["partitions"] for v in (1, 2, 3)] == [[0, 1], [6], [6]]


# -- checkpoints -------------------------------------------------------------------------


def test_the_async_state_round_trips_through_a_checkpoint():
    """Each node's last round and version and the picking generator come back as saved; the
    replies in flight and those beyond the buffer are counted as lost."""
    strategy = async_strategy(6, 3, 2)
    _, checkpoints = run(strategy, Grid([1, 2, 3, 4, 5, 6]), 3)
    _, state = checkpoints.saved[2]
    saved = state["async"]
    assert saved["in-flight"] + saved["buffered"] >= 1
    assert saved["node-versions"] and saved["rng"]["bit_generator"] == "PCG64"
    resumed = async_strategy(6, 3, 2)
    resumed.restore(*checkpoints.saved[2])
    loop = resumed.round_loop
    assert loop.node_tasks == {int(k): v for k, v in saved["node-tasks"].items()}
    assert loop.node_versions == {int(k): v for k, v in saved["node-versions"].items()}
    assert loop.pick_rng.bit_generator.state == saved["rng"]
    assert loop.lost_in_flight == saved["in-flight"] + saved["buffered"]
    again = json.loads(json.dumps(resumed.round_loop.state_json()))
    assert {k: again[k] for k in ("node-tasks", "node-versions", "rng")} == {
        k: saved[k] for k in ("node-tasks", "node-versions", "rng")
    }


def test_a_checkpoint_without_the_new_keys_loads_as_before():
    strategy = async_strategy(6, 3, 2)
    strategy.round_loop.load_state_json({"in-flight": 2, "node-tasks": {"1": 3}})
    assert strategy.round_loop.lost_in_flight == 2 and strategy.round_loop.node_tasks == {1: 3}
    assert strategy.round_loop.node_versions == {} and strategy.round_loop.pick_rng is None


def test_a_resumed_run_picks_the_nodes_the_uninterrupted_run_picks():
    """Two of six nodes train at a time, two replies an update (nothing in flight at a
    checkpoint): a run resumed after update 2 sends the same tasks (node, round) and ends
    at the same model as the run that went on."""
    nodes = [1, 2, 3, 4, 5, 6]
    whole = async_strategy(6, 2, 2)
    grid = Grid(nodes)
    result, checkpoints = run(whole, grid, 5)
    resumed = async_strategy(6, 2, 2)
    resumed.restore(*checkpoints.saved[2])
    again = Grid(nodes)
    resumed_result, _ = run(resumed, again, 5, first_round=3)
    assert again.sent == grid.sent[4:]
    final, resumed_final = (from_array_record(r.arrays) for r in (result, resumed_result))
    assert all(np.array_equal(final[k], resumed_final[k]) for k in final)


def test_replies_received_beyond_the_buffer_count_as_lost_on_resume():
    """Three nodes train, two replies an update: the third reply is left in the buffer
    when update 1's checkpoint is taken; a run resumed from it never applies it and counts
    it in ``lost-in-flight``."""
    _, checkpoints = run(async_strategy(3, 3, 2), Grid([1, 2, 3]), 2)
    resumed = async_strategy(3, 3, 2)
    resumed.restore(*checkpoints.saved[1])
    run(resumed, Grid([1, 2, 3]), 2, first_round=2)
    assert resumed.round_metrics[2]["lost-in-flight"] == 1
    saved = checkpoints.saved[1][1]["async"]
    assert saved["in-flight"] == 0 and saved["buffered"] == 1


def test_an_update_counts_the_uplink_bytes_as_they_travelled_not_decoded(fast_polls):
    """Under a lossy uplink-encoding a reply's bytes are those of its encoded arrays (as
    the synchronous ledger counts them), not of the float32 arrays it is decoded into."""
    from flower_app.wire.deployment_bytes import wire_bytes
    from flower_app.wire.encoding import UP, encode_record, encoding_rng

    sent_replies: list[Message] = []

    def int8_reply(message: Message) -> Message:
        reply = trained(message)
        rng = encoding_rng(0, int(message.content["config"]["server-round"]), UP)
        encoded = encode_record(from_array_record(reply.content["arrays"]), "int8", rng)
        content = RecordDict({"arrays": encoded, "metrics": reply.content["metrics"]})
        out = Message(content, reply_to=message)
        sent_replies.append(out)
        return out

    strategy = strategy_for(
        "fedit", initial_state(), round_mode="async", async_concurrency=3,
        async_buffer_size=3, min_available_nodes=3, min_train_nodes=3,
        screen_updates=False, uplink_encoding="int8",
    )  # fmt: skip
    travelled = []
    grid = Grid(
        [1, 2, 3], answer=lambda m: (r := int8_reply(m), travelled.append(wire_bytes(r)))[0]
    )
    run(strategy, grid, 1)
    row = strategy.round_metrics[1]
    assert row["uplink-bytes"] == float(sum(travelled[:3]))
