"""The evidence protocol: the grid's tuning stage, the held-out test split, the test
rounds and the evidence report (summary.json schema, paired intervals, verdicts)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from florg_lab.evidence import collect_methods, write_evidence
from florg_lab.grid import GRIDS_DIR, TUNING_BLOCK, GridError, load_grid
from florg_lab.runs import is_finished, run_dir
from florg_lab.tuning import (
    choose_tuned,
    load_choices,
    selection_score,
    tuning_markdown,
)
from flower_app.data.loading import load_task_splits, load_task_test
from flower_app.data.tasks import resolve_task
from flower_app.environment import environment_label
from flower_app.settings.config import resolve_config

GRID = """
name: ev
simulation: {num-supernodes: 2}
base: {max-test-examples: 40, num-server-rounds: 4}
tuning: {key: learning-rate, values: [0.001, 0.002], seed: 0, per: [task, method]}
grid:
  task: [movie-sentiment]
  method: [florg, fedit]
  seed: [0, 1, 2]
"""


def _fake_run(out: Path, run, val: list[float], test: list[float]) -> None:
    """A finished run folder as the ServerApp writes it (rounds 0..4)."""
    folder = run_dir(out, run)
    folder.mkdir(parents=True)
    config = resolve_config({}, run.overrides).as_dict()
    (folder / "config.json").write_text(json.dumps(config))
    rows = [
        {
            "round": i,
            "score": v,
            "test-score": t,
            "cum-up-params": 10 * i,
            "cum-down-params": 10 * i,
        }
        for i, (v, t) in enumerate(zip(val, test, strict=True))
    ]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = {
        "status": "finished",
        "final-test-score": test[-1],
        "final-test-loss": round(1.0 - test[-1], 6),  # a loss that falls as the score rises
        "test-last3": sum(test[-3:]) / 3,
        "rounds": 4,
        "total-params": 80 if run.overrides["method"] == "florg" else 160,
    }
    (folder / "summary.json").write_text(json.dumps(summary))


def test_tuning_stage_chooses_on_validation_and_unlocks_the_seeds(tmp_path):
    path = tmp_path / "ev.yaml"
    path.write_text(GRID)
    grid = load_grid(path)
    assert [r.run_id for r in grid.runs] == [
        "learning-rate=0.001,method=florg,seed=0,task=movie-sentiment",
        "learning-rate=0.002,method=florg,seed=0,task=movie-sentiment",
        "learning-rate=0.001,method=fedit,seed=0,task=movie-sentiment",
        "learning-rate=0.002,method=fedit,seed=0,task=movie-sentiment",
    ]
    assert all(r.blocks == (TUNING_BLOCK,) for r in grid.runs)
    assert len(grid.pending_combos) == 2 and grid.expected_runs == 2 * (2 + 3 - 1)
    out = tmp_path / "out"
    # florg: 0.002 is better on validation's last 3 rounds, though worse on test (never used)
    scores = {
        ("florg", 0.001): ([0.5, 0.6, 0.6, 0.6, 0.6], [0.5, 0.9, 0.9, 0.9, 0.9]),
        ("florg", 0.002): ([0.5, 0.1, 0.7, 0.7, 0.7], [0.5, 0.6, 0.6, 0.6, 0.6]),
        ("fedit", 0.001): ([0.5, 0.6, 0.6, 0.6, 0.6], [0.5, 0.6, 0.6, 0.6, 0.6]),
    }
    for run in grid.runs:
        key = (run.overrides["method"], run.overrides["learning-rate"])
        if key in scores:
            _fake_run(out, run, *scores[key])
    document = choose_tuned(grid, out)
    assert document["choices"] == {"method=florg,task=movie-sentiment": 0.002}  # fedit waits
    assert load_choices(out) == document["choices"]
    tuned = load_grid(path, load_choices(out))
    florg_runs = [r for r in tuned.runs if r.overrides["method"] == "florg"]
    main = [r for r in florg_runs if "main" in r.blocks]
    assert [r.overrides["seed"] for r in main] == [0, 1, 2]
    assert all(r.overrides["learning-rate"] == 0.002 for r in main)
    # the tuning run at the chosen value is seed 0's grid run: one run, two blocks
    assert main[0].blocks == (TUNING_BLOCK, "main") and is_finished(run_dir(out, main[0]), main[0])
    assert tuned.pending_combos == ("method=fedit,task=movie-sentiment",)


def test_selection_score_needs_three_scored_rounds():
    assert selection_score([{"round": 0, "score": 0.9}, {"round": 1, "score": 0.5}]) is None
    rows = [{"round": i, "score": s} for i, s in enumerate([0.9, 0.1, 0.2, 0.3, 0.4])]
    assert selection_score(rows) == pytest.approx(0.3)


@pytest.mark.parametrize(
    ("tuning", "message"),
    [
        ("{key: learning-rate, values: [], seed: 0, per: [task, method]}", "non-empty"),
        ("{key: seed, values: [1], seed: 0, per: [task, method]}", "that can be tuned"),
        ("{key: learning-rate, values: [0.1], seed: 0, per: [task]}", "per"),
        ("{key: learning-rate, values: [0.1], per: [task, method]}", "missing seed"),
    ],
)
def test_bad_tuning_sections_are_refused(tmp_path, tuning, message):
    path = tmp_path / "bad.yaml"
    path.write_text(GRID.replace(GRID.split("\n")[4], f"tuning: {tuning}"))
    with pytest.raises(GridError, match=message):
        load_grid(path)


def test_tuning_table_marks_a_choice_at_an_end_of_the_range():
    def entry(scores: list[float], chosen: float | None) -> dict:
        table = {repr(v): s for v, s in zip([5e-4, 1e-3, 2e-3], scores, strict=True)}
        return {"scores": table, **({} if chosen is None else {"chosen": chosen})}

    document = {
        "key": "lr",
        "values": [5e-4, 1e-3, 2e-3],
        "table": {
            "a": entry([0.6, 0.7, 0.8], 2e-3),
            "b": entry([0.8, 0.7, 0.6], 5e-4),
            "c": entry([0.6, 0.8, 0.7], 1e-3),
            "d": {"scores": {repr(5e-4): 0.6}},
        },
    }
    rows = {line.split(" | ")[0].strip("| "): line for line in tuning_markdown(document)[2:]}
    assert rows["a"].endswith("| 0.002 (largest tried) |")
    assert rows["b"].endswith("| 0.0005 (smallest tried) |")
    assert rows["c"].endswith("| 0.8000 | 0.7000 | 0.001 |")
    assert rows["d"].endswith("| 0.6000 | – | – | – |")


def _finished_grid(tmp_path: Path):
    """The GRID tuned (0.001 for both) and run: FLoRG 0.80 / 0.81 / 0.78 on test at seeds
    0 / 1 / 2, FedIT 0.70 / 0.71 / 0.68."""
    path = tmp_path / "ev.yaml"
    path.write_text(GRID)
    out = tmp_path / "out"
    grid = load_grid(path)
    for run in grid.runs:  # every tuning run: florg wins on validation at 0.001, fedit too
        good = run.overrides["learning-rate"] == 0.001
        val = [0.5, 0.7, 0.7, 0.7, 0.7] if good else [0.5, 0.6, 0.6, 0.6, 0.6]
        test = (
            [0.5, 0.8, 0.8, 0.8, 0.8] if run.overrides["method"] == "florg" else [0.5] + [0.7] * 4
        )
        _fake_run(out, run, val, test)
    grid = load_grid(path, choose_tuned(grid, out)["choices"])
    offsets = {1: 0.01, 2: -0.02}
    for run in grid.runs:
        seed = run.overrides["seed"]
        if seed == 0:
            continue
        base = 0.8 if run.overrides["method"] == "florg" else 0.7
        test = [0.5] + [base + offsets[seed]] * 4
        _fake_run(out, run, [0.5, 0.6, 0.6, 0.6, 0.6], test)
    return grid, out


def test_evidence_report_pairs_seeds_and_writes_the_schema(tmp_path):
    grid, out = _finished_grid(tmp_path)
    machine = {"cpu": "CPU A", "cpu-flags": ["avx2"], "cpu-count": 2, "torch": "2.13.0"}
    for run in grid.runs:  # FLoRG's runs recorded their machine, FedIT's predate it
        if run.overrides["method"] == "florg" and run_dir(out, run).is_dir():
            path = run_dir(out, run) / "summary.json"
            path.write_text(json.dumps(json.loads(path.read_text()) | {"environment": machine}))
    report = write_evidence(grid, out).read_text()
    machines = f"{environment_label(machine)} (3 runs); not recorded (3 runs, from commits"
    assert f"Machines the runs recorded: {machines}" in report
    summary = json.loads((out / "evidence" / "summary.json").read_text())
    task = summary["tasks"]["movie-sentiment"]
    assert task["test_examples"] == 40
    assert 0.5 <= task["chance"] < 1.0
    florg = task["methods"]["florg"]
    assert florg == {
        "lr": 0.001,
        "seeds": [0, 1, 2],
        "test_final": [0.8, 0.81, 0.78],
        "test_last3": pytest.approx([0.8, 0.81, 0.78]),
        "test_loss_final": [0.2, 0.19, 0.22],
    }
    assert task["methods"]["fedit"]["seeds"] == [0, 1, 2]
    above = sum(florg["test_final"]) / 3 - task["chance"]
    assert f"| {above:+.4f} |" in report  # FLoRG's mean final score above chance
    # paired differences are exactly 0.1 on every seed: a zero-width interval above 0
    row = "| FLoRG beats fedit | movie-sentiment | test final, 3 seeds | 0.1000 [0.1000, 0.1000] |"
    assert f"{row} holds |" in report
    assert "FLoRG sends less than half of FedIT" in report
    factor = "| FLoRG sends less than fedit | movie-sentiment | parameters per round, fedit / FLoRG"
    assert f"{factor} | 2.00x (exact count) | holds |" in report
    # the numbers behind the per-round plot: mean over the three seeds at every round
    assert "| method | round 0 | round 1 | round 2 | round 3 | round 4 |" in report
    assert "| florg | 0.500 | 0.797 | 0.797 | 0.797 | 0.797 |" in report
    assert "| fedit | 0.500 | 0.697 | 0.697 | 0.697 | 0.697 |" in report
    # the held-out loss beside the score: FLoRG's is 0.1 lower than FedIT's on every seed
    loss = report.split("## Held-out loss (lower is better)")[1].split("## Verdicts")[0]
    assert "| florg | 3 | 0.2033 [0.1654, 0.2413] | – | – |" in loss
    assert "| fedit | 3 | 0.3033 [0.2654, 0.3413] | -0.1000 [-0.1000, -0.1000] | 3/3 |" in loss
    assert (out / "plots" / "evidence_forest.png").read_bytes()[:4] == b"\x89PNG"


def test_one_report_over_two_tasks_grids_names_both_settings_and_tunes_each_apart(tmp_path):
    """Protocol v2's report joins movie sentiment's grid and SNLI's (run in worktrees of
    their own): the header names the joined grid's setting, and each task's methods carry
    the rate chosen by their own grid's tuning."""
    grid, out = _finished_grid(tmp_path)
    snli_path = tmp_path / "ev-snli.yaml"
    snli_path.write_text(
        GRID.replace("name: ev", "name: ev-snli")
        .replace("task: [movie-sentiment]", "task: [snli]")
        .replace("tuning:", "description: the SNLI grid's own setting\ntuning:")
    )
    snli_out = tmp_path / "snli-worktree"
    snli = load_grid(snli_path)
    for run in snli.runs:  # on SNLI both methods choose 0.002
        good = run.overrides["learning-rate"] == 0.002
        _fake_run(snli_out, run, [0.4] + [0.6 if good else 0.5] * 4, [0.34] + [0.6] * 4)
    snli = load_grid(snli_path, choose_tuned(snli, snli_out)["choices"])
    for run in snli.runs:
        if run.overrides["seed"] > 0:
            _fake_run(snli_out, run, [0.4] + [0.6] * 4, [0.34] + [0.6] * 4)
    report = write_evidence(grid, out, [(snli, snli_out)]).read_text()
    header = report.split("## Tuning")[0]
    assert "With `ev-snli` (snli): the SNLI grid's own setting" in header
    assert "## Tuning of `ev-snli` (validation score, seed 0)" in report
    tasks = json.loads((out / "evidence" / "summary.json").read_text())["tasks"]
    assert set(tasks) == {"movie-sentiment", "snli"}
    assert tasks["movie-sentiment"]["methods"]["florg"]["lr"] == 0.001
    assert tasks["snli"]["methods"]["florg"]["lr"] == 0.002
    assert tasks["snli"]["methods"]["fedit"]["test_final"] == [0.6, 0.6, 0.6]
    assert "| FLoRG beats fedit | snli | test final, 3 seeds |" in report
    # through the CLI, repeated --with flags add up (publish_evidence_v2.sh passes three)
    from florg_lab.__main__ import _parser

    args = _parser().parse_args(
        ["evidence", "ev", "--with", f"{snli_path}={snli_out}", "--with", "b", "c"]
    )
    assert args.others == [f"{snli_path}={snli_out}", "b", "c"]
    # a joined grid of a task already in the report (a variants grid) adds no header line
    report = write_evidence(grid, out, [(snli, snli_out), (snli, snli_out)]).read_text()
    assert report.split("## Tuning")[0].count("With `") == 1


def test_a_seeded_centralised_reference_and_the_learning_bars(tmp_path):
    grid, out = _finished_grid(tmp_path)
    (out / "centralised.json").write_text(
        json.dumps({"tasks": {"movie-sentiment": {"test-score": 0.99}}})
    )
    seeded = tmp_path / "centralised-reference.json"
    seeded.write_text(json.dumps({"tasks": {"movie-sentiment": {
        "test-score": 0.9, "test-interval": [0.85, 0.95], "reference-method": "fedit",
        "seeds": [0, 1, 2], "methods": {"fedit": {"learning-rate": 0.002}},
    }}}))  # fmt: skip
    report = write_evidence(grid, out).read_text()
    assert "centralised reference: 0.9900 (one run)" in report
    report = write_evidence(grid, out, centralised_files=[seeded]).read_text()
    summary = json.loads((out / "evidence" / "summary.json").read_text())
    task = summary["tasks"]["movie-sentiment"]
    chance = task["chance"]
    assert task["centralised"] == 0.9 and task["centralised_interval"] == [0.85, 0.95]
    label = "fedit's adapter, lr 0.002 chosen on validation, 3 seeds"
    assert f"centralised reference: 0.9000 [0.8500, 0.9500] ({label})" in report
    learning = report.split("## Learning")[1].split("## ")[0]
    above = 0.9 - chance
    assert (
        f"| movie-sentiment | centralised reference ({label}) | {above:+.4f} "
        f"[{0.85 - chance:+.4f}, {0.95 - chance:+.4f}] | mean ≥ 0.25 | "
        f"{'yes' if above >= 0.25 else 'no'} |"
    ) in learning
    # FLoRG 0.80 / 0.81 / 0.78: mean 0.79667, sd 0.015275, t_{0.975, 2} = 4.302653
    half = 4.302653 * 0.0152753 / 3**0.5
    mean = 0.7966667 - chance
    florg_row = next(line for line in learning.splitlines() if "| florg |" in line)
    cells = [c.strip() for c in florg_row.strip("|").split("|")]
    assert cells[2] == f"{mean:+.4f} [{mean - half:+.4f}, {mean + half:+.4f}]"
    assert cells[3:] == ["mean ≥ 0.15", "yes" if mean >= 0.15 else "no"]
    fedit_mean = 0.6966667 - chance
    assert f"| mean ≥ 0.15 | {'yes' if fedit_mean >= 0.15 else 'no'} |" in learning
    # a reference whose chosen rate is an end of the rates it tried says so
    entry = json.loads(seeded.read_text())
    entry["tasks"]["movie-sentiment"]["methods"]["fedit"]["tuning"] = {
        "0.0005": 0.7, "0.001": 0.8, "0.002": 0.9
    }  # fmt: skip
    seeded.write_text(json.dumps(entry))
    report = write_evidence(grid, out, centralised_files=[seeded]).read_text()
    assert "lr 0.002 chosen on validation (the largest of 0.0005, 0.001, 0.002 tried)" in report
    entry["tasks"]["movie-sentiment"]["methods"]["fedit"]["learning-rate"] = 0.001
    seeded.write_text(json.dumps(entry))
    report = write_evidence(grid, out, centralised_files=[seeded]).read_text()
    assert "lr 0.001 chosen on validation, 3 seeds" in report


def test_test_split_is_disjoint_from_training_and_validation():
    spec = resolve_task("movie-sentiment")
    train, validation = load_task_splits(spec, seed=0)
    test = load_task_test(spec, 500)
    texts = {row["sentence"] for row in test}
    assert len(test) == 500
    assert not texts & {row["sentence"] for row in train}
    assert not texts & {row["sentence"] for row in validation}
    # the same examples whatever the run seed; and a task without a test split says so
    assert load_task_test(spec, 500)["sentence"] == test["sentence"]
    assert load_task_splits(spec, max_train=50, seed=1)[0]["sentence"] != train["sentence"][:50]
    with pytest.raises(ValueError, match="no held-out test split"):
        load_task_test(resolve_task("mrpc"), 10)


@pytest.mark.parametrize(
    ("every", "rounds", "tested"),
    [(5, 20, [0, 5, 10, 15, 18, 19, 20]), (0, 4, [0, 2, 3, 4]), (3, 6, [0, 3, 4, 5, 6])],
)
def test_test_rounds(every, rounds, tested):
    config = resolve_config(
        {}, {"max-test-examples": 10, "test-every": every, "num-server-rounds": rounds}
    )
    assert [r for r in range(rounds + 1) if config.tests_round(r)] == tested
    assert not resolve_config({}, {}).tests_round(0)  # max-test-examples = 0: no test


def test_the_shipped_evidence_grids_label_their_runs_by_method():
    """The grids pin rank-mismatch and projection-sharing at their defaults: the labels (and
    so the reference FLoRG of the verdict table) stay the method names; an ablation's
    non-default variant is named."""
    from florg_lab.evidence import REFERENCE, method_label

    for name in ("evidence", "evidence-snli"):
        grid = load_grid(GRIDS_DIR / f"{name}.yaml")
        labels = {method_label(run.overrides) for run in grid.runs}
        assert REFERENCE in labels and "fedit" in labels, labels
    assert method_label({"method": "florg", "rank-mismatch": "truncate"}) == (
        "florg rank-mismatch=truncate"
    )


def _fake_personal_run(out: Path, run, val: list[float], test: list[float]) -> None:
    """A FedSA-LoRA run folder: its global model stays at 0.5, its clients' personalised
    models score ``val`` / ``test`` (what the recorder reports for a personal method)."""
    _fake_run(out, run, [0.5] * len(val), [0.5] * len(test))
    folder = run_dir(out, run)
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    for row, v, t in zip(rows, val, test, strict=True):
        row |= {"personalized-val-score": v, "personalized-test-score": t}
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = json.loads((folder / "summary.json").read_text())
    summary |= {
        "final-test-score": test[-1],
        "test-last3": sum(test[-3:]) / 3,
        "test-score-key": "personalized-test-score",
        "val-score-key": "personalized-val-score",
    }
    (folder / "summary.json").write_text(json.dumps(summary))


def test_a_method_from_another_grid_folder_joins_the_report_with_its_reported_keys(tmp_path):
    from florg_lab.__main__ import main

    main_path, fedsa_path = tmp_path / "ev.yaml", tmp_path / "ev-fedsa.yaml"
    main_path.write_text(GRID)
    fedsa_path.write_text(GRID.replace("name: ev", "name: ev-fedsa").replace(
        "method: [florg, fedit]", "method: [fedsa-lora]"))  # fmt: skip
    out, fedsa_out = tmp_path / "out", tmp_path / "elsewhere"
    grid, fedsa = load_grid(main_path), load_grid(fedsa_path)
    for run in grid.runs:
        _fake_run(out, run, [0.5] + [0.6] * 4, [0.5] + [0.8] * 4)
    for run in fedsa.runs:  # validation of the personalised models picks 0.002
        good = run.overrides["learning-rate"] == 0.002
        _fake_personal_run(fedsa_out, run, [0.5] + [0.7 if good else 0.6] * 4, [0.5] + [0.75] * 4)
    fedsa = load_grid(fedsa_path, choose_tuned(fedsa, fedsa_out)["choices"])
    for run in fedsa.runs:
        if run.overrides["seed"] > 0:
            _fake_personal_run(fedsa_out, run, [0.5] + [0.7] * 4, [0.5] + [0.75] * 4)
    grid = load_grid(main_path, choose_tuned(grid, out)["choices"])
    for run in grid.runs:
        if run.overrides["seed"] > 0:
            _fake_run(out, run, [0.5] + [0.6] * 4, [0.5] + [0.8] * 4)
    first = run_dir(out, grid.runs[0])
    (first / "checkpoint" / "round-000004").mkdir(parents=True)
    (first / "checkpoint" / "round-000004" / "arrays.safetensors").write_bytes(b"final")
    published = tmp_path / "docs"
    args = ["evidence", str(main_path), "--out", str(out), "--with", f"{fedsa_path}={fedsa_out}"]
    assert main([*args, "--publish", str(published)]) == 0
    copied = published / "runs" / "ev" / first.name
    # a published run keeps config, metrics and summary only: checkpoints are not published
    published_files = {p.relative_to(copied).as_posix() for p in copied.rglob("*")}
    assert published_files == {"config.json", "metrics.jsonl", "summary.json"}
    assert (published / "runs" / "ev-fedsa").is_dir() and (published / "summary.json").is_file()
    summary = json.loads((out / "evidence" / "summary.json").read_text())
    entry = summary["tasks"]["movie-sentiment"]["methods"]["fedsa-lora"]
    assert entry["lr"] == 0.002 and entry["seeds"] == [0, 1, 2]
    assert entry["test_final"] == [0.75, 0.75, 0.75]
    report = (out / "evidence.md").read_text()
    assert "| FLoRG beats fedsa-lora | movie-sentiment | test final, 3 seeds |" in report
    curves = collect_methods(grid, out, [(fedsa, fedsa_out)])["movie-sentiment"]
    assert curves["fedsa-lora"].curves[1] == [(0, 0.5)] + [(t, 0.75) for t in range(1, 5)]
    assert curves["florg"].curves[1] == [(0, 0.5)] + [(t, 0.8) for t in range(1, 5)]


def test_each_paired_difference_is_named_by_the_claim_it_decides():
    from florg_lab.evidence import _claim

    assert _claim("fedit") == "FLoRG beats fedit"
    assert _claim("florg-no-procrustes") == "Procrustes helps (FLoRG − no Procrustes)"
    assert _claim("florg rank-mismatch=truncate") == (
        "rank-mismatch: the paper's Procrustes over all r' rows beats truncate"
    )


SERVER_GRID = """
name: ev-server
simulation: {num-supernodes: 2}
base: {max-test-examples: 40, num-server-rounds: 4, learning-rate: 0.001}
grid:
  task: [movie-sentiment]
  method: [florg, florg-no-procrustes]
  seed: [0, 1, 2]
"""


def test_the_report_tabulates_florgs_server_step_per_variant(tmp_path):
    """Each run's Gram error and drift are averaged over its rounds, then over seeds; the
    paired difference FLoRG − variant uses the seeds both have."""
    path = tmp_path / "ev-server.yaml"
    path.write_text(SERVER_GRID)
    out = tmp_path / "out"
    grid = load_grid(path)
    for run in grid.runs:
        seed, plain = run.overrides["seed"], run.overrides["method"] == "florg"
        _fake_run(out, run, [0.5] * 5, [0.5] + [0.7] * 4)
        folder = run_dir(out, run)
        rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
        for row in rows[1:]:  # round 0 has no server step
            # rounds 1-4 average to 0.1 + 0.01 seed (FLoRG) and 0.2 + 0.01 seed (variant)
            wobble = 0.01 * (row["round"] - 2.5)  # averages to 0 over the rounds
            row["gram_rel_error"] = (0.1 if plain else 0.2) + 0.01 * seed + wobble
            row["drift"] = (0.3 if plain else 0.5) + 0.01 * seed
        (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    report = write_evidence(grid, out).read_text()
    server = report.split("## FLoRG's server step", 1)[1]
    assert "| florg | 3 | 0.1100 [0.0852, 0.1348] | 0.3100 [0.2852, 0.3348] | – | – |" in server
    assert (
        "| florg-no-procrustes | 3 | 0.2100 [0.1852, 0.2348] | 0.5100 [0.4852, 0.5348] | "
        "-0.1000 [-0.1000, -0.1000] (3 seeds) | -0.2000 [-0.2000, -0.2000] (3 seeds) |"
    ) in server


def test_a_report_without_server_diagnostics_says_so(tmp_path):
    path = tmp_path / "ev.yaml"
    path.write_text(SERVER_GRID)
    out = tmp_path / "out"
    grid = load_grid(path)
    for run in grid.runs:
        _fake_run(out, run, [0.5] * 5, [0.5] + [0.7] * 4)
    report = write_evidence(grid, out).read_text()
    assert "## FLoRG's server step\n\nNo run of this report recorded" in report


def _with_rank_communication(folder: Path, ranks: dict[int, tuple[float, float]]) -> None:
    """Add the per-client communication keys of a round with mixed ranks
    (``LoRAStrategyBase.rank_communication``) to every training round of a run."""
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    for row in rows[1:]:
        row["up-params-per-client"] = sum(up for up, _ in ranks.values()) / len(ranks)
        row["down-params-per-client"] = sum(down for _, down in ranks.values()) / len(ranks)
        for rank, (up, down) in ranks.items():
            row[f"up-params-r{rank}"], row[f"down-params-r{rank}"] = up, down
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_a_labelled_reference_grid_and_the_communication_by_client_rank(tmp_path):
    """Issue 30's report: the heterogeneous grid's FLoRG is the reference; the homogeneous
    references come from a grid whose ``report.label`` keeps its florg apart from it; the
    per-rank parameter counts are tabulated per method."""
    main_path, refs_path = tmp_path / "het.yaml", tmp_path / "refs.yaml"
    main_path.write_text(GRID.replace("name: ev", "name: het").replace(
        "method: [florg, fedit]", "method: [florg, hetlora]"))  # fmt: skip
    refs_path.write_text(GRID.replace("name: ev", "name: refs")
                         + "report: {label: '(homogeneous r = 4)'}\n")  # fmt: skip
    out, refs_out = tmp_path / "het", tmp_path / "refs"
    for path, folder, scores in ((main_path, out, {"florg": 0.8, "hetlora": 0.7}),
                                 (refs_path, refs_out, {"florg": 0.6, "fedit": 0.75})):  # fmt: skip
        grid = load_grid(path)
        for run in grid.runs:
            _fake_run(folder, run, [0.5] + [0.6] * 4, [0.5] + [scores[run.overrides["method"]]] * 4)
        grid = load_grid(path, choose_tuned(grid, folder)["choices"])
        for run in grid.runs:
            if run.overrides["seed"] > 0:
                test = [0.5] + [scores[run.overrides["method"]] + 0.01 * run.overrides["seed"]] * 4
                _fake_run(folder, run, [0.5] + [0.6] * 4, test)
            if folder == out:
                up = {"florg": (10.0, 20.0), "hetlora": (19.0, 38.0)}[run.overrides["method"]]
                _with_rank_communication(run_dir(folder, run), {2: up, 8: (4 * up[0], 4 * up[1])})
        if folder == out:
            main_grid = grid
        else:
            refs_grid = grid
    assert load_grid(refs_path).label == "(homogeneous r = 4)"
    methods = collect_methods(main_grid, out, [(refs_grid, refs_out)])["movie-sentiment"]
    assert set(methods) == {"florg", "hetlora", "florg (homogeneous r = 4)",
                            "fedit (homogeneous r = 4)"}  # fmt: skip
    assert methods["florg"].test_final == pytest.approx([0.8, 0.81, 0.82])
    assert methods["florg (homogeneous r = 4)"].test_final == pytest.approx([0.6, 0.61, 0.62])
    report = write_evidence(main_grid, out, [(refs_grid, refs_out)]).read_text()
    assert (
        "| FLoRG beats florg (homogeneous r = 4) | movie-sentiment | test final, 3 seeds |"
        in report
    )
    assert "| FLoRG beats hetlora | movie-sentiment | test final, 3 seeds |" in report
    assert "## Communication by client rank" in report
    assert "| method | per-client up / down | r2 up / down | r8 up / down |" in report
    assert "| florg | 25 / 50 | 10 / 20 | 40 / 80 |" in report
    assert "| hetlora | 48 / 95 | 19 / 38 | 76 / 152 |" in report  # 47.5 rounds to 48
    assert (
        "fedit (homogeneous r = 4) |"
        not in report.split("## Communication by client rank")[1].split("##")[0]
    )


def test_a_report_label_with_a_pipe_is_refused(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(GRID + "report: {label: 'a | b'}\n")
    with pytest.raises(GridError, match="report.label"):
        load_grid(path)


def test_a_generative_task_has_no_chance_level_and_its_report_says_so():
    from florg_lab.evidence import (
        MethodRuns,
        _chance,
        _learning_lines,
        _loss_lines,
        _task_lines,
    )

    assert _chance("squad-gen", 200) is None  # answers, not classes: nothing to guess
    runs = MethodRuns(
        lr=0.001, seeds=[0], test_final=[0.53], test_last3=[0.52], curves={0: [(0, 0.1)]},
        params_per_round=None, test_loss=[0.89],
    )  # fmt: skip
    info = {"chance": None, "centralised": None, "test_examples": 200}
    # its response loss is reported beside gen-F1; a method without one is left out
    unscored = dataclasses.replace(runs, test_loss=[None])
    loss = _loss_lines("squad-gen", {"florg": runs, "fedit": unscored})
    assert "| florg | 1 | 0.8900 (n = 1) | – | – |" in loss
    assert not any(line.startswith("| fedit") for line in loss)
    assert _loss_lines("squad-gen", {"fedit": unscored}) == []
    report = "\n".join(_task_lines("squad-gen", info, {"florg": runs}))
    assert "Chance: none (not a classification task)" in report
    assert "| florg | 0.001 | 1 | 0.5300 (n = 1) | 0.5200 (n = 1) | – |" in report
    learning = _learning_lines({"tasks": {"squad-gen": info}}, {"squad-gen": {"florg": runs}})
    assert "| squad-gen | – | no chance level (not a classification task) | – | – |" in learning
