"""The straggler comparison under the virtual clock (florg_lab.stragglers) on hand-made run
folders: the virtual time axis, the three modes, async's server rate chosen on seed 0, the
slow nodes' share of the applied updates (fixed and log-normal speeds); the wall-clock
report as published; the grids stragglers-virtual*.yaml and their runner's placeholder."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from florg_lab.__main__ import main as grid_cli
from florg_lab.grid import GRIDS_DIR, load_grid
from florg_lab.stragglers import (
    Curve,
    choose_rates,
    compare,
    lengths,
    load_curves,
    main,
    main_runs,
    pairs,
    plot,
    report,
    slow_partitions,
    slow_shares,
)
from flower_app.client.node_speed import lognormal_multiplier

ROOT = Path(__file__).resolve().parents[2]
FIXED = {"node-speeds": "fixed", "slow-partitions": "0,4,8,12,16", "slowdown": 5.0}
SLOW = {0, 4, 8, 12, 16}


def rows(points, partitions=()):
    """Rows of (virtual seconds, validation, test); round 0 carries no virtual-seconds (the
    clock's rows do not: evaluation takes no virtual time) and a wall clock unrelated."""
    out = []
    for i, (t, score, test) in enumerate(points):
        row = {"round": i, "elapsed-seconds": 1000.0 + 7 * i, "score": score, "test-score": test}
        if i:
            row |= {"virtual-seconds": t, "partitions": list(partitions[i - 1] if partitions
                                                             else range(10))}  # fmt: skip
        out.append(row)
    return out


def curve(mode, seed, points, partitions=(), method="florg", **config):
    settings = {"method": method, "round-mode": mode, "seed": seed, "virtual-clock": True,
                "min-available-nodes": 20, **FIXED, **config}  # fmt: skip
    return Curve(method, mode, seed, rows(points, partitions), settings)


SYNC = curve("sync", 0, [(0, 0.5, 0.5), (100, 0.6, 0.6), (200, 0.7, 0.68)])
OVER = curve("sync-overselect", 0, [(0, 0.5, 0.5), (50, 0.65, None), (120, 0.72, 0.7)])
BUFFERED = curve("async", 0, [(0, 0.5, 0.5), (40, 0.71, 0.69), (90, 0.73, 0.71)],
                 **{"async-server-lr": 1.0})  # fmt: skip


def test_the_time_axis_is_virtual_where_rows_carry_it():
    assert SYNC.time_key == "virtual-seconds" and SYNC.end() == 200
    assert SYNC.validation()[0] == (0.0, 0.5)  # round 0: virtual now 0, not its wall clock
    pair = compare(SYNC, BUFFERED)
    assert pair.time_ratio == pytest.approx(40 / 200) and pair.reached
    assert pair.test_difference == pytest.approx(0.71 - 0.68)  # its last test by t = 200
    wall = Curve("florg", "sync", 0, [{"round": 0, "elapsed-seconds": 5.0, "score": 0.5}])
    assert wall.time_key == "elapsed-seconds" and wall.end() == 5.0


def test_each_mode_is_compared_with_its_reference():
    pair = compare(OVER, BUFFERED)  # async against sync with over-selection
    assert (pair.mode, pair.reference) == ("async", "sync-overselect")
    assert pair.time_ratio == pytest.approx(90 / 120) and pair.within(1.0)
    over = compare(SYNC, OVER)
    assert over.time_ratio == pytest.approx(120 / 200) and not over.within_half
    text = report([SYNC, OVER, BUFFERED])
    for heading in ("async against sync:", "sync-overselect against sync:",
                    "async against sync-overselect:"):  # fmt: skip
        assert heading in text
    assert "| seeds there sooner |" in text and "| seeds there in at most half |" in text
    assert "| florg | 1 | 0.750 | 1 of 1 |" in text  # async / over-selection's time


def test_the_lengths_count_the_tasks_sent_and_the_replies_applied():
    over = curve("sync-overselect", 0, [(0, 0.5, 0.5), (50, 0.6, 0.6)])
    over.rows[1]["sent"] = 13  # 13 sent, 10 applied: 3 late ones discarded
    buffered = curve("async", 0, [(0, 0.5, 0.5), (40, 0.7, 0.7)])
    buffered.rows[1]["in-flight"] = 10
    text = lengths([buffered, over, SYNC])
    sync_row, over_row, async_row = text.splitlines()[2:]  # sync, over-selection, async
    assert "virtual time (min)" in text and "wall clock" not in text
    assert over_row == "| florg | sync-overselect | 1 | 0.8 | 13.0 | 10.0 | 0.600 | 0.600 |"
    assert async_row.startswith("| florg | async | 1 | 0.7 | 20.0 | 10.0 |")
    assert sync_row.startswith("| florg | sync | 1 | 3.3 | 20.0 | 20.0 |")


def test_the_slow_nodes_share_of_applied_updates_with_fixed_speeds():
    applied = [[0, 1, 2, 3], [4, 5, 6, 7]]  # 2 of 8 from slow partitions 0 and 4
    run = curve("async", 0, [(0, 0.5, 0.5), (10, 0.6, 0.6), (20, 0.6, 0.6)], applied)
    assert slow_partitions(run.config, 20) == SLOW
    assert run.slow_share() == pytest.approx(2 / 8)
    text = slow_shares([run])
    assert "| florg | async | 1 | 0.250 | 0.250 |" in text


def test_the_slow_nodes_under_lognormal_speeds_are_the_slowest_quarter():
    config = {"seed": 3, "node-speeds": "lognormal", "node-speed-sigma": 1.0}
    slow = slow_partitions(config, 20)
    drawn = {p: lognormal_multiplier(3, p, 1.0) for p in range(20)}  # the nodes' own draw
    assert len(slow) == 5
    assert min(drawn[p] for p in slow) > max(drawn[p] for p in set(drawn) - slow)
    other = slow_partitions({**config, "seed": 4}, 20)
    assert other != slow  # drawn from the run's seed
    run = Curve("fedit", "sync", 3, rows([(0, 0.5, 0.5), (9, 0.6, 0.6)], [sorted(slow)]),
                {**config, "min-available-nodes": 20})  # fmt: skip
    assert run.slow_share() == 1.0


def write_run(folder: Path, c: Curve) -> None:
    folder.mkdir(parents=True)
    (folder / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in c.rows))
    (folder / "summary.json").write_text(json.dumps({"status": "finished"}))
    (folder / "config.json").write_text(json.dumps(dict(c.config)))


def tuning_runs(rates_scores: dict[float, float], method="florg") -> list[Curve]:
    """Seed 0's async runs, each ending on three validated updates at its score."""
    return [
        curve("async", 0, [(0, 0.5, 0.5), (30, s, s), (60, s, s), (90, s, s)], method=method,
              **{"async-server-lr": rate})
        for rate, s in rates_scores.items()
    ]  # fmt: skip


def test_the_server_rate_is_chosen_on_seed_0_s_validation():
    runs = tuning_runs({0.5: 0.6, 1.0: 0.7, 2.0: 0.7})  # a tie goes to the smaller rate
    assert choose_rates(runs, [0.5, 1.0, 2.0])[0] == {"florg": 1.0}
    assert choose_rates(runs[:2], [0.5, 1.0, 2.0])[0] == {}  # 2.0 not finished yet
    seeds = [curve("async", s, [(0, 0.5, 0.5), (40, 0.7, 0.7)], **{"async-server-lr": 2.0})
             for s in (1, 2)]  # fmt: skip
    kept = main_runs([*runs, *seeds])  # the main rate: most seeds (2.0: seeds 0, 1, 2)
    assert sorted((c.seed, c.server_rate()) for c in kept) == [(0, 2.0), (1, 2.0), (2, 2.0)]


def test_the_report_and_the_choice_on_runs_on_disk(tmp_path: Path, capsys):
    runs = [SYNC, OVER, *tuning_runs({0.5: 0.6, 1.0: 0.75, 2.0: 0.7})]
    for i, c in enumerate(runs):
        write_run(tmp_path / "runs" / f"r{i}", c)
    curves = load_curves(tmp_path / "runs")
    assert len(pairs(curves)) == 1  # async at its main rate only
    record = tmp_path / "server-rate.json"
    assert main([str(tmp_path / "runs"), "--choose-rate", "0.5", "1", "2",
                 "--write", str(record)]) == 0  # fmt: skip
    assert capsys.readouterr().out == "florg 1.0\n"
    assert json.loads(record.read_text())["choices"] == {"florg": 1.0}
    assert main([str(tmp_path / "runs"), "--choose-rate", "0.5", "1", "4"]) == 1
    assert main([str(tmp_path / "runs"), "--plot", str(tmp_path / "p.png")]) == 0
    out = capsys.readouterr().out
    assert "| florg | 1 | 0.250 | 1 of 1 |" in out  # async at 1.0 against over-selection
    assert "| florg | 0.6000 | 0.7500 | 0.7000 | 1 |" in out  # the rates' scores, the choice
    assert (tmp_path / "p.png").stat().st_size > 0
    assert plot(curves, tmp_path / "q.png").exists()


def test_the_published_wall_clock_report_is_unchanged():
    """The published runs' report: async against sync and the wall-clock lengths, as the
    docs' block shows them (results_doc --check compares the block itself)."""
    curves = load_curves(ROOT / "lab/evidence/async-stragglers/runs/async-stragglers")
    text = report(curves)
    assert all(c.time_key == "elapsed-seconds" for c in curves)
    page = (ROOT / "docs" / "async.md").read_text()
    assert text in page and "wall clock (min)" in text and "virtual" not in text


@pytest.mark.parametrize("name", ["stragglers-virtual", "stragglers-virtual-lognormal"])
def test_the_grids_list_their_runs_at_matched_work(name: str, tmp_path: Path, capsys):
    assert grid_cli(["list", name, "--out", str(tmp_path)]) == 0
    listed = capsys.readouterr().out.splitlines()
    assert len(listed) == 34 and all(line.startswith("todo  ") for line in listed)
    grid = load_grid(name)
    assert all(r.overrides["virtual-clock"] is True for r in grid.runs)
    for run in grid.runs:
        o = run.overrides
        mode, rounds = o["round-mode"], o["num-server-rounds"]
        per_round = 20 if mode == "sync" else 10  # every node; K; the buffer
        assert rounds * per_round == 200, run.run_id
        if mode == "sync-overselect":
            assert (o["fraction-train"], o["min-train-nodes"], o["overselect-fraction"]) == (
                0.5, 10, 0.3)  # fmt: skip
    seeds = {(r.overrides["method"], r.overrides["round-mode"], r.overrides["seed"])
             for r in grid.runs}  # fmt: skip
    assert len(seeds) == 2 * 3 * 5
    tuning = [r for r in grid.runs if "round-mode=async,seed=0," in r.run_id]  # the runner's --only
    assert sorted(r.overrides["async-server-lr"] for r in tuning) == [0.5, 0.5, 1.0, 1.0, 2.0, 2.0]


@pytest.mark.parametrize("name", ["stragglers-virtual", "stragglers-virtual-lognormal"])
def test_the_runner_fills_the_chosen_rate_placeholder(name: str, tmp_path: Path):
    """The sed of lab/scripts/evidence_stragglers_virtual.sh's choose_rate, on a copy."""
    script = (ROOT / "lab/scripts/evidence_stragglers_virtual.sh").read_text()
    pattern = re.search(r'sed -i -E "(s/.*)" "\$file"', script).group(1)
    copy = tmp_path / f"{name}.yaml"
    copy.write_text((GRIDS_DIR / f"{name}.yaml").read_text())
    for method, rate in (("florg", "2.0"), ("fedit", "0.5")):
        command = pattern.replace("$method", method).replace("$rate", rate).replace("\\$", "$")
        subprocess.run(["sed", "-i", "-E", command, str(copy)], check=True)
    grid = load_grid(copy)
    main_rates = {(r.overrides["method"], r.overrides["async-server-lr"]) for r in grid.runs
                  if r.overrides["round-mode"] == "async" and r.overrides["seed"] == 3}  # fmt: skip
    assert main_rates == {("florg", 2.0), ("fedit", 0.5)}
