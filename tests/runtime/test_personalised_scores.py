"""How a method with personal parts (FedSA-LoRA) is scored and tuned, and the validation
schedule: the server's mean over clients, the run summary's reported keys, tuning's key."""

from __future__ import annotations

import json

import numpy as np
import pytest
from flwr.app import Message, MessageType, MetricRecord, RecordDict
from flwr.supercore.task_identity import TaskIdentity

from florg_lab.tuning import selection_score
from flower_app.run_output.recorder import RunRecorder
from flower_app.settings.config import resolve_config
from tests.harness.strategy_helpers import strategy_for

TaskIdentity.run_id = 1  # messages are normally built inside a run
TaskIdentity.task_id = 1
TaskIdentity.node_id = 1

PREV = {"enc.q.A": np.ones((2, 6)), "classifier.weight": np.ones((3, 6))}


def evaluation_reply(**metrics: float) -> Message:
    content = RecordDict({"metrics": MetricRecord(metrics)})
    return Message(content=content, dst_node_id=1, message_type=MessageType.EVALUATE)


def test_common_split_scores_are_a_plain_mean_over_clients_own_shares_are_weighted():
    strategy = strategy_for("fedsa-lora", PREV, fingerprint=7)
    replies = [
        evaluation_reply(**{"num-examples": 30, "accuracy": 0.9, "test-score": 0.6}),
        evaluation_reply(**{"num-examples": 10, "accuracy": 0.5, "test-score": 0.8}),
    ]
    result = strategy.aggregate_evaluate(3, replies)
    assert result["personalized-accuracy"] == pytest.approx((30 * 0.9 + 10 * 0.5) / 40)
    assert result["personalized-test-score"] == pytest.approx(0.7)  # each client once
    assert result["personalized-clients"] == 2
    assert strategy.round_metrics[3]["personalized-test-score"] == pytest.approx(0.7)


def test_the_mean_over_clients_does_not_depend_on_the_order_replies_arrive_in():
    """Bit for bit: the rows are summed in partition order, as the training aggregate."""
    # values whose float sum depends on the order: (1e16 + 1) - 1e16 != (1e16 - 1e16) + 1
    losses = [1e16, 1.0, -1e16, 0.1, 0.2, 0.3, 0.7]
    metrics = [
        {"partition-id": float(p), "num-examples": float(10 + p), "val-loss": loss,
         "accuracy": loss}
        for p, loss in enumerate(losses)
    ]  # fmt: skip
    results = set()
    for order in (range(7), reversed(range(7)), (3, 0, 6, 1, 5, 2, 4)):
        strategy = strategy_for("fedsa-lora", PREV, fingerprint=7)
        result = strategy.aggregate_evaluate(1, [evaluation_reply(**metrics[i]) for i in order])
        results.add((result["personalized-val-loss"], result["personalized-accuracy"]))
    assert len(results) == 1


def _record(recorder: RunRecorder, t: int, personal: float | None) -> None:
    evaluation = {"accuracy": 0.5, "loss": 0.7, "score": 0.5}
    evaluation |= {"test-score": 0.5 + t / 100, "test-accuracy": 0.5 + t / 100, "test-loss": 0.7}
    round_metrics = {}
    if personal is not None:
        round_metrics = {
            "personalized-test-score": personal,
            "personalized-test-loss": 0.4,
            "personalized-val-score": personal - 0.1,
        }
    recorder.record(t, evaluation, round_metrics)


def test_a_personal_methods_summary_reports_its_personalised_models(tmp_path):
    config = resolve_config({}, {"method": "fedsa-lora", "num-server-rounds": 4})
    recorder = RunRecorder(tmp_path, config)
    _record(recorder, 0, None)  # clients do not evaluate before round 1
    for t, personal in ((1, 0.6), (2, 0.7), (3, 0.8), (4, 0.9)):
        _record(recorder, t, personal)
    summary = recorder.write_summary({})
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["personalized-test-score"] == rows[0]["test-score"] == 0.5
    assert summary["test-score-key"] == "personalized-test-score"
    assert summary["val-score-key"] == "personalized-val-score"
    assert summary["final-test-score"] == 0.9
    assert summary["final-test-loss"] == 0.4
    assert summary["test-last3"] == pytest.approx(0.8)
    assert summary["global-final-test-score"] == pytest.approx(0.54)
    assert summary["global-test-last3"] == pytest.approx(0.53)
    assert selection_score(rows, key=summary["val-score-key"]) == pytest.approx(0.7)


def test_a_shared_methods_summary_reports_its_global_model(tmp_path):
    config = resolve_config({}, {"method": "fedit", "num-server-rounds": 3})
    recorder = RunRecorder(tmp_path, config)
    for t in range(4):
        _record(recorder, t, None)
    summary = recorder.write_summary({})
    assert summary["test-score-key"] == "test-score" and summary["val-score-key"] == "score"
    assert summary["final-test-score"] == pytest.approx(0.53)
    assert "global-final-test-score" not in summary


@pytest.mark.parametrize(
    ("every", "rounds", "validated"),
    [(1, 4, [0, 1, 2, 3, 4]), (5, 20, [0, 5, 10, 15, 18, 19, 20]), (0, 6, [0, 4, 5, 6])],
)
def test_validation_rounds(every, rounds, validated):
    config = resolve_config({}, {"eval-every": every, "num-server-rounds": rounds})
    assert [r for r in range(rounds + 1) if config.validates_round(r)] == validated


def test_rows_without_validation_do_not_count_for_tuning():
    rows = [{"round": t, "score": 0.5} for t in (0, 5, 8, 9, 10)]
    rows.insert(2, {"round": 6, "score": None})
    assert selection_score(rows) == pytest.approx(0.5)
    assert selection_score(rows[:3]) is None
