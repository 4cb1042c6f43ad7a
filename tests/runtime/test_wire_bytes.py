"""The bytes a message takes in a deployment (``wire_bytes``), against Flower's own deflation
of the message into its object tree: every distinct object's deflated length, summed. Exact
where the metadata's ids take their widest varints (the count's convention), at most
``MAX_ABOVE_FLOWER`` above otherwise; found without deflating, serialising or hashing an
array; and the count the metrics rows carry."""

from __future__ import annotations

import time

import flwr.app.message.array as flwr_array
import numpy as np
import pytest
from flwr.app import (
    Array,
    ArrayRecord,
    ConfigRecord,
    Error,
    Message,
    Metadata,
    MetricRecord,
    RecordDict,
)
from flwr.app.message.arraychunk import ArrayChunk
from flwr.supercore.inflatable import inflatable_object
from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects

from flower_app.wire.deployment_bytes import (
    MAX_ABOVE_FLOWER,
    WIDEST_ID,
    wire_bytes,
    wire_bytes_each,
)
from flower_app.wire.encoding import encode_record
from flower_app.wire.records import to_array_record
from strategies.server.ledger import CommunicationLedger, traffic_metrics


def deflated(message: Message) -> int:
    """Flower's own: each distinct object of the message's tree, deflated (post-order, by
    object id, as a push sends them once each)."""
    return sum(len(obj.deflate()) for obj in get_all_nested_objects(message).values())


def metadata(ids: int = WIDEST_ID, reply_to: str = "", group: str = "3") -> Metadata:
    return Metadata(
        run_id=ids, message_id="", src_node_id=ids, dst_node_id=ids,
        reply_to_message_id=reply_to, group_id=group, created_at=time.time(), ttl=3600.0,
        message_type="train", src_task_id=ids, dst_task_id=ids,
    )  # fmt: skip


def instruction(content: RecordDict, ids: int = WIDEST_ID) -> Message:
    return Message(metadata=metadata(ids), content=content)


def reply(content: RecordDict | None = None, error: Error | None = None) -> Message:
    meta = metadata(reply_to="f" * 64)  # a deployment's message id: the object id, 64 hex
    if error is not None:
        return Message(metadata=meta, error=error)
    return Message(metadata=meta, content=content)


def state(seed: int = 0, layers: int = 4, zero_b: bool = False) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out: dict[str, np.ndarray] = {}
    for i in range(layers):
        out[f"model.layers.{i}.q_proj.lora_A"] = rng.standard_normal((4, 48)).astype(np.float32)
        b = np.zeros((40, 4)) if zero_b else rng.standard_normal((40, 4))
        out[f"model.layers.{i}.q_proj.lora_B"] = b.astype(np.float32)
    out["classifier.weight"] = rng.standard_normal((3, 48)).astype(np.float32)
    return out


CONFIG = ConfigRecord({"server-round": 3, "lr": 5e-5, "lineage": "fedit", "flag": True})
METRICS = MetricRecord({"num-examples": 256, "train-loss": 1.25, "steps": [1, 2, 3]})


@pytest.mark.parametrize("encoding", ["fp32", "bf16", "fp16", "int8", "int8-g", "int4-g"])
def test_every_encoding_counts_what_flower_deflates(encoding):
    rng = np.random.default_rng(1)
    sent = instruction(RecordDict({"arrays": encode_record(state(), encoding, rng)}))
    sent.content["config"] = CONFIG
    back = reply(RecordDict({"arrays": encode_record(state(2), encoding, rng), "m": METRICS}))
    for message in (sent, back):
        assert wire_bytes(message) == deflated(message), encoding


def test_a_failed_reply_and_contents_without_arrays():
    failed = reply(error=Error(code=3, reason="client failed: out of memory"))
    silent = reply(error=Error(code=0))
    config_only = instruction(RecordDict({"config": CONFIG}))
    empty = instruction(RecordDict())
    empty_record = instruction(RecordDict({"arrays": ArrayRecord(), "metrics": MetricRecord()}))
    for message in (failed, silent, config_only, empty, empty_record):
        assert wire_bytes(message) == deflated(message)


def test_names_json_escapes():
    """Record and array names go into the objects as JSON (ASCII, escaped)."""
    odd = ["ä.lora_A", 'q"uote', "back\\slash", "tab\tname", "del\x7f", "~ plain"]
    arrays = {name: Array(np.full(3, i, np.float32)) for i, name in enumerate(odd)}
    content = RecordDict({"größe": ArrayRecord(arrays), 'c"fg': CONFIG})
    message = instruction(content)
    assert wire_bytes(message) == deflated(message)


def test_equal_arrays_and_records_travel_once():
    """FedIT's round 1: every B is zero, one Array object for all of them; an array under
    two names, equal arrays built apart, a record and a config under two names."""
    zero = state(zero_b=True)
    record = to_array_record(zero)
    once = instruction(RecordDict({"arrays": record, "config": CONFIG}))
    assert wire_bytes(once) == deflated(once)
    one_object = instruction(RecordDict({"arrays": record, "again": record, "c": CONFIG}))
    assert wire_bytes(one_object) == deflated(one_object)
    twice = instruction(RecordDict({"arrays": record, "again": record, "c1": CONFIG}))
    twice.content["c2"] = ConfigRecord(dict(CONFIG))
    twice.content["copy"] = to_array_record(zero)  # equal, built apart
    assert wire_bytes(twice) == deflated(twice)
    one = Array(np.arange(12, dtype=np.float32))
    shared = ArrayRecord({"x": one, "y": one, "z": Array(np.arange(12, dtype=np.float32))})
    overlap = ArrayRecord({"z": one, "w": Array(np.ones(5, np.float32))})
    message = instruction(RecordDict({"a": shared, "b": overlap}))
    assert wire_bytes(message) == deflated(message)
    # zero B arrays cost one Array and one chunk in all: far fewer bytes than fp32 of them
    nonzero = instruction(RecordDict({"arrays": to_array_record(state()), "config": CONFIG}))
    assert wire_bytes(once) < 0.8 * wire_bytes(nonzero)


def test_one_chunk_under_different_arrays():
    """Arrays whose bytes are equal but whose dtype or shape differ: two Array objects,
    one ArrayChunk (raw bytes, as an Array built from its fields)."""
    data = np.arange(16, dtype=np.float32).tobytes()
    record = ArrayRecord(
        {
            "f": Array(dtype="float32", shape=(16,), stype="raw", data=data),
            "g": Array(dtype="float32", shape=(4, 4), stype="raw", data=data),
            "h": Array(dtype="int32", shape=(16,), stype="raw", data=data),
            "empty": Array(dtype="float32", shape=(0,), stype="raw", data=b""),
        }
    )
    message = instruction(RecordDict({"arrays": record}))
    assert wire_bytes(message) == deflated(message)
    listed = Array(dtype="int8", shape=(8, 8), stype="raw", data=data[::-1])
    listed.shape = [8, 8]  # a shape set as a list afterwards: JSON writes it alike
    message = instruction(RecordDict({"arrays": ArrayRecord({"listed": listed})}))
    assert wire_bytes(message) == deflated(message)


def test_arrays_over_one_chunk(monkeypatch):
    """Flower slices an Array's bytes into 5 MiB chunks; repeated chunks (zeros) are one
    object under the Array, which lists each chunk's index among its distinct ones."""
    big = np.zeros(1_500_000, np.float32)  # 6 MB: two chunks, the first all zero
    big[-1000:] = np.random.default_rng(0).standard_normal(1000)
    message = instruction(RecordDict({"arrays": ArrayRecord({"big": Array(big)})}))
    assert wire_bytes(message) == deflated(message)

    monkeypatch.setattr(flwr_array, "FLWR_PRIVATE_MAX_ARRAY_CHUNK_SIZE", 1024)
    rng = np.random.default_rng(3)
    patterned = np.concatenate([np.zeros(1024), rng.standard_normal(512), np.zeros(2048)])
    arrays = {
        "patterned": Array(patterned.astype(np.float32)),
        "zeros": Array(np.zeros(3000, np.float32)),  # shares the zero chunks
        "zeros-other-shape": Array(np.zeros((30, 100), np.float32)),
        "random": Array(rng.standard_normal(5000).astype(np.float32)),
        "exact": Array(dtype="uint8", shape=(2048,), stype="raw", data=bytes(2048)),
    }
    for encoding in ("int8", "int8-g", "int4-g"):
        arrays[encoding] = encode_record(state(4, layers=20), encoding, rng)
    records = {k: v for k, v in arrays.items() if isinstance(v, ArrayRecord)}
    plain = ArrayRecord({k: v for k, v in arrays.items() if isinstance(v, Array)})
    message = reply(RecordDict({"arrays": plain, **records, "metrics": METRICS}))
    assert wire_bytes(message) == deflated(message)


def test_the_ids_a_run_draws_change_nothing_and_at_most_the_stated_margin():
    """Node, run and task ids are random 64-bit numbers, varints of 1 to 10 bytes (absent at
    0): the count takes each at its widest, so a rerun counts the same bytes."""
    content = RecordDict({"arrays": to_array_record(state()), "config": CONFIG})
    counts = set()
    for ids in (0, 1, 300, 2**40 + 7, 2**63 + 5, WIDEST_ID):
        message = instruction(content, ids)
        counts.add(wire_bytes(message))
        assert 0 <= wire_bytes(message) - deflated(message) <= MAX_ABOVE_FLOWER, ids
    assert len(counts) == 1


def test_nothing_is_deflated_serialised_or_hashed(monkeypatch):
    """The count reads the arrays' lengths and last bytes: Flower's deflation of an Array
    or a chunk, the object ids (sha256) and numpy's decoding are never called."""
    message = reply(RecordDict({"arrays": to_array_record(state()), "metrics": METRICS}))
    expected = deflated(message)

    def refuse(*_args, **_kwargs):
        raise AssertionError("the count serialised or hashed an array")

    for target, name in (
        (Array, "deflate"), (ArrayChunk, "deflate"), (Array, "numpy"),
        (ArrayRecord, "deflate"), (RecordDict, "deflate"), (Message, "deflate"),
    ):  # fmt: skip
        monkeypatch.setattr(target, name, refuse)
    monkeypatch.setattr(inflatable_object, "get_object_id", refuse)
    assert wire_bytes(message) == expected


def test_a_rounds_messages_counted_together_count_each_in_full():
    """A round's training messages share the encoded global record: counted together it is
    looked at once, and each message still counts all of it."""
    record = to_array_record(state())
    sent = [
        instruction(RecordDict({"arrays": record, "config": ConfigRecord({"server-round": t})}))
        for t in (1, 10, 100)
    ]
    assert wire_bytes_each(sent) == [wire_bytes(m) for m in sent] == [deflated(m) for m in sent]


def test_the_metrics_rows_carry_the_count():
    sent = [instruction(RecordDict({"arrays": to_array_record(state(s)), "c": CONFIG}))
            for s in range(3)]  # fmt: skip
    replies = [
        reply(RecordDict({"arrays": to_array_record(state(9)), "metrics": METRICS})),
        reply(error=Error(code=0, reason="boom")),
    ]
    ledger = CommunicationLedger()
    ledger.record_sent(1, sent)
    metrics = ledger.bytes_metrics(1, replies)
    down, up = [deflated(m) for m in sent], [deflated(m) for m in replies]
    assert metrics["downlink-bytes"] == sum(down) and metrics["uplink-bytes"] == sum(up)
    assert metrics["downlink-bytes-per-client"] == np.mean(down)
    assert metrics["uplink-bytes-max"] == max(up)
    assert traffic_metrics(down, wire_bytes_each(replies)) == metrics
