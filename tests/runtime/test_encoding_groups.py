"""The grouped encodings ``int8-g`` / ``int4-g`` (flower_app/wire/encoding.py): every shape
round-trips within its group's scale, the rounding is unbiased and seeded, a malformed
packed buffer is refused, non-finite input is refused at the sender, the bytes on the wire
against fp32 for FLoRG- and LoRA-like states, and a FedIT round over an int4-g uplink."""

from __future__ import annotations

import json

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, Message, MetricRecord, RecordDict
from flwr.supercore.task_identity import TaskIdentity

from flower_app.wire.encoding import (
    ENCODINGS,
    GROUP,
    GROUPED,
    LOSSY,
    PACK_MAGIC,
    PACKED,
    NonFiniteArray,
    decode_record,
    encode_record,
    encoding_rng,
)
from flower_app.wire.records import from_array_record, message_bytes, to_array_record

# a Message needs them outside a Flower app (as tests/runtime/test_encoding.py)
TaskIdentity.run_id = 1
TaskIdentity.task_id = 1
TaskIdentity.node_id = 1

GROUPS = ("int8-g", "int4-g")
SHAPES = [(0,), (0, 5), (5, 0), (7,), (3, 4), (4, 1000), (1000, 4), (2, 3, 4)]
BF16_UP = 1 + 2**-7  # a scale rounded up to the next bfloat16: at most this much larger


def roundtrip(state: dict[str, np.ndarray], encoding: str, seed: int = 0) -> dict:
    record = encode_record(state, encoding, np.random.default_rng(seed))
    return from_array_record(decode_record(record, encoding))


def group_absmax(x: np.ndarray) -> np.ndarray:
    """Each entry's group's max |x|, computed here on its own: the array as its first axis
    by the rest (1-D: one row), groups of GROUP along the longer of the two axes."""
    m = x.reshape(x.shape[0], int(np.prod(x.shape[1:]))) if x.ndim > 1 else x.reshape(1, -1)
    down = m.shape[0] > m.shape[1]
    if down:
        m = m.T
    out = np.zeros_like(m)
    for j in range(0, m.shape[1], GROUP):
        out[:, j : j + GROUP] = np.abs(m[:, j : j + GROUP]).max(axis=1, keepdims=True)
    return (out.T if down else out).reshape(x.shape)


def test_the_grouped_encodings_are_offered_and_lossy():
    for encoding in GROUPS:
        assert encoding in ENCODINGS and encoding in LOSSY and encoding in GROUPED


@pytest.mark.parametrize("encoding", GROUPS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_every_shape_round_trips_within_its_groups_scale(encoding, shape):
    rng = np.random.default_rng(1)
    x = rng.standard_normal(shape).astype(np.float32)
    if x.size:  # groups of very different sizes: each keeps its own precision
        x.reshape(-1)[: x.size // 3] *= 1e-4
    record = encode_record({"x": x, "s": np.float32(0.75)}, encoding, np.random.default_rng(0))
    assert list(record.keys()) == [PACKED] and record[PACKED].dtype == "uint8"
    decoded = from_array_record(decode_record(record, encoding))
    assert list(decoded) == ["x", "s"]
    y = decoded["x"]
    assert y.dtype == np.float32 and y.shape == shape
    assert decoded["s"].shape == (1,)  # a 0-d array as fp32 sends it
    levels = GROUPED[encoding][0]
    bound = group_absmax(x) / levels * BF16_UP * (1 + 1e-6)
    assert np.all(np.abs(y - x) <= bound), np.abs(y - x).max()
    assert abs(decoded["s"][0] - 0.75) <= 0.75 / levels * BF16_UP


@pytest.mark.parametrize("encoding", GROUPS)
def test_a_zero_group_stays_zero_and_a_group_of_subnormals_stays_finite(encoding):
    x = np.zeros((3, 300), np.float32)
    x[1, :GROUP] = np.float32(1e-44)  # max / levels underflows float32
    x[2] = np.linspace(-1, 1, 300)
    y = roundtrip({"x": x}, encoding)["x"]
    assert not y[0].any() and not y[1, GROUP:].any()  # zero groups decode to exact zeros
    assert np.isfinite(y).all() and np.all(np.abs(y[1]) <= 1.0)


@pytest.mark.parametrize("encoding", GROUPS)
def test_the_rounding_is_unbiased_and_seeded(encoding):
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((3, 200)) * [[1e-3], [1.0], [30.0]]).astype(np.float32)
    n = 2000
    mean = np.mean([roundtrip({"x": x}, encoding, seed)["x"] for seed in range(n)], axis=0)
    scale = group_absmax(x) / GROUPED[encoding][0] * BF16_UP
    # the mean of n draws of an error within one step: sd <= scale / sqrt(4n)
    assert np.all(np.abs(mean - x) <= 5 * scale / np.sqrt(4 * n) + 1e-12)
    packed = [encode_record({"x": x}, encoding, np.random.default_rng(s))[PACKED] for s in (7, 7)]
    assert np.array_equal(packed[0].numpy(), packed[1].numpy())
    again = [roundtrip({"x": x}, encoding, seed)["x"] for seed in (7, 7, 8)]
    assert np.array_equal(again[0], again[1]) and not np.array_equal(again[0], again[2])


@pytest.mark.parametrize("encoding", GROUPS)
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_input_is_refused_at_the_sender(encoding, bad):
    x = np.ones((4, 300), np.float32)
    x[2, 5] = bad
    with pytest.raises(NonFiniteArray, match=rf"'l\.A'.*{encoding}"):
        encode_record({"head": np.ones(3), "l.A": x}, encoding, np.random.default_rng(0))
    with pytest.raises(ValueError, match="rng"):
        encode_record({"l.A": np.ones(3)}, encoding)


STATE = {
    "l.A": np.random.default_rng(4).standard_normal((4, 300)).astype(np.float32),
    "head.bias": np.arange(5, dtype=np.float32),
}


def packed(encoding: str = "int4-g") -> np.ndarray:
    return encode_record(STATE, encoding, np.random.default_rng(0))[PACKED].numpy()


def with_header(buffer: np.ndarray, header: bytes) -> np.ndarray:
    """``buffer`` with its header replaced (the rest as it was)."""
    size = int.from_bytes(buffer[4:8].tobytes(), "little")
    head = PACK_MAGIC + len(header).to_bytes(4, "little") + header
    return np.concatenate([np.frombuffer(head, np.uint8), buffer[8 + size :]])


def header_of(buffer: np.ndarray) -> dict:
    size = int.from_bytes(buffer[4:8].tobytes(), "little")
    return json.loads(buffer[8 : 8 + size].tobytes())


def malformed() -> dict[str, tuple[np.ndarray, str]]:
    good = packed()
    head = header_of(good)
    renamed = {**head, "arrays": [["l.A", [4, 300]], ["l.A", [5]]]}
    reshaped = {**head, "arrays": [["l.A", [4, 301]], ["head.bias", [5]]]}
    negative = {**head, "arrays": [["l.A", [4, -300]], ["head.bias", [5]]]}
    no_group = {k: v for k, v in head.items() if k != "group"}
    size = int.from_bytes(good[4:8].tobytes(), "little")
    zero_scale = good.copy()
    zero_scale[8 + size : 8 + size + 2] = 0  # the first scale: 0.0
    beyond = packed("int8-g")
    beyond[-1] = 0x80  # the last level: -128
    return {
        "truncated": (good[:-1], "truncated or mismatched"),
        "one byte more": (np.append(good, np.uint8(0)), "truncated or mismatched"),
        "empty": (good[:0], "not a packed"),
        "bad mark": (np.concatenate([np.frombuffer(b"XXXX", np.uint8), good[4:]]), "not a packed"),
        "header past the end": (good[:20], "truncated"),
        "not JSON": (with_header(good, b"{not json"), "malformed header"),
        "no group": (with_header(good, json.dumps(no_group).encode()), "malformed header"),
        "a name twice": (with_header(good, json.dumps(renamed).encode()), "twice"),
        "a shape that does not fit": (with_header(good, json.dumps(reshaped).encode()), "mismatch"),
        "a negative shape": (with_header(good, json.dumps(negative).encode()), "bad shape"),
        "a zero scale": (zero_scale, "scale"),
        "a level beyond 127": (beyond, "level beyond"),
    }


@pytest.mark.parametrize("case", list(malformed()))
def test_a_malformed_buffer_raises_a_clear_value_error(case):
    buffer, message = malformed()[case]
    encoding = "int8-g" if case == "a level beyond 127" else "int4-g"
    record = ArrayRecord(array_dict={PACKED: Array(buffer)})
    with pytest.raises(ValueError, match=message):
        decode_record(record, encoding)


def test_a_buffer_packed_under_the_other_grouped_encoding_is_refused():
    record = ArrayRecord(array_dict={PACKED: Array(packed("int8-g"))})
    with pytest.raises(ValueError, match="packed under 'int8-g'"):
        decode_record(record, "int4-g")


def test_the_server_leaves_a_malformed_reply_as_it_came_and_takes_a_float32_one():
    """``decode_reply`` turns a ValueError into "left as it came" (the reply checks then
    refuse it); a float32 reply (a fault injected after the encoding) is taken as it is."""
    from strategies.server.encoded_messages import decode_reply

    record = ArrayRecord(array_dict={PACKED: Array(packed()[:-3])})
    reply = Message(RecordDict({"arrays": record}), dst_node_id=1, message_type="train")
    decode_reply(reply, "int4-g")
    assert list(reply.content["arrays"].keys()) == [PACKED]
    plain = to_array_record(STATE)
    assert decode_record(plain, "int4-g") is plain


def test_the_downlink_decodes_alike_on_every_node():
    from strategies.server.encoded_messages import encode_downlink

    messages = [
        Message(RecordDict({"arrays": to_array_record(STATE)}), dst_node_id=n, message_type="train")
        for n in (1, 2)
    ]
    assert encode_downlink(messages, "int8-g", seed=3, server_round=2)
    got = [from_array_record(decode_record(m.content["arrays"], "int8-g")) for m in messages]
    for key, value in STATE.items():
        assert np.array_equal(got[0][key], got[1][key]) and got[0][key].shape == value.shape


# -- the bytes on the wire -----------------------------------------------------------------

LAYERS = 24


def florg_state() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(5)
    state = {
        f"roberta.encoder.layer.{i // 2}.attention.self.{('query', 'value')[i % 2]}.A": (
            rng.standard_normal((4, 384)).astype(np.float32) * 0.02
        )
        for i in range(LAYERS)
    }
    state["classifier.out_proj.weight"] = rng.standard_normal((2, 384)).astype(np.float32)
    state["classifier.out_proj.bias"] = rng.standard_normal(2).astype(np.float32)
    return state


def lora_state() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(6)
    state = {}
    for i in range(LAYERS):
        name = f"roberta.encoder.layer.{i // 2}.attention.self.{('query', 'value')[i % 2]}"
        state[f"{name}.lora_A"] = rng.standard_normal((4, 384)).astype(np.float32) * 0.02
        state[f"{name}.lora_B"] = rng.standard_normal((384, 4)).astype(np.float32) * 1e-3
    return state


def wire_bytes(state: dict[str, np.ndarray], encoding: str) -> int:
    record = encode_record(state, encoding, np.random.default_rng(0))
    return message_bytes(Message(RecordDict({"arrays": record}), 1, "train"))


@pytest.mark.parametrize("shape", ["florg", "lora"])
def test_the_grouped_encodings_cut_the_bytes_below_a_quarter_and_an_eighth(shape):
    """``pytest -s tests/runtime/test_encoding_groups.py -k bytes`` prints the ratios."""
    state = florg_state() if shape == "florg" else lora_state()
    fp32 = wire_bytes(state, "fp32")
    ratios = {e: wire_bytes(state, e) / fp32 for e in ("int8", "int8-g", "int4-g")}
    print(f"{shape}: fp32 {fp32} bytes; " + ", ".join(f"{e} {r:.4f}" for e, r in ratios.items()))
    assert ratios["int8-g"] <= 0.27, f"{shape}: int8-g is {ratios['int8-g']:.4f} of fp32"
    assert ratios["int4-g"] <= 0.15, f"{shape}: int4-g is {ratios['int4-g']:.4f} of fp32"
    assert ratios["int8-g"] < ratios["int8"], f"{shape}: {ratios}"


# -- a strategy's round over an int4-g uplink ----------------------------------------------


def test_a_fedit_strategy_decodes_and_aggregates_an_int4_g_uplink():
    from tests.harness.strategy_helpers import strategy_for

    prev = {"l.lora_A": np.zeros((2, 300)), "l.lora_B": np.zeros((300, 2))}
    strategy = strategy_for("fedit", prev, uplink_encoding="int4-g")
    rng = np.random.default_rng(7)
    states = [
        {k: rng.standard_normal(v.shape).astype(np.float32) for k, v in prev.items()}
        for _ in range(2)
    ]

    def client_reply(arrays: ArrayRecord, partition: int) -> Message:
        metrics = MetricRecord({"num-examples": 10, "train-loss": 1.0, "partition-id": partition})
        content = RecordDict({"arrays": arrays, "metrics": metrics})
        return Message(content=content, dst_node_id=1, message_type="train")

    sent = [encode_record(s, "int4-g", encoding_rng(0, 1, 1, p)) for p, s in enumerate(states)]
    decoded = [from_array_record(decode_record(r, "int4-g")) for r in sent]
    truncated = ArrayRecord(array_dict={PACKED: Array(sent[0][PACKED].numpy()[:-1])})
    replies = [client_reply(r, p) for p, r in enumerate(sent)] + [client_reply(truncated, 2)]
    arrays, metrics = strategy.aggregate_train(1, replies)
    assert metrics["clients"] == 2 and metrics["failures"] == 0 and metrics["rejected"] == 1
    for key, value in from_array_record(arrays).items():
        expected = (decoded[0][key] + decoded[1][key]) / 2  # FedIT: the mean of each factor
        np.testing.assert_allclose(value, expected, rtol=1e-5, atol=1e-6)
        step = max(np.abs(s[key]).max() for s in states) / 7 * BF16_UP
        assert np.abs(value - (states[0][key] + states[1][key]) / 2).max() <= step
