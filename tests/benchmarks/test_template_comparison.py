"""The template comparison's reading of a run's streamed log (benchmarks/overhead/
template_comparison.py): rounds timed from Flower's round lines to the strategy's end, the
last aggregated training loss (the template's ``train_loss``, this app's ``train-loss``),
and the printed ratios. The comparison itself needs the template's checkout and its own
environment: its command is in docs/benchmarks.md."""

from __future__ import annotations

import pytest

from benchmarks.overhead.template_comparison import Side, ratio_lines

LOG = [
    (0.0, "INFO :      Starting FedAvg strategy:"),
    (1.0, "INFO :      [ROUND 1/2]"),
    (5.0, "INFO :      └──> Aggregated MetricRecord: {'train_loss': 2.5}"),
    (9.0, "INFO :      [ROUND 2/2]"),
    (14.0, "INFO :      └──> Aggregated MetricRecord: {'train_loss': 2.25}"),
    (17.0, "INFO :      Strategy execution finished in 16.00s"),
]


def read(name: str, log: list[tuple[float, str]]) -> Side:
    side = Side(name)
    for now, line in log:
        side.read(line, now)
    return side


def test_rounds_are_timed_from_their_lines_and_the_last_loss_kept():
    side = read("template", LOG)
    assert side.seconds_per_round() == pytest.approx((17.0 - 1.0) / 2)
    assert side.train_loss == 2.25


def test_this_apps_train_loss_key_is_read_and_ratios_printed():
    ours = read("app", [(t / 2, line.replace("train_loss", "train-loss")) for t, line in LOG])
    ours.peak_rss, template = 2**30, read("template", LOG)
    template.peak_rss = 2**31
    lines = ratio_lines(ours, template, 100.0, 100.0)
    assert any(line.startswith("seconds per round") and line.endswith("0.50x") for line in lines)
    assert any(line.startswith("peak memory") and line.endswith("0.50x") for line in lines)
    assert any(line.startswith("final training loss") and line.endswith("1.00x") for line in lines)


def test_a_log_without_a_finished_round_is_an_error():
    with pytest.raises(ValueError, match="no complete round"):
        read("template", LOG[:2]).seconds_per_round()


def test_failed_training_replies_are_counted():
    """A round whose clients failed times nothing worth comparing: the benchmark stops
    with the errors (run_side) once its log counted them."""
    side = read(
        "template", [(0.0, "INFO :      aggregate_train: Received 0 results and 2 failures")]
    )
    assert side.failures == 2


def test_a_side_that_prints_nothing_is_stopped_at_its_timeout():
    """The deadline holds without a line to check it on: a silent process is killed."""
    import subprocess
    import sys
    import time

    from benchmarks.overhead.template_comparison import read_until

    silent = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                              stdout=subprocess.PIPE, text=True)  # fmt: skip
    start = time.monotonic()
    assert read_until(silent, lambda line: None, timeout=1.0) is False
    assert time.monotonic() - start < 30 and silent.poll() is not None
    lines: list[str] = []
    talking = subprocess.Popen([sys.executable, "-c", "print('a'); print('b')"],
                               stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert read_until(talking, lines.append, timeout=60.0) is True and lines == ["a", "b"]
