"""Message encodings (``uplink-encoding`` / ``downlink-encoding``, flower_app/wire/encoding.py):
each encoding against an independent implementation (torch's bfloat16, numpy's float16),
int8's per-row bound, its unbiasedness and its seeding, the bytes each saves, and the
refusals."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flwr.app import Message, MetricRecord, RecordDict
from flwr.supercore.task_identity import TaskIdentity

from flower_app.settings.config import ConfigError, resolve_config
from flower_app.wire.encoding import (
    ENCODINGS,
    GROUPED,
    decode_record,
    encode_record,
    encoding_rng,
    from_int8,
    to_int8,
)
from flower_app.wire.records import message_bytes, to_array_record

# a Message needs them outside a Flower app (as tests/runtime/test_flora.py)
TaskIdentity.run_id = 1
TaskIdentity.task_id = 1
TaskIdentity.node_id = 1

RNG = np.random.default_rng(0)
STATE = {
    "l.A": (RNG.standard_normal((4, 96)) * [[1e-3], [1.0], [30.0], [0.0]]).astype(np.float32),
    "head.bias": RNG.standard_normal(5).astype(np.float32),
}


def roundtrip(encoding: str, seed: int = 0) -> dict[str, np.ndarray]:
    record = encode_record(STATE, encoding, np.random.default_rng(seed))
    return {k: v.numpy() for k, v in decode_record(record, encoding).items()}


def test_the_setting_offers_the_modules_encodings():
    from flower_app.settings.config import schema

    for key in ("uplink-encoding", "downlink-encoding"):
        assert schema()[key].check.options == ENCODINGS and schema()[key].default == "fp32"


def test_fp32_is_the_record_as_always_and_decodes_to_itself():
    record = encode_record(STATE, "fp32")
    assert decode_record(record, "fp32") is record
    # only the run's own encoding is decoded: a float16 array in an fp32 run stays float16
    half = encode_record(STATE, "fp16")
    assert (
        decode_record(half, "fp32") is half
        and decode_record(half, "int8")["l.A"].dtype == "float16"
    )
    for key, value in STATE.items():
        assert np.array_equal(record[key].numpy(), value)


def test_bf16_and_fp16_round_as_torch_and_numpy_do():
    bf16, fp16 = roundtrip("bf16"), roundtrip("fp16")
    for key, value in STATE.items():
        expected = torch.from_numpy(value).to(torch.bfloat16).float().numpy()
        assert np.array_equal(bf16[key], expected) and bf16[key].dtype == np.float32
        assert np.array_equal(fp16[key], value.astype(np.float16).astype(np.float32))


def test_int8_is_within_one_level_of_each_rows_scale_and_keeps_zero_rows():
    decoded = roundtrip("int8")
    for key, value in STATE.items():
        rows = value.reshape(value.shape[0], -1) if value.ndim > 1 else value.reshape(1, -1)
        scale = np.abs(rows).max(axis=1, keepdims=True) / 127
        error = np.abs(decoded[key].reshape(rows.shape) - rows)
        assert np.all(error <= scale * (1 + 1e-6)), key
    assert np.array_equal(decoded["l.A"][3], np.zeros(96))  # the zero row stays zero
    # each row at its own scale: the 1e-3 row keeps its relative precision
    small = STATE["l.A"][0]
    assert np.abs(decoded["l.A"][0] - small).max() <= np.abs(small).max() / 127 * (1 + 1e-6)


def test_int8_rounding_is_unbiased_and_seeded():
    mean = np.mean([roundtrip("int8", seed)["l.A"] for seed in range(3000)], axis=0)
    scale = np.abs(STATE["l.A"]).max(axis=1, keepdims=True) / 127
    # the mean of n draws of a rounding error uniform within one level: sd <= scale / sqrt(4n)
    assert np.all(np.abs(mean - STATE["l.A"]) <= 5 * scale / np.sqrt(4 * 3000) + 1e-12)
    assert np.array_equal(roundtrip("int8", 7)["l.A"], roundtrip("int8", 7)["l.A"])
    assert not np.array_equal(roundtrip("int8", 7)["l.A"], roundtrip("int8", 8)["l.A"])
    down = [encoding_rng(3, 2, 0).random(4) for _ in range(2)]
    assert np.array_equal(*down)  # downlink: one stream for every node
    assert not np.array_equal(
        encoding_rng(3, 2, 1, 0).random(4), encoding_rng(3, 2, 1, 1).random(4)
    )


def test_the_encodings_cut_the_bytes_on_the_wire():
    big = {f"l{i}.A": RNG.standard_normal((16, 384)).astype(np.float32) for i in range(8)}

    def wire(encoding: str) -> int:
        record = encode_record(big, encoding, np.random.default_rng(0))
        return message_bytes(Message(RecordDict({"arrays": record}), 1, "train"))

    fp32 = wire("fp32")
    assert wire("bf16") == pytest.approx(fp32 / 2, rel=0.02)
    assert wire("fp16") == pytest.approx(fp32 / 2, rel=0.02)
    # a quarter, plus one float32 scale a row and a second array's framing per array
    assert fp32 / 4 < wire("int8") < 1.08 * fp32 / 4


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="unknown encoding"):
        encode_record(STATE, "int4")
    with pytest.raises(ValueError, match="rng"):
        encode_record(STATE, "int8")
    record = encode_record(STATE, "int8", np.random.default_rng(0))
    del record["l.A@int8-scale"]
    with pytest.raises(ValueError, match="without its scales"):
        decode_record(record, "int8")
    assert decode_record(to_array_record({}), "int8") is not None
    with pytest.raises(ConfigError, match="uplink-encoding"):
        resolve_config({"uplink-encoding": "int4"})


@pytest.mark.parametrize("method", ["fedex-lora", "flora"])
def test_a_method_that_folds_into_w0_keeps_its_downlink_exact(method):
    with pytest.raises(ConfigError, match="downlink-encoding.*fp32"):
        resolve_config({"method": method, "downlink-encoding": "bf16"})
    resolve_config({"method": method, "uplink-encoding": "int8"})  # its uplink may be lossy


# -- non-finite input, empty and 1-D arrays, bf16's NaNs ---------------------------------

LOSSY_ENCODINGS = ("bf16", "fp16", "int8")


@pytest.mark.parametrize("encoding", LOSSY_ENCODINGS)
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_a_lossy_encoding_refuses_a_non_finite_entry_naming_the_array(encoding, bad):
    """int8 would send a NaN row as levels in {-1, 0, 1} at scale 1 (a finite reply the
    server accepts); every lossy encoding refuses NaN and ±inf at the sender instead."""
    state = {**STATE, "l.A": STATE["l.A"].copy()}
    state["l.A"][2, 5] = bad
    with pytest.raises(ValueError, match=rf"'l\.A'.*{encoding}") as caught:
        encode_record(state, encoding, np.random.default_rng(0))
    assert type(caught.value).__name__ == "NonFiniteArray"
    # fp32 sends it as it is, for the server's reply checks to refuse
    assert np.array_equal(encode_record(state, "fp32")["l.A"].numpy(), state["l.A"], True)


def test_an_int8_reply_from_nan_is_a_failure_not_an_accepted_update():
    """At the strategy: a client whose update holds a NaN sends, under uplink-encoding
    int8, no finite update the server could accept. Its encode raises, which Flower returns
    to the server as an error reply (as ``run_clientapp`` does for any exception a
    ``@app.train()`` function raises), counted among the round's failures."""
    from flwr.app import Error
    from flwr.common.constant import ErrorCode

    from flower_app.wire.records import from_array_record
    from tests.harness.strategy_helpers import strategy_for

    prev = {"l.lora_A": np.zeros((2, 3)), "l.lora_B": np.zeros((3, 2))}
    strategy = strategy_for("fedit", prev, uplink_encoding="int8")
    instruction = Message(RecordDict(), dst_node_id=1, message_type="train")

    def client_reply(state: dict[str, np.ndarray], partition: int) -> Message:
        try:
            arrays = encode_record(state, "int8", encoding_rng(0, 1, 1, partition))
        except Exception as err:  # what Flower's ClientApp runner makes of a raise
            error = Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=str(err))
            return Message(error, reply_to=instruction)
        metrics = MetricRecord({"num-examples": 10, "train-loss": 1.0, "partition-id": partition})
        content = RecordDict({"arrays": arrays, "metrics": metrics})
        return Message(content=content, dst_node_id=1, message_type="train")

    good = {k: np.ones_like(v) for k, v in prev.items()}
    bad = {**good, "l.lora_A": np.full((2, 3), np.nan)}
    arrays, metrics = strategy.aggregate_train(1, [client_reply(good, 0), client_reply(bad, 1)])
    assert metrics["clients"] == 1 and metrics["failures"] == 1 and metrics["rejected"] == 0
    for key, value in from_array_record(arrays).items():
        np.testing.assert_allclose(value, good[key], rtol=1e-6)


SHAPES = [(0,), (0, 5), (5, 0), (7,), (3, 4), (2, 0, 3), (2, 3, 4)]


@pytest.mark.parametrize("encoding", ENCODINGS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_every_shape_round_trips_under_every_encoding(encoding, shape):
    """Empty and 1-D arrays too: float32 of the shape sent, int8 within one step of its
    row's scale (a 1-D array is one row); an empty array comes back empty."""
    x = np.random.default_rng(1).standard_normal(shape).astype(np.float32)
    record = encode_record({"x": x}, encoding, np.random.default_rng(0))
    y = decode_record(record, encoding)["x"].numpy()
    assert y.dtype == np.float32 and y.shape == shape
    if encoding == "int8":
        rows = x.reshape(shape[0], int(np.prod(shape[1:]))) if x.ndim > 1 else x.reshape(1, -1)
        scale = np.abs(rows).max(axis=1, keepdims=True, initial=0) / 127
        assert np.all(np.abs(y.reshape(rows.shape) - rows) <= scale * (1 + 1e-6))
        assert record["x@int8-scale"].numpy().shape == (rows.shape[0],)  # one scale a row
    elif encoding in GROUPED:  # within its group's scale: tests/runtime/test_encoding_groups.py
        step = np.abs(x).max(initial=0) / GROUPED[encoding][0] * (1 + 2**-7)
        assert np.all(np.abs(y - x) <= step * (1 + 1e-6))
    else:
        expected = x.astype(np.float16) if encoding == "fp16" else x
        np.testing.assert_allclose(y, expected, rtol=2**-8)


def test_a_0d_scalar_travels_as_one_entry_under_every_encoding():
    """A 0-d array travels as the 1-entry 1-D array ``to_array_record`` (fp32) has always
    made of it, under every encoding alike, so the reply checks see one shape whatever
    the run's encoding."""
    for encoding in ENCODINGS:
        record = encode_record({"s": np.float32(0.75)}, encoding, np.random.default_rng(0))
        y = decode_record(record, encoding)["s"].numpy()
        assert y.dtype == np.float32 and y.shape == (1,), encoding
        levels = 127 if encoding == "int8" else GROUPED.get(encoding, (0,))[0]
        assert abs(y[0] - 0.75) <= (0.75 / levels * (1 + 2**-7) if levels else 0), encoding


def old_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """The rounding of finite values the codec has always used: round to nearest even."""
    bits = x.view(np.uint32).astype(np.uint64)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def test_bf16_bits_keep_every_nan_a_nan_and_the_infinities():
    from flower_app.wire.encoding import from_bf16_bits, to_bf16_bits

    nans = np.array(
        [0x7FFFFFFF, 0xFFFFFFFF, 0x7F800001, 0xFF800001, 0x7FC00000, 0xFFC00000, 0x7F80FFFF,
         0x7FFF8000, 0x7FBFFFFF],
        dtype=np.uint32,
    )  # fmt: skip
    bits = to_bf16_bits(nans.view(np.float32))
    back = from_bf16_bits(bits)
    assert np.all(np.isnan(back)), [hex(b) for b in bits]
    assert np.array_equal(np.signbit(back), np.signbit(nans.view(np.float32)))
    assert np.all(bits & 0x0040)  # the quiet bit: no payload can round away
    infs = np.array([np.inf, -np.inf], dtype=np.float32)
    assert np.array_equal(from_bf16_bits(to_bf16_bits(infs)), infs)
    # finite values: round to nearest even as ever (ties, the largest finite, subnormals)
    rng = np.random.default_rng(2)
    finite = rng.integers(0, 2**32, 100_000, dtype=np.uint32).view(np.float32)
    finite = finite[np.isfinite(finite)]
    edge = np.array(
        [0x3F808000, 0x3F818000, 0x7F7FFFFF, 0xFF7FFFFF, 0x00000001, 0x80007FFF, 0, 0x80000000],
        dtype=np.uint32,
    ).view(np.float32)
    for x in (finite, edge, STATE["l.A"].ravel()):
        assert np.array_equal(to_bf16_bits(x), old_to_bf16_bits(x))
    assert np.array_equal(to_bf16_bits(finite), torch.from_numpy(finite).to(torch.bfloat16)
                          .view(torch.int16).numpy().view(np.uint16))  # fmt: skip


def test_int8_of_a_row_of_subnormals_stays_finite_and_warns_nothing():
    import warnings

    tiny = np.full((2, 3), np.float32(1e-44), dtype=np.float32)  # absmax / 127 underflows
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        q, scale = to_int8(tiny, np.random.default_rng(0))
    decoded = from_int8(q, scale)
    assert np.isfinite(scale).all() and (scale > 0).all()
    assert np.all(np.abs(decoded - tiny) <= scale.reshape(-1, 1))


@pytest.mark.parametrize("encoding", [e for e in ENCODINGS if e != "fp32"])
def test_a_decoded_array_reads_without_the_npy_round_trip_and_keeps_its_bytes(encoding):
    """The decoder's arrays hold their values: ``numpy()`` gives them (read-only, the same
    object each time, no np.load), the record keeps them as they are (no np.save), and their
    ``data``, made only when asked for, are the bytes ``Array(x)`` holds; the reply checks
    read them as they read a received float32 array."""
    from flwr.app import Array

    from flower_app.wire.encoding import DecodedArray
    from strategies.server.replies import check_array

    record = decode_record(encode_record(STATE, encoding, np.random.default_rng(0)), encoding)
    assert set(record) == set(STATE)
    for name, array in record.items():
        assert isinstance(array, DecodedArray)
        assert "data" not in array.__dict__  # nothing serialised yet
        value = array.numpy()
        assert value is array.numpy() and not value.flags.writeable
        assert value.dtype == np.float32 and value.shape == STATE[name].shape
        np.testing.assert_array_equal(check_array(name, array, STATE[name].shape), value)
        plain = Array(np.array(value))
        assert (array.dtype, tuple(array.shape), array.stype) == (
            plain.dtype, tuple(plain.shape), plain.stype,
        )  # fmt: skip
        assert "data" not in array.__dict__  # the checks did not serialise it
        assert array.data == plain.data
        np.testing.assert_array_equal(Array(array.dtype, tuple(array.shape), array.stype,
                                            array.data).numpy(), value)  # fmt: skip
