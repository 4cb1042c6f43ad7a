"""The bytes a round's messages take (``uplink-bytes``, ``downlink-bytes``): read from the
messages' contents as Flower serialises them, in total, per client and the largest, failed
replies included; against the serialised contents' lengths; the same whatever the random
node and run ids."""

from __future__ import annotations

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Error, Message, RecordDict
from flwr.common.serde import error_to_proto, message_to_proto, recorddict_to_proto
from flwr.supercore.task_identity import TaskIdentity

from flower_app.wire.records import message_bytes, record_params
from strategies.server.ledger import CommunicationLedger

# a Message needs them outside a Flower app (as tests/runtime/test_flora.py)
TaskIdentity.run_id = 1
TaskIdentity.task_id = 1
TaskIdentity.node_id = 1


def training_message(node: int, rows: int) -> Message:
    arrays = {f"l{i}.A": Array(np.ones((rows, 32), np.float32)) for i in range(3)}
    content = RecordDict({"arrays": ArrayRecord(arrays), "config": ConfigRecord({"r": 1})})
    return Message(content, dst_node_id=node, message_type="train")


def wire_length(message: Message) -> int:
    """The serialised content's length (a failed reply's: its error's)."""
    if message.has_error():
        return len(error_to_proto(message.error).SerializeToString())
    return len(recorddict_to_proto(message.content).SerializeToString())


def test_a_rounds_bytes_are_the_serialised_messages_lengths():
    sent = [training_message(node, rows) for node, rows in ((1, 2), (2, 4), (3, 8))]
    ledger = CommunicationLedger()
    ledger.record_sent(1, sent)
    replies = [training_message(9, 4), training_message(9, 2)]
    failed = Message(Error(code=0, reason="boom"), reply_to=sent[0])
    metrics = ledger.bytes_metrics(1, [*replies, failed])

    down = [wire_length(m) for m in sent]
    up = [wire_length(m) for m in [*replies, failed]]
    assert metrics["downlink-bytes"] == sum(down) and metrics["uplink-bytes"] == sum(up)
    assert metrics["downlink-bytes-per-client"] == np.mean(down)
    assert metrics["uplink-bytes-max"] == max(up) and metrics["downlink-bytes-max"] == max(down)
    # float32: 4 bytes an entry, plus a few hundred bytes of framing a message
    for message in sent:
        params = record_params(message.content)
        assert 4 * params < message_bytes(message) < 4 * params + 1_024


def test_a_round_with_nothing_sent_counts_zero():
    metrics = CommunicationLedger().bytes_metrics(3, [])
    assert metrics == {
        f"{d}-bytes{s}": 0.0 for d in ("downlink", "uplink") for s in ("", "-per-client", "-max")
    }


def test_the_bytes_do_not_depend_on_the_random_routing_ids():
    """Node ids are random 64-bit numbers, serialised as varints of 1 to 10 bytes: counting
    them would make a rerun's bytes differ. The content alone is counted; the whole message
    is a little larger (its metadata)."""
    small, large = training_message(3, 4), training_message(2**63 + 5, 4)
    assert len(message_to_proto(small).SerializeToString()) != len(
        message_to_proto(large).SerializeToString()
    )
    assert message_bytes(small) == message_bytes(large)
    assert message_bytes(small) < len(message_to_proto(small).SerializeToString())
