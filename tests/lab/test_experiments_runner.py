"""The experiment-grid runner: grid files, a 2-run grid through the real simulation engine
(resume included), the aggregation, the communication-to-target table and the plots."""

from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path

import pytest

from florg_lab.__main__ import main as grid_cli
from florg_lab.__main__ import write_report
from florg_lab.aggregate import (
    RunResult,
    collect,
    communication_lines,
    markdown_report,
)
from florg_lab.grid import GridError, GridRun, load_grid
from florg_lab.runner import APP_DIR, run_grid
from florg_lab.runs import is_finished, run_dir
from florg_tools.provenance import checkout_commit
from florg_tools.synthetic import make_sentiment_task
from flower_app.environment import describe_environment, environment_label

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def write_grid(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


# ---------------------------------------------------------------- grid files


def test_blocks_share_runs_and_ids_name_non_base_values(tmp_path):
    grid = load_grid(
        write_grid(
            tmp_path / "g.yaml",
            """
name: ablate
base: {method: florg, rank: 4, task: movie-sentiment}
grid: {seed: [0, 1]}
blocks:
  rank: {rank: [2, 4, 8]}
  procrustes: {method: [florg, florg-no-procrustes]}
report: {compare: [procrustes], targets: {movie-sentiment: 0.6}}
""",
        )
    )
    ids = [run.run_id for run in grid.runs]
    assert ids == ["seed=0", "seed=1", "rank=2", "base", "rank=8", "method=florg-no-procrustes"]
    shared = next(run for run in grid.runs if run.run_id == "base")
    assert shared.blocks == ("rank", "procrustes")  # rank=4 and method=florg: one run
    assert shared.overrides == {"method": "florg", "rank": 4, "task": "movie-sentiment"}
    assert grid.targets == {"movie-sentiment": 0.6}
    assert grid.compare == ("procrustes",)
    assert [r.run_id for r in grid.runs_in("rank")] == ["rank=2", "base", "rank=8"]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("base: {rnak: 4}\ngrid: {seed: [0]}", "rnak"),
        ("grid: {rank: [0]}", "rank"),
        ("grid: {method: [florg, fedavg]}", "method"),
        ("base: {output-dir: x}\ngrid: {seed: [0]}", "output-dir"),
        ("grid: {seed: []}", "empty"),
        ("blocks: {main: {seed: [0]}}", "reserved"),
        ("name: x", "needs `grid` or `blocks`"),
        ("grid: {seed: [0]}\nsimulation: {num-cpus-per-client: 1.5}", "num-cpus-per-client"),
        ("grid: {seed: [0]}\nsimulation: {num-cpus-per-client: 2, ray-num-cpus: 1}", "ray-num"),
        ("grid: {seed: [0]}\nbase: {min-available-nodes: 9}", "num-supernodes"),
        ("grid: {seed: [0]}\nreport: {compare: [nope]}", "nope"),
        ("grid: {seed: [0]}\nrepot: {}", "repot"),
    ],
)
def test_bad_grid_files_are_refused_naming_the_key(tmp_path, text, message):
    with pytest.raises(GridError, match=message):
        load_grid(write_grid(tmp_path / "bad.yaml", text))


def test_ray_num_cpus_reaches_the_simulation_connection(tmp_path):
    """``simulation.ray-num-cpus``: Ray's logical CPUs (``backend.init-args.num-cpus``), so
    more one-CPU actors than cores; absent, the connection leaves Ray its default."""
    from florg_lab.runner import _write_connection
    from florg_tools.flwr_home import read_flower_config

    for text, expected in (("ray-num-cpus: 20, ", {"num-cpus": 20}), ("", None)):
        grid = load_grid(write_grid(
            tmp_path / "g.yaml", f"grid: {{seed: [0]}}\nsimulation: {{{text}num-supernodes: 20}}"
        ))  # fmt: skip
        _write_connection(tmp_path, "127.0.0.1:9093", grid)
        connections = read_flower_config(tmp_path)["superlink"]
        backend = next(c for c in connections.values() if isinstance(c, dict))["options"]["backend"]
        assert backend.get("init-args") == expected


def test_missing_grid_file_lists_the_known_grids(tmp_path):
    with pytest.raises(GridError, match="main"):
        load_grid(tmp_path / "nothing.yaml")


def test_shipped_grids_load():
    grids = sorted((Path(__file__).resolve().parents[2] / "lab" / "grids").glob("*.yaml"))
    assert grids
    for path in grids:
        grid = load_grid(path)
        assert grid.runs, path


# ---------------------------------------------------------------- communication to target


def fake_result(method: str, seed: int, accuracies: list[float], per_round: int) -> RunResult:
    rows = [
        {
            "round": r,
            "accuracy": acc,
            "cum-up-params": per_round * r,
            "cum-down-params": per_round * r,
        }
        for r, acc in enumerate(accuracies)
    ]
    run = GridRun(
        f"method={method},seed={seed}",
        {"method": method, "seed": seed, "task": "t"},
        {"method": method, "seed": seed},
        ("main",),
    )
    return RunResult(run, rows, {"rounds": len(accuracies) - 1})


def test_communication_table_on_hand_made_runs(tmp_path):
    grid = load_grid(
        write_grid(
            tmp_path / "g.yaml",
            "grid: {method: [florg, fedit], seed: [0, 1]}\nreport: {targets: {t: 0.5}}",
        )
    )
    results = [
        # florg reaches 0.5 at round 2 (seed 0: 2 * 2 * 10) and round 1 (seed 1: 2 * 10)
        fake_result("florg", 0, [0.3, 0.4, 0.5, 0.6], 10),
        fake_result("florg", 1, [0.3, 0.55, 0.5, 0.6], 10),
        # fedit reaches it with one seed only: "not reached" with 1/2
        fake_result("fedit", 0, [0.3, 0.4, 0.45, 0.7], 100),
        fake_result("fedit", 1, [0.3, 0.4, 0.45, 0.49], 100),
    ]
    lines = communication_lines(results, grid)
    assert lines[2] == "| t | 0.5 | florg | 3.00e+01 | 2/2 |"  # mean of 40 and 20
    assert lines[3] == "| t | 0.5 | fedit | not reached | 1/2 |"


def test_report_shows_the_change_from_round_0(tmp_path):
    grid = load_grid(
        write_grid(
            tmp_path / "g.yaml",
            "grid: {seed: [0, 1], task: [snli, movie-sentiment], method: [florg, fedit]}",
        )
    )

    def result(method: str, task: str, seed: int, accuracies: list[float]) -> RunResult:
        run = next(
            r for r in grid.runs
            if r.axes == {"method": method, "task": task, "seed": seed}
        )  # fmt: skip
        rows = [{"round": i, "accuracy": a} for i, a in enumerate(accuracies)]
        return RunResult(run, rows, {"rounds": len(rows) - 1})

    results = [
        result("florg", "snli", 0, [0.30, 0.50, 0.40]),  # gain +0.10
        result("florg", "snli", 1, [0.30, 0.45, 0.60]),  # gain +0.30
        result("fedit", "snli", 0, [0.40, 0.35, 0.35]),  # gain -0.05
        result("florg", "movie-sentiment", 0, [0.5, 0.7]),  # gain +0.20
    ]
    assert results[0].initial("accuracy") == 0.30 and results[0].best("accuracy") == 0.50
    assert results[2].gain("accuracy") == pytest.approx(-0.05)
    text = markdown_report(grid, results, [], [], tmp_path)
    finals, gains = text.split("Change from round 0")
    # final accuracy: mean ± sample std over the two florg seeds (0.4, 0.6)
    assert "| florg | 0.7000 (n=1) | 0.5000 ± 0.1414 (n=2) |" in finals
    assert "| fedit | – | 0.3500 (n=1) |" in finals
    # change from round 0: +0.1 and +0.3 -> +0.2000 ± 0.1414; fedit -0.05
    assert "| florg | +0.2000 (n=1) | +0.2000 ± 0.1414 (n=2) |" in gains
    assert "| fedit | – | -0.0500 (n=1) |" in gains


def test_wall_time_counts_runs_copied_in_from_another_worktree(tmp_path):
    """The runner's own times (grid.json) where it ran the run; a published run copied into
    a fresh worktree and skipped is timed by its ServerApp's ``wall-seconds`` instead of
    being dropped (a fresh machine's report said 0 runs in 0 min)."""
    grid = load_grid(write_grid(tmp_path / "g.yaml", "grid: {seed: [0, 1, 2]}"))
    ran_here, copied, untimed = grid.runs
    results = [
        RunResult(ran_here, [], {"wall-seconds": 50.0}),
        RunResult(copied, [], {"wall-seconds": 200.0}),
        RunResult(untimed, [], {}),
    ]
    assert "Wall time: unknown (no grid.json)." in markdown_report(grid, [], [], [], tmp_path)
    (tmp_path / "grid.json").write_text(
        json.dumps({ran_here.run_id: {"status": "finished", "seconds": 100.0}})
    )
    text = markdown_report(grid, results, [], [], tmp_path)
    assert "Wall time: 5.0 min for 2 runs (150 s per run); 1 of them run elsewhere" in text
    only_here = markdown_report(grid, results[:1], [], [], tmp_path)
    assert "Wall time: 1.7 min for 1 runs (100 s per run)." in only_here


# ---------------------------------------------------------------- the runner, end to end


@pytest.fixture(scope="module")
def tiny_grid(tmp_path_factory, tiny_bert_dir):
    base = tmp_path_factory.mktemp("grid")
    model = tiny_bert_dir
    task = make_sentiment_task(base / "task", n_train=120, n_eval=40)
    path = write_grid(
        base / "tiny.yaml",
        f"""
name: tiny
simulation: {{num-supernodes: 2, num-cpus-per-client: 1}}
run-timeout: 400
base:
  model: {model}
  task: local
  data-path: {task}
  text-fields: sentence
  rank: 2
  num-server-rounds: 2
  batch-size: 16
  learning-rate: 0.005
grid:
  method: [florg, fedit]
report:
  targets: {{local: 0.0}}
""",
    )
    return load_grid(path), base / "out"


@pytest.mark.integration
def test_grid_runs_resumes_and_reports(tiny_grid, capfd):
    grid, out = tiny_grid
    # An interrupted run (rows written, no summary): set aside, kept, and run again. Planted
    # rather than made by a third Flower run (CI's time); the runner reads only the folder.
    florg = run_dir(out, grid.runs[0])
    florg.mkdir(parents=True)
    (florg / "metrics.jsonl").write_text(json.dumps({"round": 0, "accuracy": 0.5}) + "\n")
    (florg / "config.json").write_text(json.dumps(grid.runs[0].overrides))
    assert not is_finished(florg, grid.runs[0])

    outcome = run_grid(grid, out, stream=None)
    # the grid's SuperLink is stopped with every process it spawned (launch warns otherwise)
    assert "survived the SuperLink shutdown" not in capfd.readouterr().err
    assert outcome.ok, outcome.failed
    assert sorted(outcome.finished) == ["method=fedit", "method=florg"]
    for run in grid.runs:
        assert is_finished(run_dir(out, run), run)
    state = json.loads((out / "grid.json").read_text())
    assert {v["status"] for v in state.values()} == {"finished"}
    # provenance: the commit the app was at, the machine each run ran on
    assert {v["commit"] for v in state.values()} == {checkout_commit(APP_DIR)} != {None}
    here = environment_label(describe_environment())
    for run in grid.runs:
        recorded = json.loads((run_dir(out, run) / "summary.json").read_text())["environment"]
        assert environment_label(recorded) == here
    kept = list((out / "incomplete").iterdir())
    assert len(kept) == 1 and kept[0].name.startswith("method=florg-")
    assert (kept[0] / "metrics.jsonl").read_text().count("\n") == 1
    assert not (kept[0] / "summary.json").exists()

    # Resume: nothing left to run, so no SuperLink is even started.
    again = run_grid(grid, out, stream=None)
    assert again.finished == [] and sorted(again.skipped) == ["method=fedit", "method=florg"]

    report = write_report(grid, out)
    text = report.read_text()
    assert "| method | final accuracy | change from round 0 | seeds |" in text and "fedit" in text
    assert f"Machines the runs recorded: {here} (2 runs)." in text
    with (out / "results.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert {row["method"] for row in rows} == {"florg", "fedit"}
    results, missing = collect(grid, out)
    assert missing == []
    for row in rows:
        result = next(r for r in results if r.run.run_id == row["run_id"])
        assert float(row["final_accuracy"]) == result.rows[-1]["accuracy"]
        assert row["params_to_target"] == "0"  # target 0.0 is met before training
    for name in ("metric_vs_round", "metric_vs_communication", "final_metric"):
        png = out / "plots" / f"{name}.png"
        assert png.read_bytes()[:8] == PNG_MAGIC, name
        assert f"plots/{name}.png" in text


@pytest.mark.integration
def test_report_command_and_missing_runs(tiny_grid, capsys):
    grid, out = tiny_grid
    copy = out.parent / "partial"
    shutil.copytree(out, copy, dirs_exist_ok=True)
    shutil.rmtree(copy / "runs" / "method=fedit")
    docs = out.parent / "docs"
    assert grid_cli(["report", str(grid.path), "--out", str(copy), "--publish", str(docs)]) == 0
    text = (copy / "results.md").read_text()
    assert (docs / "results.md").read_text() == text
    assert (docs / "plots" / "final_metric.png").exists()
    assert sorted(p.name for p in (docs / "runs" / "method=florg").iterdir()) == [
        "config.json", "metrics.jsonl", "summary.json"
    ]  # fmt: skip
    assert not (docs / "runs" / "method=fedit").exists()
    assert "Runs finished: 1 of 2 (not finished: method=fedit)" in text
    assert grid_cli(["list", str(grid.path), "--out", str(copy)]) == 0
    listed = capsys.readouterr().out
    assert "done  method=florg" in listed and "todo  method=fedit" in listed


def test_a_finished_run_with_other_settings_is_not_finished(tmp_path):
    run = GridRun("method=florg", {"method": "florg", "learning-rate": 0.002}, {}, ("main",))
    (tmp_path / "summary.json").write_text(json.dumps({"status": "finished", "rounds": 2}))
    (tmp_path / "config.json").write_text(json.dumps({"method": "florg", "learning-rate": 0.001}))
    assert not is_finished(tmp_path, run)  # the grid file changed since: run it again
    (tmp_path / "config.json").write_text(json.dumps({"method": "florg", "learning-rate": 0.002}))
    assert is_finished(tmp_path, run)
    (tmp_path / "summary.json").write_text(json.dumps({"status": "failed"}))
    assert not is_finished(tmp_path, run)
