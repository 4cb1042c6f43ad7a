"""Error feedback for a lossy uplink (``uplink-error-feedback``,
flower_app/client/error_feedback.py): the residual is exactly what the encoding left out of
what the server decodes; over many rounds the decoded updates sum to the true ones within
one rounding, where bf16's bias alone grows every round; fp32 refuses the setting; the
residual survives a fresh context through the node's disk, is dropped on a shape change,
kept on a failed encode and kept for the arrays a round does not send; the ClientApp's
reply with the setting off is the plain encoding's, bit for bit; and a tiny FedIT run
under int4-g completes with it."""

from __future__ import annotations

import json
import logging
import time
from types import SimpleNamespace

import numpy as np
import pytest
from flwr.app import ConfigRecord, Context, Message, Metadata, RecordDict

from flower_app.cache.per_process import cached_adapted_model
from flower_app.client.error_feedback import (
    RECORD,
    encode_with_feedback,
    feedback_step,
    load_residual,
    residual_dir,
    save_residual,
)
from flower_app.client.node_state import NODE_STATE_ENV, persisted_rounds
from flower_app.methods.registry import get_method
from flower_app.settings.config import ConfigError, resolve_config
from flower_app.wire.encoding import (
    LOSSY,
    UP,
    NonFiniteArray,
    decode_record,
    encode_record,
    encoding_rng,
    from_bf16_bits,
    to_bf16_bits,
)
from flower_app.wire.records import from_array_record, to_array_record

LINEAGE = "0123456789abcdef" * 2
RNG = np.random.default_rng(0)


def _f32(shape: tuple[int, ...], scale: float = 1.0) -> np.ndarray:
    return (RNG.standard_normal(shape) * scale).astype(np.float32)


def _message(arrays: dict, server_round: int, lineage: str | None = LINEAGE) -> Message:
    """A training message as a SuperNode hands it to the ClientApp."""
    config = {"server-round": server_round} | ({"lineage": lineage} if lineage else {})
    content = RecordDict({"arrays": to_array_record(arrays), "config": ConfigRecord(config)})
    metadata = Metadata(
        run_id=1, message_id="m1", src_node_id=0, dst_node_id=1, reply_to_message_id="",
        group_id=str(server_round), created_at=time.time(), ttl=600.0, message_type="train",
    )  # fmt: skip
    return Message(content=content, metadata=metadata)


def _context(run_config: dict | None = None) -> Context:
    return Context(
        run_id=1, node_id=1, node_config={"partition-id": 0, "num-partitions": 2},
        state=RecordDict(), run_config=dict(run_config or {}),
    )  # fmt: skip


def _bytes(record) -> dict[str, tuple[str, tuple, bytes]]:
    return {k: (a.dtype, tuple(a.shape), a.data) for k, a in record.items()}


# -- the step ---------------------------------------------------------------------------


@pytest.mark.parametrize("encoding", LOSSY)
def test_the_residual_is_exactly_what_the_server_decoding_left_out(encoding):
    """decode(sent) + e_new = x + e_old (x_recv cancels), with decode the server's own
    (strategies/server/encoded_messages.py); the residual's float32 rounding the only gap."""
    from strategies.server.encoded_messages import decode_reply

    received = {"l.lora_A": _f32((4, 300)), "l.lora_B": _f32((300, 4), 0.1), "head": _f32((3,))}
    trained = {k: v + _f32(v.shape, 1e-2) for k, v in received.items()}
    residual = {k: _f32(v.shape, 1e-3) for k, v in received.items()}
    record, left_out = feedback_step(trained, received, residual, encoding, encoding_rng(0, 3, UP))
    reply = Message(content=RecordDict({"arrays": record}), reply_to=_message({}, 3))
    decode_reply(reply, encoding)
    server = from_array_record(reply.content["arrays"])
    assert set(left_out) == set(trained)
    for name, x in trained.items():
        assert left_out[name].dtype == np.float32 and left_out[name].shape == x.shape
        want = x.astype(np.float64) + residual[name]
        got = server[name].astype(np.float64) + left_out[name]
        gap = 2.0**-23 * np.abs(left_out[name]).max() + 1e-12
        np.testing.assert_allclose(got, want, rtol=0, atol=gap, err_msg=name)
        assert np.abs(left_out[name]).max() > 0  # a lossy encoding leaves something out


@pytest.mark.parametrize("encoding", LOSSY)
def test_with_no_residual_the_record_is_the_plain_encodings_bit_for_bit(encoding):
    """x_recv + (x - x_recv) is x again in float64: a node's first reply is unchanged."""
    received = {"l.A": _f32((4, 200)), "head": _f32((2,))}
    trained = {k: v + _f32(v.shape, 1e-2) for k, v in received.items()}
    record, _ = feedback_step(trained, received, {}, encoding, encoding_rng(0, 1, UP, 2))
    plain = encode_record(trained, encoding, encoding_rng(0, 1, UP, 2))
    assert _bytes(record) == _bytes(plain)


def _bf16(x: np.ndarray) -> np.ndarray:
    return from_bf16_bits(to_bf16_bits(np.ascontiguousarray(x, np.float32)))


def _run_rounds(encoding: str, feedback: bool, rounds: int = 300):
    """(the sum of the updates the server decoded minus the true sum, the bound of one
    rounding): a client sending the same update d every round from a global model that
    moves (a random walk, held in bfloat16 as a bf16 downlink would hold it)."""
    rng = np.random.default_rng(1)
    shape = (8, 256)
    d = (rng.choice([-1.0, 1.0], shape) * 1e-3).astype(np.float32)  # below bf16's half step
    glob = rng.uniform(1.2, 1.7, shape).astype(np.float32)
    residual: dict[str, np.ndarray] = {}
    total = np.zeros(shape)
    largest = 0.0
    for t in range(1, rounds + 1):
        glob = _bf16(np.clip(glob + rng.normal(0, 0.01, shape), 1.0, 1.9))  # one binade
        received, trained = {"w": glob}, {"w": glob + d}
        urng = encoding_rng(0, t, UP)
        if feedback:
            record, new = feedback_step(trained, received, residual, encoding, urng)
            residual |= new
            largest = max(largest, float(np.abs(glob + d + residual["w"]).max()))
        else:
            record = encode_record(trained, encoding, urng)
            largest = max(largest, float(np.abs(glob + d).max()))
        decoded = from_array_record(decode_record(record, encoding))["w"]
        total += decoded.astype(np.float64) - glob
    error = total - rounds * d.astype(np.float64)
    step = {"bf16": 2.0**-7, "int8": 1.01 / 127, "int4-g": 1.01 / 7}[encoding] * largest
    return error, step


@pytest.mark.parametrize("encoding", ["bf16", "int8", "int4-g"])
def test_with_feedback_the_decoded_updates_sum_to_the_true_ones_within_one_rounding(encoding):
    """The EF guarantee: sum of decoded updates = sum of true updates - the last residual,
    whatever the global model did in between."""
    error, step = _run_rounds(encoding, feedback=True)
    assert np.abs(error).max() <= step


def test_without_feedback_bf16s_bias_accumulates_every_round():
    """d below half a bf16 step of a bf16 global: every reply rounds back to the global,
    and the server misses the whole of T d; with feedback the miss stays below a step."""
    rounds = 1000
    error, step = _run_rounds("bf16", feedback=False, rounds=rounds)
    np.testing.assert_allclose(np.abs(error), rounds * 1e-3, rtol=1e-3)
    assert np.abs(error).min() > 50 * step
    ef_error, _ = _run_rounds("bf16", feedback=True, rounds=rounds)
    assert np.abs(ef_error).max() < np.abs(error).min() / 50


# -- the setting -------------------------------------------------------------------------


def test_the_setting_is_off_by_default_and_refused_with_fp32_naming_its_key():
    assert resolve_config({}).uplink_error_feedback is False
    for settings in ({"uplink-error-feedback": True},
                     {"uplink-error-feedback": True, "uplink-encoding": "fp32"}):  # fmt: skip
        with pytest.raises(ConfigError, match="^uplink-error-feedback: .*fp32"):
            resolve_config({}, settings)
    for encoding in LOSSY:
        config = resolve_config({}, {"uplink-error-feedback": True, "uplink-encoding": encoding})
        assert config.uplink_error_feedback is True


# -- where the residual lives -------------------------------------------------------------

SHARED = {"l.lora_A": _f32((2, 8)), "l.lora_B": _f32((8, 2)), "head.bias": _f32((3,))}
SHAPES = {k: v.shape for k, v in SHARED.items()}


def test_the_residual_round_trips_through_the_context_and_the_nodes_disk(tmp_path, monkeypatch):
    monkeypatch.setenv(NODE_STATE_ENV, str(tmp_path))
    msg, context = _message({}, 4), _context()
    residual = {k: _f32(v.shape, 1e-3) for k, v in SHARED.items()}
    save_residual(context, msg, 0, 4, residual)
    assert RECORD in context.state.array_records
    folder = residual_dir(msg, 0)
    assert folder is not None and folder.parent.name == "partition-0"
    assert [t for t, _ in persisted_rounds(folder)] == [4]
    for found in (
        load_residual(context, msg, 0, 5, SHAPES),  # the context's
        load_residual(_context(), msg, 0, 5, SHAPES),  # a fresh context: the disk's
    ):
        assert set(found) == set(residual)
        for k, v in residual.items():
            np.testing.assert_array_equal(found[k], v)
    # a resumed run redoing round 4 reads what the node held before it: nothing here
    assert load_residual(_context(), msg, 0, 4, SHAPES) == {}
    monkeypatch.delenv(NODE_STATE_ENV)
    assert load_residual(_context(), msg, 0, 5, SHAPES) == {}  # no node state folder


def test_a_residual_of_other_shapes_or_names_is_dropped_with_a_warning(
    tmp_path, monkeypatch, caplog
):
    monkeypatch.setenv(NODE_STATE_ENV, str(tmp_path))
    msg = _message({}, 2)
    rank4 = {"l.lora_A": _f32((4, 8)), "l.lora_B": _f32((8, 4)), "head.bias": _f32((3,))}
    for kept, expected in ((rank4, SHAPES), ({"other.A": _f32((2, 8))}, SHAPES)):
        context = _context()
        save_residual(context, msg, 0, 1, kept)
        for ctx in (context, _context()):  # from the context, then from the disk
            caplog.clear()
            with caplog.at_level(logging.WARNING, logger="flwr"):
                assert load_residual(ctx, msg, 0, 2, expected) == {}
            assert "dropping the uplink error-feedback residual" in caplog.text


def _node(state: dict):
    """What ``encode_with_feedback`` reads of a config and an adapted model."""
    config = SimpleNamespace(downlink_encoding="fp32", uplink_encoding="int8-g")
    return config, SimpleNamespace(shared_state=lambda: dict(state))


def test_a_failed_encode_keeps_the_old_residual(tmp_path, monkeypatch):
    monkeypatch.setenv(NODE_STATE_ENV, str(tmp_path))
    msg, context = _message(SHARED, 3), _context()
    old = {k: _f32(v.shape, 1e-3) for k, v in SHARED.items()}
    save_residual(context, msg, 0, 2, old)
    bad = dict(SHARED) | {"l.lora_B": np.full((8, 2), np.nan, np.float32)}
    config, adapted = _node(SHARED)
    with pytest.raises(NonFiniteArray, match="l.lora_B"):
        encode_with_feedback(
            msg, context, config, adapted, bad,
            rank=2, partition_id=0, server_round=3, rng=encoding_rng(0, 3, UP),
        )  # fmt: skip
    kept = from_array_record(context.state[RECORD])
    assert all(np.array_equal(kept[k], v) for k, v in old.items())
    assert [t for t, _ in persisted_rounds(residual_dir(msg, 0))] == [2]


def test_an_fp16_reply_beyond_its_range_leaves_the_residual_as_it_was():
    """An entry beyond ±65504 arrives as inf, which the server refuses: nothing of the reply
    is applied, so nothing of it is fed back."""
    received = {"w": np.zeros(4, np.float32)}
    trained = {"w": np.array([1.0, 2.0, 7e4, 3.0], np.float32)}
    with np.errstate(over="ignore"):  # the cast to float16 overflows, as it is meant to
        record, left_out = feedback_step(trained, received, {}, "fp16", None)
    assert left_out == {} and not np.isfinite(from_array_record(record)["w"]).all()


def test_an_alternating_method_feeds_back_each_part_in_its_own_rounds(tmp_path, monkeypatch):
    """RoLoRA sends B (and the head) in odd rounds, A in even ones: a round updates the
    residual of what it sends and keeps the other part's for its next turn."""
    monkeypatch.setenv(NODE_STATE_ENV, str(tmp_path))
    method, context = get_method("rolora"), _context()
    config, adapted = _node(SHARED)
    residual = {k: _f32(v.shape, 1e-3) for k, v in SHARED.items()}
    save_residual(context, _message({}, 0), 0, 0, residual)
    for server_round, sent_part, kept_part in ((1, "l.lora_B", "l.lora_A"),
                                               (2, "l.lora_A", "l.lora_B")):  # fmt: skip
        msg = _message(SHARED, server_round)
        trained = {k: v + _f32(v.shape, 1e-2) for k, v in SHARED.items()}
        sent = dict(method.uplink(trained, server_round))
        assert sent_part in sent and kept_part not in sent
        record = encode_with_feedback(
            msg, context, config, adapted, sent,
            rank=2, partition_id=0, server_round=server_round,
            rng=encoding_rng(0, server_round, UP),
        )  # fmt: skip
        new = from_array_record(context.state[RECORD])
        decoded = from_array_record(decode_record(record, "int8-g"))
        assert set(decoded) == set(sent) and set(new) == set(SHARED)
        np.testing.assert_array_equal(new[kept_part], residual[kept_part])
        want = trained[sent_part].astype(np.float64) + residual[sent_part]
        got = decoded[sent_part] + new[sent_part].astype(np.float64)
        np.testing.assert_allclose(got, want, rtol=0, atol=2.0**-23 * 1e-2)
        residual = new


# -- the ClientApp -------------------------------------------------------------------------


def test_the_client_apps_reply_is_todays_when_off_and_feeds_back_when_on(
    tiny_client_settings, tmp_path, monkeypatch
):
    """Off: the reply is the plain int4-g encoding of what the node trained, bit for bit.
    On: the first reply is the same (no residual yet), the residual is what it left out,
    kept in the context and on the node's disk, where a fresh context (a resumed run)
    finds it for the next round's reply."""
    from client_app.client_app import train as client_train

    monkeypatch.setenv(NODE_STATE_ENV, str(tmp_path))
    base = {**tiny_client_settings, "method": "fedit", "local-steps": 1}
    seed = resolve_config({}, base).seed
    start = cached_adapted_model(resolve_config({}, base), 2).shared_state()

    def reply(server_round: int, context: Context | None = None, **settings):
        run_config = {**base, **settings}
        ctx = context if context is not None else _context(run_config)
        return client_train(_message(start, server_round), ctx).content["arrays"], ctx

    trained = {r: from_array_record(reply(r)[0]) for r in (1, 2)}  # fp32: what was trained
    rng = {r: encoding_rng(seed, r, UP, 0) for r in (1, 2)}
    today = encode_record(trained[1], "int4-g", rng[1])
    off, _ = reply(1, **{"uplink-encoding": "int4-g"})
    assert _bytes(off) == _bytes(today)

    on = {"uplink-encoding": "int4-g", "uplink-error-feedback": True}
    first, context = reply(1, **on)
    assert _bytes(first) == _bytes(today)
    residual = from_array_record(context.state[RECORD])
    decoded = from_array_record(decode_record(first, "int4-g"))
    assert set(residual) == set(trained[1])
    for k, x in trained[1].items():
        gap = 2.0**-23 * np.abs(residual[k]).max() + 1e-12
        np.testing.assert_allclose(decoded[k] + residual[k].astype(np.float64), x, atol=gap)
    folder = residual_dir(_message({}, 1), 0)
    assert [t for t, _ in persisted_rounds(folder)] == [1]

    second, _ = reply(2, _context({**base, **on}))  # a fresh context: the disk's residual
    expected, _ = feedback_step(trained[2], start, residual, "int4-g", rng[2])
    assert _bytes(second) == _bytes(expected)
    assert _bytes(second) != _bytes(encode_record(trained[2], "int4-g", rng[2]))


@pytest.mark.integration
def test_a_tiny_fedit_run_with_int4_g_and_feedback_completes(tiny_superlink, tiny_assets):
    from tests.harness.flower_harness import TINY_NUM_NODES, run_tiny_app

    outcome, run_dir = run_tiny_app(
        tiny_superlink, tiny_assets, "error-feedback", method="fedit",
        **{"uplink-encoding": "int4-g", "uplink-error-feedback": True},
    )  # fmt: skip
    assert outcome.ok, f"{outcome.message}\n{outcome.log_text[-4000:]}"
    rounds = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    trained = [row for row in rounds if "rejected" in row]
    assert len(trained) == 2, rounds
    assert all(row["clients"] == TINY_NUM_NODES and row["rejected"] == 0 for row in trained)
    folders = sorted((tiny_assets[2] / "node-state").glob("*/partition-*/uplink-residual"))
    assert len(folders) == TINY_NUM_NODES
    assert all([t for t, _ in persisted_rounds(f)] == [1, 2] for f in folders)
