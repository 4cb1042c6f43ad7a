"""The virtual clock (strategies/server/virtual_clock.py, flower_app/client/node_speed.py):
its cost model and the nodes' draws, its settings' refusals, and the loops on the stand-in
grids of tests/runtime/test_async_loop.py and test_overselected_rounds.py, whose real reply
order is the opposite of the virtual one: replies are taken in virtual finish order, and the
rows are the same whatever order the real replies come in. End to end:
tests/runtime/test_virtual_clock_app.py."""

from __future__ import annotations

import json
import math
import time

import numpy as np
import pytest
from flwr.app import Context, Error, Message, Metadata, MetricRecord, RecordDict

import strategies.server.buffered_rounds as buffered_rounds
import strategies.server.overselected_rounds as overselected_rounds
from flower_app.client.node_speed import (
    NodeCosts,
    compute_multiplier,
    lognormal_multiplier,
    node_costs,
)
from flower_app.settings.config import ConfigError
from flower_app.wire.records import to_array_record
from strategies.server.encoded_messages import MessageEncodings
from strategies.server.virtual_clock import (
    PROFILE,
    ClockSettings,
    NodeProfile,
    VirtualClock,
    task_examples,
    task_seconds,
)
from tests.harness.strategy_helpers import run_settings, strategy_for
from tests.runtime.test_async_loop import initial_state, run
from tests.runtime.test_overselected_rounds import SlowGrid

CLOCK = {"virtual_clock": True, "screen_updates": False}
VIRTUAL_KEYS = {"virtual-seconds", "virtual-round-seconds"}


@pytest.fixture
def fast_polls(monkeypatch):
    monkeypatch.setattr(buffered_rounds, "POLL_SECONDS", 0.01)
    monkeypatch.setattr(overselected_rounds, "POLL_SECONDS", 0.01)


# -- the cost model ------------------------------------------------------------------------


def test_a_tasks_duration_is_latency_bytes_over_bandwidth_examples_and_delay():
    profile = NodeProfile(partition=0, examples=100, seconds_per_example=0.05,
                          bandwidth_mbps=8.0, latency=0.25, delay=0.0)  # fmt: skip
    # 8 Mbit/s = 1e6 bytes a second: 2 MB down and 1 MB up take 3 s
    assert task_seconds(profile, 40, 2_000_000, 1_000_000) == pytest.approx(0.5 + 3.0 + 2.0)
    # a straggler's fixed delay adds to its task as it is, whatever the examples
    delayed = NodeProfile(0, 100, 0.05, 8.0, 0.25, delay=7.0)
    assert task_seconds(delayed, 40, 2_000_000, 1_000_000) == pytest.approx(5.5 + 7.0)
    assert task_seconds(delayed, 80, 0, 0) == pytest.approx(0.5 + 4.0 + 7.0)
    assert task_examples(ClockSettings(local_steps=3, batch_size=8), 100) == 24
    assert task_examples(ClockSettings(local_steps=0, local_epochs=2), 100) == 200


def test_the_lognormal_draw_depends_on_the_seed_and_the_partition_alone():
    draws = [lognormal_multiplier(0, p, 0.5) for p in range(8)]
    assert draws == [lognormal_multiplier(0, p, 0.5) for p in range(8)]
    assert len(set(draws)) == 8 and all(d > 0 for d in draws)
    assert draws != [lognormal_multiplier(1, p, 0.5) for p in range(8)]
    assert lognormal_multiplier(0, 3, 0.0) == 1.0
    # the same z: sigma scales its log
    assert math.log(lognormal_multiplier(5, 2, 1.0)) == pytest.approx(
        2 * math.log(lognormal_multiplier(5, 2, 0.5))
    )


def test_a_nodes_costs_take_its_speed_and_its_node_config():
    fixed = run_settings("fedit", virtual_clock=True, slow_partitions="1", slowdown=4.0,
                         node_seconds_per_example=0.1)  # fmt: skip
    assert node_costs(fixed, {}, 0) == NodeCosts(0.1, 20.0, 0.05, 0.0)
    assert node_costs(fixed, {}, 1).seconds_per_example == pytest.approx(0.4)
    own = {"seconds-per-example": "0.2", "bandwidth-mbps": 100, "latency": 0, "slowdown": 2,
           "delay-seconds": "1.5"}  # fmt: skip
    assert node_costs(fixed, own, 1) == NodeCosts(pytest.approx(0.4), 100.0, 0.0, 1.5)
    delayed = run_settings("fedit", virtual_clock=True, slow_partitions="1", slow_delay=3.0)
    assert [node_costs(delayed, {}, p).delay for p in (0, 1)] == [0.0, 3.0]
    assert node_costs(delayed, {"delay-seconds": 0}, 1).delay == 0.0  # the node's own wins
    drawn = run_settings("fedit", virtual_clock=True, node_speeds="lognormal",
                         node_speed_sigma=1.0)  # fmt: skip
    assert compute_multiplier(drawn, {}, 3) == lognormal_multiplier(drawn.seed, 3, 1.0)
    assert compute_multiplier(drawn, {"slowdown": 3}, 3) == 3.0  # the node's own wins


@pytest.mark.parametrize(
    ("key", "value"),
    [("seconds-per-example", 0), ("seconds-per-example", "fast"), ("bandwidth-mbps", -1),
     ("bandwidth-mbps", "inf"), ("latency", -0.1), ("slowdown", 0.5),
     ("delay-seconds", -1), ("delay-seconds", "nan")],
)  # fmt: skip
def test_a_bad_node_config_value_is_refused_naming_the_key(key, value):
    config = run_settings("fedit", virtual_clock=True)
    with pytest.raises(ConfigError, match=f"node-config {key}"):
        node_costs(config, {key: value}, 2)


@pytest.mark.parametrize(
    ("settings", "key"),
    [({"node_latency": 1.0}, "node-latency"),
     ({"node_speeds": "lognormal"}, "node-speeds"),
     ({"virtual_clock": True, "node_speed_sigma": 1.0}, "node-speed-sigma"),
     ({"virtual_clock": True, "node_speeds": "lognormal", "slow_partitions": "0"},
      "slow-partitions"),
     ({"virtual_clock": True, "node_bandwidth_mbps": 0.0}, "node-bandwidth-mbps"),
     ({"virtual_clock": True, "node_seconds_per_example": -1.0}, "node-seconds-per-example"),
     ({"virtual_clock": True, "node_speeds": "normal"}, "node-speeds"),
     ({"slow_partitions": "0", "slow_delay": -1.0}, "slow-delay"),
     ({"slow_delay": 5.0}, "slow-delay")],
)  # fmt: skip
def test_bad_clock_settings_are_refused_naming_the_key(settings, key):
    with pytest.raises(ConfigError, match=key):
        run_settings("fedit", **settings)


def test_the_reply_estimate_is_the_arrays_under_the_uplink_encoding():
    """The reply's arrays as uplink-encoding sends them: int8 well under fp32."""
    state = {"l1.lora_A": 0.1 * np.ones((8, 512)), "l1.lora_B": 0.1 * np.ones((512, 8))}
    message = Message(RecordDict({"arrays": to_array_record(state)}), dst_node_id=1,
                      message_type="train")  # fmt: skip
    sizes = {}
    for encoding in ("fp32", "int8"):
        clock = VirtualClock(ClockSettings(), MessageEncodings(encoding))
        sizes[encoding] = clock.up_bytes(message, state)
    assert 4 * 8192 < sizes["fp32"] < 4 * 8192 + 4096
    assert 8192 < sizes["int8"] < sizes["fp32"] / 2  # a byte an entry, plus the row scales


# -- the loops on a stand-in grid ----------------------------------------------------------


class ClockGrid(SlowGrid):
    """The stand-in grid, answering ``query.profile`` with ``profiles`` (node -> seconds per
    example; each node 100 examples, 1000 Mbit/s, no latency)."""

    def __init__(self, nodes, profiles, **kwargs) -> None:
        super().__init__(nodes, **kwargs)
        self.profiles, self.queried = profiles, []

    def send_and_receive(self, messages, timeout=None) -> list[Message]:
        messages = list(messages)
        if not all(m.metadata.message_type == PROFILE for m in messages):
            return super().send_and_receive(messages, timeout)
        replies = []
        for message in messages:
            node = message.metadata.dst_node_id
            self.queried.append(node)
            message.metadata.__dict__["_message_id"] = f"profile-{node}"
            metrics = {"partition-id": node - 1, "num-examples": 100, "latency": 0.0,
                       "seconds-per-example": self.profiles[node],
                       "bandwidth-mbps": 1000.0, "delay": 0.0}  # fmt: skip
            replies.append(
                Message(RecordDict({"metrics": MetricRecord(metrics)}), reply_to=message)
            )
        return replies


# virtually, node 1 is the slowest and node 4 the fastest; really, the other way round
SPEEDS = {1: 0.4, 2: 0.3, 3: 0.2, 4: 0.1, 5: 0.5, 6: 0.6}
REAL_ORDERS = ({1: 1, 2: 3, 3: 5, 4: 7}, {})  # polls before a node's reply is in


def comparable(strategy) -> dict:
    rows = {r: {k: v for k, v in row.items() if k != "agg-seconds"}
            for r, row in strategy.round_metrics.items()}  # fmt: skip
    return json.loads(json.dumps({"rows": rows, "state": {k: v.tolist() for k, v in
                                  strategy.global_state.items()}}))  # fmt: skip


def test_async_takes_replies_in_virtual_order_whatever_their_real_order(fast_polls):
    """Four nodes, all in flight, two replies an update: the virtually fastest two make
    update 1, whichever came first, and the rows are the same for two real orders."""
    outcomes = []
    for slow in REAL_ORDERS:
        grid = ClockGrid([1, 2, 3, 4], SPEEDS, slow=slow, reverse=bool(slow))
        strategy = strategy_for("fedit", initial_state(), round_mode="async", async_concurrency=4,
                                async_buffer_size=2, min_available_nodes=4, **CLOCK)  # fmt: skip
        run(strategy, grid, 3)
        rows = strategy.round_metrics
        assert rows[1]["partitions"] == [2, 3]  # nodes 3 and 4: 20 s and 10 s
        # 100 examples at 0.1 s, 0.2 s; the bytes at 1000 Mbit/s add a little
        assert rows[1]["virtual-seconds"] == pytest.approx(20.0, abs=0.01)
        assert [rows[v]["virtual-seconds"] for v in (1, 2, 3)] == sorted(
            rows[v]["virtual-seconds"] for v in (1, 2, 3)
        )
        assert sorted(grid.queried) == [1, 2, 3, 4]  # each profile asked once
        outcomes.append(comparable(strategy))
    assert outcomes[0] == outcomes[1]


def test_async_rows_match_the_virtual_events():
    """The virtual history by hand (0.1, 0.2, 0.35, 0.45 s an example, 100 examples): nodes
    4 and 3 make update 1 at 20 s and start again from it (finishing at 30 s and 40 s); node
    4's second reply (fresh) and node 2's first (35 s, trained from version 0) make update
    2 at 35 s."""
    grid = ClockGrid([1, 2, 3, 4], {1: 0.45, 2: 0.35, 3: 0.2, 4: 0.1})
    strategy = strategy_for("fedit", initial_state(), round_mode="async", async_concurrency=4,
                            async_buffer_size=2, min_available_nodes=4, **CLOCK)  # fmt: skip
    run(strategy, grid, 2)
    rows = strategy.round_metrics
    assert rows[1]["partitions"] == [2, 3] and rows[1]["staleness"] == [0, 0]
    assert rows[2]["partitions"] == [1, 3] and rows[2]["staleness"] == [1, 0]
    assert rows[2]["virtual-seconds"] == pytest.approx(35.0, abs=0.01)
    assert rows[2]["virtual-round-seconds"] == pytest.approx(15.0, abs=0.01)
    assert rows[2]["in-flight"] == 2  # nodes 1 and 3 (node 4 starts again after it)


def test_overselect_keeps_the_virtually_first_k_whatever_their_real_order(fast_polls):
    """Six nodes, K = 3, f = 0.3: four tasks a round; the three virtually fastest of them
    are kept, the fourth is late, and the rows are the same for two real orders."""
    outcomes = []
    for slow in REAL_ORDERS:
        grid = ClockGrid([1, 2, 3, 4, 5, 6], SPEEDS, slow=slow, reverse=bool(slow))
        strategy = strategy_for("fedit", initial_state(), round_mode="sync-overselect",
                                fraction_train=0.5, min_available_nodes=6, **CLOCK)  # fmt: skip
        run(strategy, grid, 3)
        sent = grid.rounds()
        rows = strategy.round_metrics
        for r in (1, 2, 3):
            fastest = sorted(sent[r], key=SPEEDS.__getitem__)[:3]
            assert rows[r]["partitions"] == sorted(n - 1 for n in fastest)
            assert rows[r]["kept"] == 3
            slowest = max(SPEEDS[n] for n in fastest)
            assert rows[r]["virtual-round-seconds"] >= 100 * slowest
        outcomes.append((comparable(strategy), sent))
    assert outcomes[0] == outcomes[1]


def test_overselect_deadline_is_virtual_and_a_late_node_stays_busy(fast_polls):
    """Four nodes, K = 3 of 4 sent, deadline 25 virtual seconds: round 1 keeps nodes 4 and 3
    (10 s, 20 s) and closes at 25 s; nodes 2 (30 s) and 1 (40 s) are late and busy, so
    round 2 goes to nodes 3 and 4 alone, and their late replies are counted there."""
    grid = ClockGrid([1, 2, 3, 4], SPEEDS, slow={4: 4})
    strategy = strategy_for("fedit", initial_state(), round_mode="sync-overselect",
                            fraction_train=0.75, round_deadline=25.0, min_available_nodes=4,
                            **CLOCK)  # fmt: skip
    run(strategy, grid, 2)
    rows = strategy.round_metrics
    assert (rows[1]["kept"], rows[1]["deadline-hit"], rows[1]["partitions"]) == (2, 1, [2, 3])
    assert rows[1]["virtual-seconds"] == 25.0
    assert grid.rounds()[2] == [3, 4]
    # round 2 from 25 s: node 4 at 35 s, node 3 at 45 s, beyond the deadline at 50 s; the
    # late replies of nodes 2 (30 s) and 1 (40 s) are discarded while it is open
    assert (rows[2]["kept"], rows[2]["late-discarded"]) == (2, 2)
    assert rows[2]["virtual-seconds"] == pytest.approx(45.0, abs=0.01)


def test_sync_round_lasts_its_slowest_task():
    grid = ClockGrid([1, 2, 3], SPEEDS)
    strategy = strategy_for("fedit", initial_state(), min_available_nodes=3, **CLOCK)
    run(strategy, grid, 2)
    rows = strategy.round_metrics
    assert rows[1]["virtual-round-seconds"] == pytest.approx(40.0, abs=0.01)  # node 1
    assert rows[2]["virtual-seconds"] == pytest.approx(80.0, abs=0.02)


def test_off_by_default_no_clock_and_no_virtual_keys(fast_polls):
    """Off (the default): no profile is asked, the rows hold no virtual key."""
    for mode in ("sync", "async", "sync-overselect"):
        grid = ClockGrid([1, 2, 3, 4], SPEEDS)
        strategy = strategy_for("fedit", initial_state(), round_mode=mode, min_available_nodes=4,
                                screen_updates=False)  # fmt: skip
        assert strategy.clock is None
        run(strategy, grid, 2)
        assert not grid.queried
        assert all(not VIRTUAL_KEYS & set(row) for row in strategy.round_metrics.values())


def test_the_clock_round_trips_through_a_checkpoint(fast_polls):
    grid = ClockGrid([1, 2, 3, 4], SPEEDS)
    strategy = strategy_for("fedit", initial_state(), round_mode="async", async_concurrency=4,
                            async_buffer_size=2, min_available_nodes=4, **CLOCK)  # fmt: skip
    _, checkpoints = run(strategy, grid, 2)
    arrays, state = checkpoints.saved[1]
    assert state["virtual-clock"]["now"] == pytest.approx(20.0, abs=0.01)
    resumed = strategy_for("fedit", initial_state(), round_mode="async", async_concurrency=4,
                           async_buffer_size=2, min_available_nodes=4, **CLOCK)  # fmt: skip
    resumed.restore(arrays, state)
    assert resumed.clock.now == state["virtual-clock"]["now"]
    assert resumed.clock.busy_until == {int(k): v for k, v in
                                        state["virtual-clock"]["busy-until"].items()}  # fmt: skip


def test_the_clientapp_states_its_profile_without_a_model(tiny_client_settings):
    """``query.profile`` on the tiny task: the partition, its 16 of the 32 training
    examples, its lognormal speed and its node-config bandwidth."""
    from client_app.client_app import profile

    run_config = {**tiny_client_settings, "virtual-clock": True, "node-speeds": "lognormal"}
    node_config = {"partition-id": 1, "num-partitions": 2, "bandwidth-mbps": 5}
    context = Context(run_id=1, node_id=7, node_config=node_config, state=RecordDict(),
                      run_config=run_config)  # fmt: skip
    metadata = Metadata(
        run_id=1, message_id="p1", src_node_id=0, dst_node_id=7, reply_to_message_id="",
        group_id="", created_at=time.time(), ttl=600.0, message_type=PROFILE,
    )  # fmt: skip
    reply = profile(Message(content=RecordDict(), metadata=metadata), context)
    stated = NodeProfile.from_reply(reply)
    seed = run_settings("fedit").seed
    assert (stated.partition, stated.examples, stated.bandwidth_mbps) == (1, 16, 5.0)
    assert stated.seconds_per_example == pytest.approx(0.05 * lognormal_multiplier(seed, 1, 0.5))
    assert stated.latency == 0.05


def test_a_node_that_cannot_state_its_profile_stops_the_run_naming_it():
    class Refusing(ClockGrid):
        def send_and_receive(self, messages, timeout=None) -> list[Message]:
            asks = list(messages)
            replies = super().send_and_receive(asks, timeout)
            error = Error(code=0, reason="node-config latency: -1 must be a finite number >= 0")
            return [Message(error, reply_to=ask) if ask.metadata.dst_node_id == 2 else reply
                    for ask, reply in zip(asks, replies, strict=True)]  # fmt: skip

    clock = VirtualClock(ClockSettings(), MessageEncodings())
    with pytest.raises(RuntimeError, match="node 2 could not state its profile.*latency"):
        clock.learn(Refusing([1, 2], SPEEDS), [1, 2])
