"""Issue 14: the ServerApp console (Flower's record dumps at DEBUG, our progress line at
INFO) and the optional TensorBoard event files of every metrics.jsonl row."""

from __future__ import annotations

import io
import json
import logging
import sys
from collections.abc import Iterator

import numpy as np
import pytest
from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict
from flwr.common.logger import FLOWER_LOGGER, console_handler
from flwr.common.logger import log as flwr_log
from flwr.serverapp.strategy import FedAvg
from flwr.supercore.task_identity import TaskIdentity

from flower_app.run_output import console
from flower_app.run_output.checkpoint import Checkpoint, check_resumable
from flower_app.run_output.recorder import RunRecorder
from flower_app.run_output.tracking import TENSORBOARD_DIR, scalars
from flower_app.settings.config import ConfigError, resolve_config

PROGRESS = "[florg] round %d/2 | acc 0.5000 loss 1.0000 | comm 0 params (0B) | 1s"


class FakeGrid:
    """Two nodes that answer every message with a metrics reply (and the arrays back)."""

    def get_node_ids(self) -> list[int]:
        return [1, 2]

    def send_and_receive(self, messages, timeout=None) -> list[Message]:
        replies = []
        for msg in messages:
            metrics = {"num-examples": 10, "loss": 0.5, "a-very-long-diagnostic-name": 1.0}
            content = RecordDict({"metrics": MetricRecord(metrics)})
            if "arrays" in msg.content.array_records:
                content["arrays"] = msg.content["arrays"]
            replies.append(Message(content, reply_to=msg))
        return replies


@pytest.fixture
def task_identity(monkeypatch) -> None:
    for name in ("_run_id", "_task_id", "_node_id"):
        monkeypatch.setattr(TaskIdentity, name, 1)


@pytest.fixture
def flwr_logs() -> Iterator[tuple[io.StringIO, io.StringIO]]:
    """What a console at INFO and a log file at DEBUG on Flower's logger would show."""
    info, debug = io.StringIO(), io.StringIO()
    handlers = []
    for buf, level in ((info, logging.INFO), (debug, logging.DEBUG)):
        handler = logging.StreamHandler(buf)
        handler.setLevel(level)
        handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
        FLOWER_LOGGER.addHandler(handler)
        handlers.append(handler)
    console.uninstall_console()
    yield info, debug
    console.uninstall_console()
    for handler in handlers:
        FLOWER_LOGGER.removeHandler(handler)


def _run_flower_strategy() -> None:
    """Flower's own Strategy.start, two rounds, with an evaluate_fn that logs our line."""

    def evaluate_fn(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        flwr_log(logging.INFO, PROGRESS % server_round)
        return MetricRecord({"accuracy": 0.5, "loss": 1.0, "eval-seconds": 0.1})

    strategy = FedAvg(min_train_nodes=2, min_evaluate_nodes=2, min_available_nodes=2)
    strategy.start(
        grid=FakeGrid(),  # type: ignore[arg-type]
        initial_arrays=ArrayRecord([np.zeros(3, np.float32)]),
        num_rounds=2,
        evaluate_fn=evaluate_fn,
    )


def test_without_the_filter_flower_dumps_records_at_info(task_identity, flwr_logs):
    """The control: Flower (this version) does log the records at INFO, so the test below
    can fail if it changes how."""
    info, _ = flwr_logs
    _run_flower_strategy()
    out = info.getvalue()
    assert out.count("Aggregated MetricRecord: {") == 4
    assert out.count("\u2514\u2500\u2500> MetricRecord: {") == 2
    assert "Initial global evaluation results: {" in out
    assert "Final results:" in out and "ServerApp-side Evaluate Metrics" in out


def test_filter_demotes_flower_record_dumps_and_keeps_our_line(task_identity, flwr_logs):
    info, debug = flwr_logs
    console.install_console("info")
    _run_flower_strategy()
    out = info.getvalue()
    for dump in ("MetricRecord", "{", "Initial global evaluation", "Final results", "Metrics"):
        assert dump not in out, out
    for kept in (
        "Starting FedAvg strategy:",
        "Number of rounds: 2",
        "[ROUND 1/2]",
        "[ROUND 2/2]",
        "configure_train: Sampled 2 nodes",
        "aggregate_evaluate: Received 2 results and 0 failures",
        "Strategy execution finished in",
        PROGRESS % 0,
        PROGRESS % 1,
        PROGRESS % 2,
    ):
        assert kept in out, kept
    lines = out.splitlines()
    assert all(len(line) < 120 for line in lines), max(lines, key=len)
    assert not any(a == b == "INFO " for a, b in zip(lines, lines[1:], strict=False))
    # Not dropped: a handler at DEBUG (a log file, log-level=debug) still has them.
    dumped = debug.getvalue()
    assert dumped.count("DEBUG \t\u2514\u2500\u2500> Aggregated MetricRecord: {") == 4
    assert "DEBUG Final results:" in dumped and "ServerApp-side Evaluate Metrics" in dumped


def _record(msg: str, *args, name: str = "flwr", func: str = "start", level=logging.INFO):
    return logging.getLogger(name).makeRecord(
        name, level, "strategy.py", 1, msg, args, None, func=func
    )


@pytest.mark.parametrize(
    ("msg", "args", "name", "func", "dump"),
    [
        ("\t\u2514\u2500\u2500> Aggregated MetricRecord: %s", ({"loss": 1.0},), "flwr", "start", 1),
        ("\t\u2514\u2500\u2500> MetricRecord: %s", ({"accuracy": 0.5},), "flwr", "start", 1),
        ("Initial global evaluation results: %s", ({"a": 1},), "flwr", "start", 1),
        ("Final results:", (), "flwr", "start", 1),
        ("\t%s", ("{1: {'loss': '1.0e+00'}}",), "flwr", "start", 1),
        ("\t%s", ("something else",), "flwr", "other_function", 0),
        ("[florg] round 3/5 | acc 0.8 | comm 1.2M params (4.8MB) | 233s", (), "flwr", "x", 0),
        ("[ROUND %s/%s]", (3, 5), "flwr", "start", 0),
        ("aggregate_train: Received %s results and %s failures", (2, 0), "flwr", "x", 0),
        ("\t\u2514\u2500\u2500> Aggregated MetricRecord: %s", ({},), "someone.else", "start", 0),
    ],
)
def test_is_record_dump_on_real_log_records(msg, args, name, func, dump):
    record = _record(msg, *args, name=name, func=func)
    record.getMessage()  # a well-formed record
    assert console.is_record_dump(record) is bool(dump)
    kept_level = console.DemoteRecordDumps().filter(record)
    assert kept_level is True  # never dropped, only re-levelled
    assert record.levelno == (logging.DEBUG if dump else logging.INFO)
    assert record.levelname == ("DEBUG" if dump else "INFO")


def test_a_warning_that_looks_like_a_dump_is_left_alone():
    record = _record("\t\u2514\u2500\u2500> MetricRecord: %s", {}, level=logging.WARNING)
    assert not console.is_record_dump(record)


def test_install_console_is_idempotent_and_debug_lowers_the_console(flwr_logs):
    level = console_handler.level
    try:
        console.install_console("info")
        console.install_console("info")
        assert sum(isinstance(f, console.DemoteRecordDumps) for f in FLOWER_LOGGER.filters) == 1
        assert console_handler.level == level
        console.install_console("debug")
        assert console_handler.level == logging.DEBUG
        with pytest.raises(ValueError, match="log-level"):
            console.install_console("verbose")
    finally:
        console_handler.setLevel(level)


def test_new_settings_are_validated():
    config = resolve_config({})
    assert (config.log_level, config.tensorboard) == ("info", "auto")
    with pytest.raises(ConfigError, match="tensorboard"):
        resolve_config({"tensorboard": "yes"})
    with pytest.raises(ConfigError, match="log-level"):
        resolve_config({"log-level": "verbose"})


def test_resume_accepts_other_console_and_tracking_settings(tmp_path):
    """Display-only settings: a run may be resumed with other values, and a checkpoint
    written before they existed (no such keys in its config) is still resumable."""
    saved = resolve_config({}).as_dict()
    del saved["log-level"], saved["tensorboard"]
    checkpoint = Checkpoint(1, tmp_path / "checkpoint" / "round-1", {}, {}, {"config": saved})
    check_resumable(resolve_config({"log-level": "debug", "tensorboard": "off"}), checkpoint)
    with pytest.raises(ConfigError, match="rank"):  # the check itself still works
        check_resumable(resolve_config({"rank": 2}), checkpoint)


# -- TensorBoard -----------------------------------------------------------------------


def _rows(path) -> list[dict]:
    return [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]


def _read_scalars(logdir) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir))
    acc.Reload()
    return {
        tag: {event.step: event.value for event in acc.Scalars(tag)}
        for tag in acc.Tags()["scalars"]
    }


def _record_rounds(recorder: RunRecorder, rounds, accuracy=0.5) -> None:
    for t in rounds:
        recorder.record(
            t,
            {"accuracy": accuracy + t / 10, "loss": 1.0 - t / 10, "score": accuracy + t / 10,
             "test-score": 0.4 + t / 100, "eval-seconds": 0.25},
            {"up-params": 100 * t, "down-params": 50 * t, "agg-seconds": 0.003,
             "clients": 2, "gram_rel_error-max": np.float64(1e-3 * t), "drift-mean": 0.5},
        )  # fmt: skip


def test_recorder_writes_every_numeric_metrics_field_to_tensorboard(tmp_path):
    pytest.importorskip("tensorboard")
    recorder = RunRecorder(tmp_path, resolve_config({"num-server-rounds": 2}))
    _record_rounds(recorder, range(3))
    recorder.write_summary({})
    rows = _rows(tmp_path)
    events = _read_scalars(tmp_path / TENSORBOARD_DIR)
    numeric = {k for row in rows for k, v in row.items() if isinstance(v, int | float)}
    expected = numeric - {"round"}
    assert set(events) == expected
    assert {"score", "accuracy", "loss", "test-score", "cum-up-bytes", "agg-seconds",
            "gram_rel_error-max", "drift-mean", "elapsed-seconds"} <= expected  # fmt: skip
    for row in rows:
        for key, value in scalars(row).items():
            assert events[key][row["round"]] == pytest.approx(value, rel=1e-6), key
    assert events["accuracy"] == pytest.approx({0: 0.5, 1: 0.6, 2: 0.7})
    assert events["cum-up-params"] == {0: 0, 1: 100, 2: 300}
    assert "score-metric" not in events


def test_a_resumed_run_replaces_the_lost_rounds_in_tensorboard(tmp_path):
    pytest.importorskip("tensorboard")
    config = resolve_config({"num-server-rounds": 3})
    first = RunRecorder(tmp_path, config)
    _record_rounds(first, range(3))
    first.close()  # the crash after round 2; its checkpoint is the one of round 1
    saved = json.loads(json.dumps(first.state()))
    saved["rows"] = saved["rows"][:2]
    resumed = RunRecorder(tmp_path, config, resumed=saved)
    _record_rounds(resumed, [2, 3], accuracy=0.0)
    resumed.write_summary({})
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / TENSORBOARD_DIR))
    acc.Reload()
    points = [(e.step, e.value) for e in acc.Scalars("accuracy")]
    assert [step for step, _ in points] == [0, 1, 2, 3]  # round 2 once: the resumed value
    assert [value for _, value in points] == pytest.approx([0.5, 0.6, 0.2, 0.3])


def test_tensorboard_off_writes_nothing(tmp_path):
    recorder = RunRecorder(tmp_path, resolve_config({"tensorboard": "off"}))
    _record_rounds(recorder, range(2))
    recorder.write_summary({})
    assert not (tmp_path / TENSORBOARD_DIR).exists()
    assert len(_rows(tmp_path)) == 2


@pytest.fixture
def no_tensorboard(monkeypatch) -> None:
    """As if the tensorboard package were not installed."""
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)


def test_without_tensorboard_auto_logs_how_to_install_and_carries_on(
    tmp_path, no_tensorboard, flwr_logs
):
    info, _ = flwr_logs
    recorder = RunRecorder(tmp_path, resolve_config({}))
    _record_rounds(recorder, range(2))
    recorder.write_summary({})
    assert [r["round"] for r in _rows(tmp_path)] == [0, 1]
    assert (tmp_path / "summary.json").is_file()
    assert not (tmp_path / TENSORBOARD_DIR).exists()
    hints = [line for line in info.getvalue().splitlines() if "TensorBoard not installed" in line]
    assert len(hints) == 1 and 'pip install -e ".[tracking]"' in hints[0]


def test_without_tensorboard_on_fails_before_training(tmp_path, no_tensorboard):
    with pytest.raises(ConfigError, match=r"tensorboard=on.*\[tracking\]"):
        RunRecorder(tmp_path, resolve_config({"tensorboard": "on"}))
