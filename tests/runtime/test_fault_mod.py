"""Fault injection is a Flower client mod (flower_app/client/faults.py) around the ClientApp: it
acts on training messages of the partition ``fault-partition`` only, and leaves the round
itself (flower_app/client/round.py) alone. End to end: tests/runtime/test_app_e2e.py."""

from __future__ import annotations

import time

import numpy as np
import pytest
from flwr.app import ConfigRecord, Context, Message, Metadata, MetricRecord, RecordDict

from client_app.client_app import app
from flower_app.client.faults import inject_faults
from flower_app.wire.records import from_array_record, to_array_record

PAYLOAD = {
    "enc.q.A": np.full((2, 4), 0.5, np.float32),
    "classifier.weight": np.ones((2, 4), np.float32),
}


def message(kind: str = "train", server_round: int = 1) -> Message:
    metadata = Metadata(
        run_id=1, message_id="m1", src_node_id=0, dst_node_id=1, reply_to_message_id="",
        group_id="1", created_at=time.time(), ttl=600.0, message_type=kind,
    )  # fmt: skip
    return Message(
        content=RecordDict({"config": ConfigRecord({"server-round": server_round})}),
        metadata=metadata,
    )


def context(partition: int, **settings) -> Context:
    return Context(
        run_id=1, node_id=1, node_config={"partition-id": partition, "num-partitions": 3},
        state=RecordDict(), run_config={"fault-partition": 1, **settings},
    )  # fmt: skip


def honest_round(msg: Message, ctx: Context) -> Message:
    content = RecordDict(
        {
            "arrays": to_array_record(PAYLOAD),
            "metrics": MetricRecord({"num-examples": 80, "partition-id": 1}),
        }
    )
    return Message(content=content, reply_to=msg)


def test_the_client_app_carries_the_fault_mod():
    assert inject_faults in app._mods  # every message of the ClientApp passes through it


def test_other_partitions_and_other_messages_pass_through_unchanged():
    for msg, ctx in (
        (message(), context(0, **{"fault-kind": "nan"})),  # another partition
        (message("evaluate"), context(1, **{"fault-kind": "raise"})),  # not training
    ):
        reply = inject_faults(msg, ctx, honest_round)
        arrays = from_array_record(reply.content["arrays"])
        assert all(np.array_equal(arrays[k], PAYLOAD[k]) for k in PAYLOAD)
        assert reply.content["metrics"]["num-examples"] == 80


def test_raise_fails_before_the_round_runs():
    def round_that_must_not_run(msg, ctx):
        raise AssertionError("the round ran")

    ctx = context(1, **{"fault-kind": "raise"})
    with pytest.raises(RuntimeError, match="fault injected on partition 1"):
        inject_faults(message(), ctx, round_that_must_not_run)


@pytest.mark.parametrize("kind", ["nan", "shape", "scale", "claim"])
def test_each_kind_spoils_the_reply_as_documented(kind):
    reply = inject_faults(
        message(), context(1, **{"fault-kind": kind, "fault-scale": 10.0}), honest_round
    )
    arrays = from_array_record(reply.content["arrays"])
    claimed = reply.content["metrics"]["num-examples"]
    head = arrays["classifier.weight"]
    if kind == "nan":
        assert np.isnan(arrays["enc.q.A"]).all() and np.array_equal(
            head, PAYLOAD["classifier.weight"]
        )
    elif kind == "shape":
        assert arrays["enc.q.A"].shape == (2, 3)
    elif kind == "scale":  # the adapter only; the head stays honest
        assert np.array_equal(arrays["enc.q.A"], PAYLOAD["enc.q.A"] * 10.0)
        assert np.array_equal(head, PAYLOAD["classifier.weight"])
    if kind == "claim":
        assert claimed == 10.0 and np.array_equal(arrays["enc.q.A"], PAYLOAD["enc.q.A"])
    else:
        assert claimed == 80


def test_a_comma_list_gives_each_round_its_own_kind_cycled():
    """Round t misbehaves as the t-th kind of the list, cycled (one run, several faults)."""
    ctx = context(1, **{"fault-kind": "nan, claim", "fault-scale": 10.0})
    for server_round, kind in [(1, "nan"), (2, "claim"), (3, "nan"), (4, "claim")]:
        reply = inject_faults(message(server_round=server_round), ctx, honest_round)
        arrays = from_array_record(reply.content["arrays"])
        assert np.isnan(arrays["enc.q.A"]).all() == (kind == "nan"), server_round
        assert (reply.content["metrics"]["num-examples"] == 10.0) == (kind == "claim")
    with pytest.raises(RuntimeError, match="fault injected"):  # round 3 of raise,nan,raise
        inject_faults(message(server_round=3), context(1, **{"fault-kind": "raise,nan,raise"}),
                      honest_round)  # fmt: skip


def test_a_fault_kind_outside_the_list_is_a_config_error():
    from flower_app.settings.config import ConfigError, resolve_config

    assert resolve_config({"fault-kind": "raise,nan"}).fault_kind == "raise,nan"
    with pytest.raises(ConfigError, match="fault-kind: bad value 'nan,melt'.*comma list"):
        resolve_config({"fault-kind": "nan,melt"})
