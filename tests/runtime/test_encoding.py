"""Message encodings (``uplink-encoding`` / ``downlink-encoding``, flower_app/encoding.py):
each encoding against an independent implementation (torch's bfloat16, numpy's float16),
int8's per-row bound, its unbiasedness and its seeding, the bytes each saves, and the
refusals."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flwr.app import Message, RecordDict
from flwr.supercore.task_identity import TaskIdentity

from flower_app.config import ConfigError, resolve_config
from flower_app.encoding import (
    ENCODINGS,
    decode_record,
    encode_record,
    encoding_rng,
)
from flower_app.records import message_bytes, to_array_record

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
    from flower_app.config import schema

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
