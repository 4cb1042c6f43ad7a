"""Issue 15, item 3: every reply is checked; a bad one is rejected with a clear log line and
never aggregated, and no reply can crash the server.

``BAD_INPUTS`` is the table of docs/faults.md ("Bad replies"): each case is one good client
plus one client sending the bad input, on hand-built Flower messages through the real
strategies' ``aggregate_train``.
"""

from __future__ import annotations

import io
import logging
from collections.abc import Callable

import numpy as np
import pytest
from flwr.app import (
    Array,
    ArrayRecord,
    ConfigRecord,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)
from flwr.supercore.task_identity import TaskIdentity

from flower_app.wire.records import from_array_record, to_array_record
from strategies.florg.rule import aggregate_florg
from tests.harness.strategy_helpers import strategy_for

TaskIdentity.run_id = 1
TaskIdentity.task_id = 1
TaskIdentity.node_id = 1

FINGERPRINT = 0xABC
rng = np.random.default_rng(0)
PREV = {"enc.q.A": rng.standard_normal((2, 6)), "classifier.weight": rng.standard_normal((3, 6))}


def good_state() -> dict[str, np.ndarray]:
    return {k: v + 0.05 * rng.standard_normal(v.shape) for k, v in PREV.items()}


def good_metrics() -> dict:
    return {"num-examples": 10, "train-loss": 1.0, "partition-id": 0, "lr-fingerprint": FINGERPRINT}


def npy(value: np.ndarray, allow_pickle: bool = False) -> bytes:
    buf = io.BytesIO()
    np.save(buf, value, allow_pickle=allow_pickle)
    return buf.getvalue()


def message(arrays: ArrayRecord | None, metrics: dict | None, **extra) -> Message:
    records: dict = {}
    if arrays is not None:
        records["arrays"] = arrays
    if metrics is not None:
        records["metrics"] = MetricRecord(metrics)
    records.update(extra)
    return Message(content=RecordDict(records), dst_node_id=1, message_type=MessageType.TRAIN)


def with_array(key: str, array: Array) -> Message:
    record = to_array_record(good_state())
    record[key] = array
    return message(record, good_metrics())


def with_value(key: str, value: np.ndarray) -> Message:
    return with_array(key, Array(np.asarray(value)))


def with_metric(key: str, value) -> Message:
    metrics = good_metrics()
    if value is None:
        metrics.pop(key)
    else:
        metrics[key] = value
    return message(to_array_record(good_state()), metrics)


def without_key(key: str) -> Message:
    state = good_state()
    state.pop(key)
    return message(to_array_record(state), good_metrics())


A = "enc.q.A"
BIG = np.zeros((400, 400), np.float32)

# (case id, what the bad client sends, a fragment of the logged reason)
BAD_INPUTS: list[tuple[str, Callable[[], Message], str]] = [
    ("no arrays record", lambda: message(None, good_metrics()), "lacks the 'arrays'"),
    ("no metrics record", lambda: message(to_array_record(good_state()), None), "lacks"),
    (
        "an extra record",
        lambda: message(
            to_array_record(good_state()), good_metrics(), junk=ArrayRecord({"x": Array(BIG)})
        ),
        "unexpected records ['junk']",
    ),
    (
        "an extra config record",
        lambda: message(to_array_record(good_state()), good_metrics(), cfg=ConfigRecord({"a": 1})),
        "unexpected records ['cfg']",
    ),
    ("a missing key", lambda: without_key("classifier.weight"), "missing ['classifier.weight']"),
    ("an extra key", lambda: with_value("enc.k.A", np.zeros((2, 6))), "unexpected ['enc.k.A']"),
    ("float16", lambda: with_value(A, PREV[A].astype(np.float16)), "dtype float16"),
    ("int16", lambda: with_value(A, np.zeros((2, 6), np.int16)), "dtype int16"),
    ("int64", lambda: with_value(A, np.zeros((2, 6), np.int64)), "dtype int64"),
    ("bool", lambda: with_value(A, np.zeros((2, 6), bool)), "dtype bool"),
    ("complex64", lambda: with_value(A, np.zeros((2, 6), np.complex64)), "dtype complex64"),
    ("a 0-d array", lambda: with_value(A, np.float32(1.0)), "0-d array, expected 2-d"),
    ("a 1-d array", lambda: with_value(A, np.zeros(12, np.float32)), "1-d array, expected 2-d"),
    ("a 3-d array", lambda: with_value(A, np.zeros((1, 2, 6), np.float32)), "3-d array"),
    ("a wrong shape", lambda: with_value(A, np.zeros((2, 5), np.float32)), "shape (2, 5)"),
    ("a transposed A", lambda: with_value(A, np.zeros((6, 2), np.float32)), "shape (6, 2)"),
    (
        "oversized data under a small declared shape",
        lambda: with_array(A, Array("float32", (2, 6), "numpy.ndarray", npy(BIG))),
        "bytes, more than",
    ),
    (
        "a declared shape that lies",
        lambda: with_array(A, Array("float32", (2, 6), "numpy.ndarray", npy(np.zeros((3, 4))))),
        "shape (3, 4)",
    ),
    (
        "a pickled object array",
        lambda: with_array(
            A,
            Array("float32", (2, 6), "numpy.ndarray", npy(np.array([{}], object), True)),
        ),
        "cannot be read as a numeric array",
    ),
    (
        "bytes that are not .npy",
        lambda: with_array(A, Array("float32", (2, 6), "numpy.ndarray", b"\x00" * 64)),
        "cannot be read",
    ),
    (
        "a non-numpy stype",
        lambda: with_array(A, Array("float32", (2, 6), "torch.Tensor", npy(PREV[A]))),
        "cannot be read",
    ),
    ("NaN", lambda: with_value(A, np.full((2, 6), np.nan)), "contains NaN/Inf"),
    ("+Inf", lambda: with_value(A, np.full((2, 6), np.inf)), "contains NaN/Inf"),
    ("-Inf in the head", lambda: with_value("classifier.weight", -np.full((3, 6), np.inf)), "NaN"),
    (
        "num-examples missing",
        lambda: with_metric("num-examples", None),
        "'num-examples' is missing",
    ),
    ("num-examples 0", lambda: with_metric("num-examples", 0), "num-examples must be > 0"),
    ("num-examples -5", lambda: with_metric("num-examples", -5), "num-examples must be > 0"),
    ("num-examples NaN", lambda: with_metric("num-examples", float("nan")), "must be finite"),
    ("num-examples +Inf", lambda: with_metric("num-examples", float("inf")), "must be finite"),
    ("num-examples a list", lambda: with_metric("num-examples", [1.0, 2.0]), "must be a number"),
    ("partition-id NaN", lambda: with_metric("partition-id", float("nan")), "must be finite"),
    ("partition-id 1.5", lambda: with_metric("partition-id", 1.5), "integer >= 0"),
    ("partition-id -3", lambda: with_metric("partition-id", -3), "integer >= 0"),
    ("partition-id a list", lambda: with_metric("partition-id", [1, 2]), "must be a number"),
    ("train-loss NaN", lambda: with_metric("train-loss", float("nan")), "must be finite"),
    ("no L/R fingerprint", lambda: with_metric("lr-fingerprint", None), "no L/R fingerprint"),
    ("another L/R fingerprint", lambda: with_metric("lr-fingerprint", 0xDEF), "!= server's"),
    ("L/R fingerprint NaN", lambda: with_metric("lr-fingerprint", float("nan")), "finite"),
]


@pytest.mark.parametrize(
    "make_bad,reason", [c[1:] for c in BAD_INPUTS], ids=[c[0] for c in BAD_INPUTS]
)
def test_bad_reply_is_rejected_with_a_clear_log_line(make_bad, reason, caplog):
    strategy = strategy_for("florg", PREV, fingerprint=FINGERPRINT)
    good = good_state()
    ok = message(to_array_record(good), good_metrics())
    with caplog.at_level(logging.WARNING, logger="flwr.florg"):
        arrays, metrics = strategy.aggregate_train(1, [make_bad(), ok])
    assert metrics["rejected"] == 1 and metrics["clients"] == 1
    line = next(r.getMessage() for r in caplog.records if "rejected update" in r.getMessage())
    assert reason in line, line
    expected, _ = aggregate_florg([good[A].astype(np.float32)], None, PREV[A])
    np.testing.assert_allclose(from_array_record(arrays)[A], expected, rtol=1e-6)


def test_float64_arrays_are_accepted():
    strategy = strategy_for("florg", PREV, fingerprint=FINGERPRINT)
    record = ArrayRecord({k: Array(np.asarray(v, np.float64)) for k, v in good_state().items()})
    _, metrics = strategy.aggregate_train(1, [message(record, good_metrics())])
    assert metrics["rejected"] == 0 and metrics["clients"] == 1


@pytest.mark.parametrize("value", [float("nan"), [3.0], 1e300])
def test_fedex_residual_round_garbage_does_not_crash_the_server(value):
    state = {"l.lora_A": np.zeros((1, 2)), "l.lora_B": np.zeros((2, 1))}
    strategy = strategy_for("fedex-lora", state)
    metrics = {"num-examples": 5, "train-loss": 1.0, "partition-id": 0}
    client = {"l.lora_A": np.ones((1, 2)), "l.lora_B": np.ones((2, 1))}
    bad = message(to_array_record(client), {**metrics, "residual-round": value})
    good = message(to_array_record(client), {**metrics, "partition-id": 1})
    _, out = strategy.aggregate_train(1, [bad, good])
    assert out["clients"] == 2


def test_a_reply_with_a_nan_partition_id_cannot_crash_the_ledger():
    strategy = strategy_for("fedit", {"l.lora_A": np.zeros((1, 2)), "l.lora_B": np.zeros((2, 1))})
    client = {"l.lora_A": np.ones((1, 2)), "l.lora_B": np.ones((2, 1))}
    bad = message(to_array_record(client), {"num-examples": 5, "partition-id": float("nan")})
    _, out = strategy.aggregate_train(1, [bad])
    assert out["rejected"] == 1
