"""Evidence protocol v2's tuning: a choice at an end of the values tried extends them by a
factor until the choice is interior, and the path of values tried is recorded."""

from __future__ import annotations

import json

import pytest

from florg_lab.grid import GridError, load_grid
from florg_lab.tuning import (
    choose_tuned,
    load_candidates,
    next_candidate,
    tuned_grid,
    tuning_markdown,
)
from tests.lab.test_evidence import _fake_run

GRID = """
name: ev2
simulation: {num-supernodes: 2}
base: {max-test-examples: 40, num-server-rounds: 4}
tuning:
  key: learning-rate
  values: [0.001, 0.002]
  seed: 0
  per: [task, method]
  extend: 2
  max-extensions: 2
grid:
  task: [movie-sentiment]
  method: [florg, fedit]
  seed: [0, 1]
"""


def test_next_candidate_extends_past_the_end_the_best_value_sits_at():
    assert next_candidate({1.0: 0.5, 2.0: 0.7}, 2.0, 3) == 4.0
    assert next_candidate({1.0: 0.7, 2.0: 0.5}, 2.0, 3) == 0.5
    assert next_candidate({1.0: 0.5, 2.0: 0.7, 4.0: 0.6}, 2.0, 3) is None  # interior
    assert next_candidate({1.0: 0.5, 2.0: 0.7}, 2.0, 0) is None  # no extension left
    assert next_candidate({1.0: 0.5, 2.0: None}, 2.0, 3) is None  # wait for the run
    assert next_candidate({1.0: 0.5, 2.0: 0.7}, 0.0, 3) is None  # v1: no extension
    assert next_candidate({1.0: 0.6, 2.0: 0.6}, 2.0, 3) == 0.5  # a tie goes to the smaller


def _val(last3: float) -> tuple[list[float], list[float]]:
    return [0.5, last3, last3, last3, last3], [0.5, 0.6, 0.6, 0.6, 0.6]


def test_a_choice_at_the_edge_extends_the_grid_until_it_is_interior(tmp_path):
    path = tmp_path / "ev2.yaml"
    path.write_text(GRID)
    out = tmp_path / "out"
    out.mkdir()
    # florg: best at the top twice (0.002 then 0.004), interior once 0.008 is worse;
    # fedit: interior at once (0.001 best is the bottom: extends down to 0.0005, worse)
    validation = {
        ("florg", 0.001): 0.5, ("florg", 0.002): 0.6, ("florg", 0.004): 0.7,
        ("florg", 0.008): 0.65, ("fedit", 0.001): 0.8, ("fedit", 0.002): 0.7,
        ("fedit", 0.0005): 0.75,
    }  # fmt: skip
    grid = load_grid(path)
    ran: list[str] = []
    for _ in range(10):  # what the runner does: run what is pending, re-read the grid
        grid = tuned_grid(grid, out)
        pending = [r for r in grid.runs if r.run_id not in ran]
        if not pending:
            break
        for run in pending:
            key = (run.overrides["method"], run.overrides["learning-rate"])
            _fake_run(out, run, *_val(validation.get(key, 0.4)))
            ran.append(run.run_id)
    document = json.loads((out / "tuning.json").read_text())
    florg, fedit = "method=florg,task=movie-sentiment", "method=fedit,task=movie-sentiment"
    assert document["choices"] == {florg: 0.004, fedit: 0.001}
    assert document["table"][florg]["path"] == [0.001, 0.002, 0.004, 0.008]
    assert document["table"][fedit]["path"] == [0.001, 0.002, 0.0005]
    assert not document["table"][florg]["at-edge"] and not document["table"][fedit]["at-edge"]
    assert load_candidates(out) == {
        florg: [0.001, 0.002, 0.004, 0.008],
        fedit: [0.001, 0.002, 0.0005],
    }
    # the chosen value runs every seed, and the extended tuning runs are grid runs too
    main = sorted(
        (r.overrides["method"], r.overrides["learning-rate"], r.overrides["seed"])
        for r in grid.runs if "main" in r.blocks
    )  # fmt: skip
    assert main == [
        ("fedit", 0.001, 0),
        ("fedit", 0.001, 1),
        ("florg", 0.004, 0),
        ("florg", 0.004, 1),
    ]
    assert grid.expected_runs == len(ran) == (4 + 1) + (3 + 1)
    table = tuning_markdown(document)
    assert "learning-rate = 0.008" in table[0] and "learning-rate = 0.0005" in table[0]


def test_the_cap_on_extensions_is_recorded_as_a_choice_at_the_edge(tmp_path):
    path = tmp_path / "ev2.yaml"
    path.write_text(GRID)
    out = tmp_path / "out"
    out.mkdir()
    grid = load_grid(path)
    ran: set[str] = set()
    for _ in range(10):
        grid = tuned_grid(grid, out)
        pending = [r for r in grid.runs if r.run_id not in ran]
        if not pending:
            break
        for run in pending:  # validation keeps rising with the rate
            _fake_run(out, run, *_val(min(0.99, run.overrides["learning-rate"] * 100)))
            ran.add(run.run_id)
    entry = json.loads((out / "tuning.json").read_text())["table"][
        "method=florg,task=movie-sentiment"
    ]
    assert entry["path"] == [0.001, 0.002, 0.004, 0.008]  # two extensions, then the cap
    assert entry["chosen"] == 0.008 and entry["at-edge"]


@pytest.mark.parametrize(
    ("extra", "message"),
    [("extend: 1.0", "extend must be > 1"), ("extend: 2\n  max-extensions: 0", "max-extensions")],
)
def test_bad_extension_settings_are_refused(tmp_path, extra, message):
    path = tmp_path / "bad.yaml"
    path.write_text(GRID.replace("  extend: 2\n  max-extensions: 2", "  " + extra))
    with pytest.raises(GridError, match=message):
        load_grid(path)


def test_a_v1_grid_records_no_extension(tmp_path):
    path = tmp_path / "v1.yaml"
    path.write_text(GRID.replace("  extend: 2\n  max-extensions: 2\n", ""))
    out = tmp_path / "out"
    out.mkdir()
    grid = load_grid(path)
    for run in grid.runs:
        _fake_run(out, run, *_val(run.overrides["learning-rate"] * 100))
    document = choose_tuned(grid, out)
    assert "candidates" not in document
    assert document["choices"]["method=florg,task=movie-sentiment"] == 0.002


V2 = """
name: ev2
simulation: {num-supernodes: 2}
base: {max-test-examples: 40, num-server-rounds: 4, head-learning-rate: 0.004}
tuning: {key: learning-rate, values: [0.001, 0.002], seed: 0, per: [task, method], extend: 2}
grid:
  task: [movie-sentiment]
  method: [florg, fedit, florg-signed]
  seed: [0, 1, 2]
"""
VARIANTS = """
name: ev2v
simulation: {num-supernodes: 2}
base: {max-test-examples: 40, num-server-rounds: 4, head-learning-rate: 0.004,
       subtract-init: false}
tuning: {key: learning-rate, values: [0.001, 0.002], seed: 0,
         per: [task, method, subtract-init], extend: 2}
grid:
  task: [movie-sentiment]
  method: [florg]
  subtract-init: [true, false]
  seed: [0, 1, 2]
"""
TEST = {"florg": 0.70, "fedit": 0.80, "florg-signed": 0.75, True: 0.72}  # True: subtract-init


def _run_all(path, out, validation):
    grid = load_grid(path)
    done: set[str] = set()
    for _ in range(10):
        grid = tuned_grid(grid, out)
        pending = [r for r in grid.runs if r.run_id not in done]
        if not pending:
            return grid
        for run in pending:
            key = run.overrides.get("subtract-init") or run.overrides["method"]
            seed = run.overrides["seed"]
            test = [0.5] + [TEST[key] + 0.01 * seed] * 4
            _fake_run(out, run, *(_val(validation(run.overrides))[:1] + (test,)))
            done.add(run.run_id)
    raise AssertionError("the grid did not settle")


def test_the_v2_summary_records_head_lr_paths_choices_and_variants(tmp_path):
    from florg_lab.evidence import write_evidence

    (tmp_path / "ev2.yaml").write_text(V2)
    (tmp_path / "ev2v.yaml").write_text(VARIANTS)
    out, vout = tmp_path / "out", tmp_path / "vout"
    out.mkdir()
    vout.mkdir()
    # florg peaks at 0.004 (two extensions up), the others at 0.002 (one extension)
    peak = {"florg": 0.004}
    grid = _run_all(
        tmp_path / "ev2.yaml",
        out,
        lambda o: 0.9 - abs(o["learning-rate"] - peak.get(o["method"], 0.002)),
    )
    variants = _run_all(tmp_path / "ev2v.yaml", vout,
                        lambda o: 0.9 - abs(o["learning-rate"] - 0.002))  # fmt: skip
    report = write_evidence(grid, out, [(variants, vout)]).read_text()
    summary = json.loads((out / "evidence" / "summary.json").read_text())
    assert summary["protocol"] == "v2"
    task = summary["tasks"]["movie-sentiment"]
    assert set(task["methods"]) == {"florg", "fedit"}
    assert set(task["variants"]) == {"florg-signed", "florg subtract-init=True"}
    florg = task["methods"]["florg"]
    assert florg["head_lr"] == 0.004 and florg["chosen_lr"] == florg["lr"] == 0.004
    assert florg["lr_path"] == [0.001, 0.002, 0.004, 0.008]
    assert task["methods"]["fedit"]["lr_path"] == [0.001, 0.002, 0.004]
    signed = task["variants"]["florg-signed"]
    assert signed["chosen_lr"] == 0.002 and signed["test_final"] == [0.75, 0.76, 0.77]
    assert task["variants"]["florg subtract-init=True"]["lr_path"] == [0.001, 0.002, 0.004]
    # the variants' two verdicts: beats FLoRG (+0.05, +0.02), closes the gap to FedIT (no)
    assert "| florg-signed beats the paper's FLoRG | movie-sentiment | test final, " in report
    assert "florg-signed − florg, 3 seeds | 0.0500 [0.0500, 0.0500] | holds |" in report
    assert "florg subtract-init=True − fedit, 3 seeds | -0.0800 [-0.0800, -0.0800] |" in report
