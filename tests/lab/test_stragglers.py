"""The straggler comparison's measures (florg_lab.stragglers) on hand-made runs: the async
run's time to the sync run's final validation score over the sync run's length, and its
test score at the sync run's end against the sync run's final one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from florg_lab.stragglers import (
    FIGURE,
    RUNS,
    Curve,
    compare,
    lengths,
    load_curves,
    page_block,
    page_figure,
    page_figure_due,
    pairs,
    plot,
    table,
)


def curve(mode: str, seed: int, points: list[tuple[float, float, float | None]]) -> Curve:
    rows = [{"round": i, "elapsed-seconds": t, "score": s, "test-score": test}
            for i, (t, s, test) in enumerate(points)]  # fmt: skip
    return Curve("florg", mode, seed, rows)


SYNC = curve("sync", 0, [(0, 0.5, 0.5), (100, 0.6, None), (200, 0.7, 0.68)])


def test_the_async_run_reaching_sync_s_score_early_gives_a_ratio_below_one():
    buffered = curve(
        "async", 0, [(0, 0.5, 0.5), (60, 0.71, 0.69), (150, 0.72, 0.7), (300, 0.8, 0.79)]
    )
    pair = compare(SYNC, buffered)
    assert pair.time_ratio == pytest.approx(60 / 200) and pair.reached
    assert pair.test_difference == pytest.approx(0.70 - 0.68)  # its last test by t = 200


def test_an_async_run_that_never_reaches_it_counts_its_whole_length():
    buffered = curve("async", 0, [(0, 0.5, 0.5), (150, 0.6, 0.6), (250, 0.65, 0.6)])
    pair = compare(SYNC, buffered)
    assert pair.time_ratio == pytest.approx(250 / 200) and not pair.reached
    assert "not reached: its whole length" in table([pair]) and "| 0 of 1 |" in table([pair])


def test_runs_on_disk_pair_by_method_and_seed(tmp_path: Path):
    for name, c in (("a", SYNC), ("b", curve("async", 0, [(0, 0.5, 0.5), (80, 0.7, 0.7)])),
                    ("c", curve("async", 1, [(0, 0.5, 0.5)]))):  # fmt: skip
        folder = tmp_path / name
        folder.mkdir()
        (folder / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in c.rows))
        (folder / "summary.json").write_text(json.dumps({"status": "finished"}))
        config = {"method": c.method, "round-mode": c.mode, "seed": c.seed}
        (folder / "config.json").write_text(json.dumps(config))
    curves = load_curves(tmp_path)
    found = pairs(curves)
    assert [(p.method, p.seed) for p in found] == [("florg", 0)]  # seed 1 has no sync run
    assert found[0].time_ratio == pytest.approx(80 / 200)
    assert plot(curves, tmp_path / "p.png").stat().st_size > 0


def write_curve(folder: Path, c: Curve) -> None:
    folder.mkdir(parents=True)
    (folder / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in c.rows))
    (folder / "summary.json").write_text(json.dumps({"status": "finished"}))
    config = {"method": c.method, "round-mode": c.mode, "seed": c.seed}
    (folder / "config.json").write_text(json.dumps(config))


def test_the_lengths_table_gives_each_mode_s_wall_clock_and_final_scores():
    buffered = curve("async", 0, [(0, 0.5, 0.5), (60, 0.71, 0.69), (120, 0.72, 0.7)])
    text = lengths([buffered, SYNC])
    sync_row, async_row = text.splitlines()[2:]
    assert sync_row == "| florg | sync | 1 | 3.3 | 0.0 | 0.700 | 0.680 |"  # 200 s, sync first
    assert async_row == "| florg | async | 1 | 2.0 | 0.0 | 0.720 | 0.700 |"


def test_clients_training_at_once_are_their_seconds_over_the_wall_clock():
    rows = [{"round": 0, "elapsed-seconds": 10.0},
            {"round": 1, "elapsed-seconds": 60.0, "client-train-seconds-sum": 80.0},
            {"round": 2, "elapsed-seconds": 100.0, "client-train-seconds-sum": 70.0}]  # fmt: skip
    assert Curve("florg", "sync", 0, rows).busy() == pytest.approx(150.0 / 100.0)


def test_the_page_block_shows_the_published_comparison_or_how_to_run_it(tmp_path: Path):
    from florg_lab.page_text import Evidence

    assert "Not measured yet" in page_block(Evidence(tmp_path))
    assert not page_figure_due(Evidence(tmp_path))
    runs = tmp_path / RUNS
    write_curve(runs / "s", SYNC)
    write_curve(runs / "a", curve("async", 0, [(0, 0.5, 0.5), (80, 0.7, 0.7)]))
    text = page_block(Evidence(tmp_path))
    assert "| florg | 1 | 0.400 | 1 of 1 |" in text and "| florg | async | 1 |" in text
    assert "0 (0.700): 0.40, +0.020" in text  # the seed's target: sync's final score
    assert f"](../{FIGURE})" in text and page_figure_due(Evidence(tmp_path))
    assert page_figure(Evidence(tmp_path), tmp_path / "f.png")
