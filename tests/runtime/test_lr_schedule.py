"""The per-round learning-rate schedule (``lr-schedule``, ``min-learning-rate``): its values
(FlowerTune's cosine annealing over rounds), its checks, and that the ClientApp's AdamW
trains round t at round t's rate, the head's rate scaled by the same factor."""

from __future__ import annotations

import math
import time

import pytest
from flwr.app import ConfigRecord, Context, Message, Metadata, RecordDict

import flower_app.training.loop as training
from flower_app.cache.per_process import cached_adapted_model
from flower_app.settings.config import ConfigError, resolve_config
from flower_app.training.lr_schedule import cosine_annealing, round_learning_rate, round_lr_factor
from flower_app.wire.records import to_array_record


def test_constant_is_the_default_and_every_round_trains_at_learning_rate():
    config = resolve_config({}, {"learning-rate": 3e-3, "num-server-rounds": 4})
    assert config.lr_schedule == "constant" and config.min_learning_rate == 0.0
    assert [round_learning_rate(config, t) for t in range(1, 5)] == [3e-3] * 4
    assert round_lr_factor(config, 2) == 1.0


def test_cosine_values_follow_flowertunes_cosine_annealing():
    # lr_t = lr_min + (lr - lr_min)(1 + cos(pi t / T)) / 2, t = Flower's 1-based round
    config = resolve_config(
        {},
        {"learning-rate": 5e-5, "min-learning-rate": 1e-6, "lr-schedule": "cosine",
         "num-server-rounds": 4},
    )  # fmt: skip
    got = [round_learning_rate(config, t) for t in range(1, 5)]
    span = 5e-5 - 1e-6
    want = [
        1e-6 + span * (1 + math.sqrt(0.5)) / 2,  # t=1: cos(pi/4)
        1e-6 + span / 2,  # t=2: cos(pi/2) = 0
        1e-6 + span * (1 - math.sqrt(0.5)) / 2,  # t=3
        1e-6,  # the last round trains at the floor
    ]
    assert got == pytest.approx(want, rel=1e-12)
    assert all(a > b for a, b in zip(got, got[1:], strict=False))  # strictly decreasing
    assert round_lr_factor(config, 2) == pytest.approx((1e-6 + span / 2) / 5e-5)
    # FlowerTune's own 100-round setting: half way is the midpoint, the end the floor
    assert cosine_annealing(50, 100, 5e-5, 1e-6) == pytest.approx(2.55e-5)
    assert cosine_annealing(100, 100, 5e-5, 1e-6) == pytest.approx(1e-6)
    # round 0 (the initial evaluation) and rounds past T clamp to the ends
    assert cosine_annealing(0, 10, 1.0, 0.0) == 1.0
    assert cosine_annealing(12, 10, 1.0, 0.0) == pytest.approx(0.0)


def test_bad_schedule_settings_are_refused_naming_the_key():
    with pytest.raises(ConfigError, match="lr-schedule"):
        resolve_config({}, {"lr-schedule": "linear"})
    with pytest.raises(ConfigError, match="min-learning-rate"):
        resolve_config({}, {"min-learning-rate": -1e-6})
    with pytest.raises(ConfigError, match="min-learning-rate"):
        resolve_config({}, {"lr-schedule": "cosine", "learning-rate": 1e-4,
                            "min-learning-rate": 1e-3})  # fmt: skip
    with pytest.raises(ValueError, match="total_rounds"):
        cosine_annealing(1, 0, 1.0, 0.0)


def _train_message(sent: dict, server_round: int) -> Message:
    content = RecordDict(
        {"arrays": to_array_record(sent), "config": ConfigRecord({"server-round": server_round})}
    )
    # the metadata a SuperNode hands the ClientApp with the message
    metadata = Metadata(
        run_id=1, message_id="m1", src_node_id=0, dst_node_id=1, reply_to_message_id="",
        group_id=str(server_round), created_at=time.time(), ttl=600.0, message_type="train",
    )  # fmt: skip
    return Message(content=content, metadata=metadata)


def test_the_client_apps_optimiser_gets_the_rounds_rates(
    tiny_bert_dir, sentiment_task_dir, monkeypatch
):
    """The ClientApp's train function, called with a real Flower Message carrying
    ``server-round``: the AdamW it builds has round t's adapter and head rates."""
    from client_app.client_app import train as client_train

    run_config = {
        "model": str(tiny_bert_dir), "task": "local", "data-path": str(sentiment_task_dir),
        "text-fields": "sentence", "rank": 2, "batch-size": 8, "local-steps": 1,
        "max-train-examples": 32, "max-eval-examples": 16, "progress-bar": False,
        "method": "florg", "num-server-rounds": 4, "lr-schedule": "cosine",
        "learning-rate": 1e-2, "head-learning-rate": 4e-2, "min-learning-rate": 1e-3,
    }  # fmt: skip
    config = resolve_config({}, run_config)
    sent = cached_adapted_model(config, 2).shared_state()
    seen: list[list[float]] = []
    make = training.make_optimizer

    def recording(model, **kwargs):
        optimizer = make(model, **kwargs)
        seen.append(sorted(g["lr"] for g in optimizer.param_groups))
        return optimizer

    monkeypatch.setattr(training, "make_optimizer", recording)
    for server_round in (1, 3):
        context = Context(
            run_id=1, node_id=1, node_config={"partition-id": 0, "num-partitions": 2},
            state=RecordDict(), run_config=dict(run_config),
        )  # fmt: skip
        client_train(_train_message(sent, server_round), context)
    lr1 = 1e-3 + 9e-3 * (1 + math.cos(math.pi / 4)) / 2
    lr3 = 1e-3 + 9e-3 * (1 + math.cos(3 * math.pi / 4)) / 2
    assert seen == [
        pytest.approx([lr1, 4 * lr1], rel=1e-12),
        pytest.approx([lr3, 4 * lr3], rel=1e-12),
    ]
