"""``message_bytes``: a message's content as Flower serialises it to protobuf (the size the
encoding tests compare), against the serialised contents' lengths, failed replies included;
the same whatever the random node and run ids. A round with nothing sent counts zero bytes
(the rows' ``uplink-bytes`` / ``downlink-bytes``: tests/runtime/test_wire_bytes.py)."""

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


def test_message_bytes_are_the_serialised_contents_lengths():
    sent = [training_message(node, rows) for node, rows in ((1, 2), (2, 4), (3, 8))]
    replies = [training_message(9, 4), training_message(9, 2)]
    failed = Message(Error(code=0, reason="boom"), reply_to=sent[0])
    for message in [*sent, *replies, failed]:
        assert message_bytes(message) == wire_length(message)
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
