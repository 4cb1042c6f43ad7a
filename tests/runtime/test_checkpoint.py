"""Issue 15, item 1, the pieces: atomic checkpoints, strategy state, resumable settings,
the recorder continuing metrics.jsonl, the launcher's --resume settings."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
from flwr.app import Message, MessageType, MetricRecord, RecordDict
from flwr.supercore.task_identity import TaskIdentity

from florg_tools.run_config import load_preset, resume_run_config
from flower_app.methods.registry import get_method
from flower_app.run_output.checkpoint import (
    check_resumable,
    load_checkpoint,
    random_state_json,
    restore_random_state,
    save_checkpoint,
)
from flower_app.run_output.recorder import RunRecorder
from flower_app.settings.config import ConfigError, defaults, resolve_config
from flower_app.wire.records import from_array_record, to_array_record
from tests.harness.strategy_helpers import strategy_for

TaskIdentity.run_id = 1
TaskIdentity.task_id = 1
TaskIdentity.node_id = 1


def _state(config, round_: int = 1) -> dict:
    return {"config": config.as_dict(), "strategy": {}, "random": random_state_json(),
            "recorder": {"rows": [{"round": round_}]}, "lineage": "0" * 32}  # fmt: skip


def test_checkpoints_are_atomic_keep_two_and_fall_back_when_damaged(tmp_path):
    config = resolve_config({})
    for t in range(4):
        save_checkpoint(
            tmp_path, t, {"a": np.full(3, t, np.float32)}, {"g": np.ones(2)}, _state(config, t)
        )
    folders = sorted(p.name for p in (tmp_path / "checkpoint").iterdir())
    assert folders == ["round-000002", "round-000003"]
    ckpt = load_checkpoint(tmp_path)
    assert ckpt.round == 3 and ckpt.arrays["a"].tolist() == [3, 3, 3]
    assert ckpt.strategy_arrays["g"].dtype == np.float64 and ckpt.lineage == "0" * 32
    # a half-written folder (a crash mid-write) is never read
    (tmp_path / "checkpoint" / ".tmp-4-abc").mkdir()
    (tmp_path / "checkpoint" / ".tmp-4-abc" / "state.json").write_text("{")
    assert load_checkpoint(tmp_path).round == 3
    # a damaged newest round: the older one is used
    (tmp_path / "checkpoint" / "round-000003" / "arrays.safetensors").write_bytes(b"junk")
    assert load_checkpoint(tmp_path).round == 2
    assert load_checkpoint(tmp_path / "nothing") is None


def test_random_state_round_trips_through_json():
    random.seed(7)
    saved = json.loads(json.dumps(random_state_json()))
    expected = [random.random() for _ in range(3)]
    restore_random_state(saved)
    assert [random.random() for _ in range(3)] == expected


def test_resume_refuses_other_settings_naming_them(tmp_path):
    config = resolve_config({"rank": 2, "num-server-rounds": 5})
    save_checkpoint(tmp_path, 3, {}, {}, _state(config, 3))
    ckpt = load_checkpoint(tmp_path)
    check_resumable(resolve_config({"rank": 2, "num-server-rounds": 8, "resume": "x"}), ckpt)
    with pytest.raises(ConfigError, match="rank=4 .checkpoint: 2."):
        check_resumable(resolve_config({"num-server-rounds": 5}), ckpt)
    with pytest.raises(ConfigError, match="num-server-rounds"):
        check_resumable(resolve_config({"rank": 2, "num-server-rounds": 2}), ckpt)


def reply(state, pid) -> Message:
    metrics = MetricRecord({"num-examples": 10, "train-loss": 1.0, "partition-id": pid})
    content = RecordDict({"arrays": to_array_record(state), "metrics": metrics})
    return Message(content=content, dst_node_id=1, message_type=MessageType.TRAIN)


# FedIT (the global adapter only) and every method whose server keeps state between rounds
# beyond it: FLoRG's factor (Procrustes' reference), FedEx-LoRA's and FLoRA's folds, Fed-SB's
# B and A, RoLoRA's and FedSVD's round-dependent parts, FedRot-LoRA's round-dependent
# alignment (round 3 aligns B). The resumed runs through the simulation:
# tests/runtime/test_app_e2e.py (FedSA-LoRA, Fed-SB), tests/deployment/test_deploy_faults.py
# (FLoRG).
@pytest.mark.parametrize(
    "method",
    ["florg", "fedex-lora", "fedit", "flora", "fed-sb", "rolora", "fedsvd", "fedrot-lora"],
)
def test_a_restored_strategy_continues_exactly(method):
    rng = np.random.default_rng(0)
    if method == "florg":
        initial = {"l.A": 0.1 * rng.standard_normal((2, 6)), "head.w": rng.standard_normal((2, 6))}
    elif method == "fed-sb":  # R; round 0's B and A below
        initial = {"l.R": 0.1 * rng.standard_normal((2, 2)), "head.w": rng.standard_normal((2, 6))}
    else:
        initial = {
            "l.lora_A": 0.1 * rng.standard_normal((2, 6)),
            "l.lora_B": np.zeros((5, 2)),
            "head.w": rng.standard_normal((2, 6)),
        }
    # each round's three replies: what a client of the method sends up in that round
    # (RoLoRA: B in odd rounds, A in even ones; FedSVD: B)
    rounds = [
        [
            {k: v + 0.05 * rng.standard_normal(v.shape)
             for k, v in get_method(method).uplink(initial, t).items()}
            for _ in range(3)
        ]
        for t in (1, 2, 3)
    ]  # fmt: skip
    kwargs = {"fedex_residual": "factored"} if method == "fedex-lora" else {}
    first = strategy_for(method, initial, **kwargs)
    if method == "fed-sb":  # as round 0 leaves them
        first.basis = {"l": (rng.standard_normal((5, 2)), rng.standard_normal((2, 6)))}
    for t in (1, 2):
        first.aggregate_train(t, [reply(c, i) for i, c in enumerate(rounds[t - 1])])
    arrays = json.loads(json.dumps(first.state_json()))
    second = strategy_for(method, initial, **kwargs)
    second.restore(first.state_arrays(), arrays)
    folds = get_method(method).writes_base_weights  # FedEx's residuals, FLoRA's updates
    if folds:
        assert second.node_synced == {}  # a resumed run's clients are sent every fold
    if method == "fed-sb":  # B and A come back; every node is sent them again
        assert second.basis_state().keys() == first.basis_state().keys()
        for key, value in first.basis_state().items():
            np.testing.assert_array_equal(second.basis_state()[key], value)
        assert second.node_synced == set()
    a, _ = first.aggregate_train(3, [reply(c, i) for i, c in enumerate(rounds[2])])
    b, _ = second.aggregate_train(3, [reply(c, i) for i, c in enumerate(rounds[2])])
    for key, value in from_array_record(a).items():
        np.testing.assert_array_equal(from_array_record(b)[key], value)
    if folds:
        # the base (rounds 1, 2 as a client sums them) and round 3's folds: what both hold
        assert second.residuals.keys() == first.residuals.keys() == {3}
        assert second.base_round == first.base_round == 2
        for layer, value in first.base.items():
            np.testing.assert_array_equal(second.base[layer], value)
        for layer, value in first.cumulative.items():
            np.testing.assert_array_equal(second.cumulative[layer], value)
    with pytest.raises(ValueError, match="checkpoint"):
        strategy_for("ffa-lora", {"l.lora_B": np.zeros((5, 2))}).restore(
            first.state_arrays(), arrays
        )


def test_recorder_continues_metrics_jsonl_without_the_rounds_after_the_checkpoint(tmp_path):
    config = resolve_config({})
    first = RunRecorder(tmp_path, config)
    for t in range(3):
        first.record(t, {"accuracy": 0.5, "loss": 1.0, "score": 0.5}, {"up-params": 10})
    saved = json.loads(json.dumps(first.state()))
    saved["rows"] = saved["rows"][:2]  # the checkpoint of round 1; round 2 was lost
    saved["totals"] = {"up-params": 10, "down-params": 0}
    resumed = RunRecorder(tmp_path, config, resumed=saved)
    resumed.record(2, {"accuracy": 0.6, "loss": 0.9, "score": 0.6}, {"up-params": 10})
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [0, 1, 2]
    assert rows[2]["accuracy"] == 0.6 and rows[2]["cum-up-params"] == 20


def test_launcher_resume_settings_come_from_the_run_folder(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    config = resolve_config({}, {**load_preset("cpu-default"), "method": "fedit", "rank": 2})
    # as written before presets were resolved ahead of the run: the preset's name recorded
    (run_dir / "config.json").write_text(json.dumps({**config.as_dict(), "preset": "cpu-default"}))
    settings = resume_run_config(run_dir, {"num-server-rounds": 9})
    assert settings == {
        "method": "fedit",
        "rank": 2,
        "resume": str(run_dir.resolve()),
        "num-server-rounds": 9,
    }
    assert resolve_config(settings).resume == str(run_dir.resolve())
    assert set(settings) <= set(defaults())
