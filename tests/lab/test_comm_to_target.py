"""Communication to a target score (lab/florg_lab/comm_to_target.py), on small
synthetic run folders whose numbers are known: the parameters counted per client, the
first test round where the seed-mean score reaches FedIT's final score, the not-reached
case, the per-seed counts, which runs are chosen, and the methods not published yet.

Scores are multiples of 1/8, exact in floating point, so every comparison with the target
is decided by the design, not by rounding."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from florg_lab import comm_to_target as ctt

ROUNDS = 20
CLIENTS = 6
TEST_ROUNDS = (0, 5, 10, 15, 20)
TASK = "movie-sentiment"


def write_run(
    folder: Path,
    method: str,
    seed: int,
    lr: float,
    scores: list[float],
    each_way: int,
    *,
    task: str = TASK,
    test_key: str = "test-score",
) -> None:
    """A finished run: every round from 1 on, each of the 6 clients sends ``each_way``
    parameters up and receives as many down (the row holds the round's totals); the test
    score ``scores[i]`` at ``TEST_ROUNDS[i]`` under ``test_key``."""
    run = folder / f"learning-rate={lr},method={method},seed={seed},task={task}"
    run.mkdir(parents=True)
    config = {"method": method, "seed": seed, "learning-rate": lr, "task": task}
    (run / "config.json").write_text(json.dumps(config))
    summary = {"status": "finished", "rounds": ROUNDS, "test-score-key": test_key}
    (run / "summary.json").write_text(json.dumps(summary))
    rows = []
    for t in range(ROUNDS + 1):
        sent = 0 if t == 0 else each_way * CLIENTS
        row = {"round": t, "up-params": sent, "down-params": sent}
        if t:
            row.update(clients=CLIENTS, failures=0, rejected=0, screened=0)
        if t in TEST_ROUNDS:
            row[test_key] = scores[TEST_ROUNDS.index(t)]
            if test_key != "test-score":  # a personalised method's global model: no use
                row["test-score"] = 0.0
        rows.append(row)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


FEDIT = {  # seed-mean final 0.75: the target; seed 1 collapses
    0: [0.5, 0.5, 0.625, 0.75, 0.75],
    1: [0.5, 0.5, 0.5, 0.5, 0.5],
    2: [0.5, 0.625, 0.75, 0.875, 1.0],
}
FLORG = {  # seed mean 0.5, 0.708, 0.792, 0.833, 0.833: at the target from round 10
    0: [0.5, 0.75, 0.875, 0.875, 0.875],
    1: [0.5, 0.625, 0.75, 0.75, 0.75],
    2: [0.5, 0.75, 0.75, 0.875, 0.875],
}
FFA = {s: [0.5, 0.5, 0.5, 0.625, 0.5] for s in range(3)}  # best 0.625 at round 15: never


@pytest.fixture
def evidence(tmp_path: Path) -> Path:
    """A protocol-v2-like grid: summary.json names the chosen rate and seeds; its run
    folder also holds runs that must not count."""
    folder = tmp_path / "runs" / "grid"
    methods = {
        "florg": {"lr": 0.001, "seeds": [0, 1, 2]},
        "fedit": {"lr": 0.004, "seeds": [0, 1, 2]},
        "ffa-lora": {"lr": 0.008, "seeds": [0, 1, 2]},
        "fedsa-lora": {"lr": 0.002, "seeds": [0, 1, 2]},
        "federa": {"lr": 0.002, "seeds": [0, 1, 2]},  # named, but no run published
    }
    summary = {"tasks": {TASK: {"methods": methods}}}
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    for seed in range(3):
        write_run(folder, "florg", seed, 0.001, FLORG[seed], 100)
        write_run(folder, "fedit", seed, 0.004, FEDIT[seed], 200)
        write_run(folder, "ffa-lora", seed, 0.008, FFA[seed], 100)
        # personalised: scored by its test-score-key, at 1.0 from round 5
        write_run(folder, "fedsa-lora", seed, 0.002, [0.5, 1.0, 1.0, 1.0, 1.0], 100,
                  test_key="personalized-test-score")  # fmt: skip
        # not chosen: another rate, another task; and a seed the summary does not name
        write_run(folder, "fedit", seed, 0.008, [0.0] * 5, 200)
        write_run(folder, "florg", seed, 0.001, [0.0] * 5, 100, task="snli")
    write_run(folder, "florg", 3, 0.001, [0.0] * 5, 100)
    return tmp_path


def sources(extra: tuple[ctt.Source, ...] = ()) -> tuple[ctt.Source, ...]:
    return (ctt.Source("summary.json", ("runs/grid",)), *extra)


EXACT = ctt.Source("exact/summary.json", ("exact/runs/grid",), ("rolora", "fed-sb"))


def test_parameters_are_counted_per_client_up_and_down_summed_over_rounds():
    rows = [
        {"round": 0, "up-params": 600, "down-params": 0, "clients": 6},  # an init round
        {"round": 2, "up-params": 500, "down-params": 700, "clients": 5, "failures": 1,
         "rejected": 0, "screened": 0},  # a failed client received the model too
        {"round": 1, "up-params": 600, "down-params": 600, "clients": 4, "screened": 1,
         "rejected": 1},
        {"round": 3, "up-params": 0, "down-params": 0},
    ]  # fmt: skip
    assert ctt.cumulative_params(rows) == {0: 100.0, 1: 300.0, 2: 500.0, 3: 500.0}
    with pytest.raises(ValueError, match="round 4"):
        ctt.cumulative_params([{"round": 4, "up-params": 10, "down-params": 10}])


def test_first_reach_is_the_first_round_at_or_above_the_target():
    scores = {20: 0.9, 5: 0.5, 10: 0.75, 15: 0.625}
    assert ctt.first_reach(scores, 0.75) == 10  # equal counts as reached
    assert ctt.first_reach(scores, 0.875) == 20
    assert ctt.first_reach(scores, 0.95) is None


def test_only_the_chosen_runs_count_and_missing_methods_are_named(evidence):
    runs, missing = ctt.chosen_runs(evidence, sources((EXACT,)), TASK)
    assert list(runs) == ["florg", "fedit", "ffa-lora", "fedsa-lora"]
    assert all(sorted(by_seed) == [0, 1, 2] for by_seed in runs.values())
    assert {run.learning_rate for run in runs["fedit"].values()} == {0.004}
    assert {run.task for run in runs["florg"].values()} == {TASK}
    # no run of FeDeRA; the exact grid's summary is not there at all
    assert missing == ["federa", "rolora", "fed-sb"]


def test_a_published_exact_grid_joins_and_its_absent_method_is_named(evidence):
    folder = evidence / "exact" / "runs" / "grid"
    for seed in (0, 1):  # two of three seeds so far
        write_run(folder, "rolora", seed, 0.001, FLORG[seed], 100)
    summary = {"tasks": {TASK: {"methods": {"rolora": {"lr": 0.001, "seeds": [0, 1, 2]}}}}}
    (evidence / "exact" / "summary.json").write_text(json.dumps(summary))
    runs, missing = ctt.chosen_runs(evidence, sources((EXACT,)), TASK)
    assert sorted(runs["rolora"]) == [0, 1]
    assert missing == ["federa", "fed-sb"]


def test_the_curve_holds_cumulative_parameters_and_the_seed_mean(evidence):
    found = ctt.curves(ctt.chosen_runs(evidence, sources(), TASK)[0])
    florg, fedit = found["florg"], found["fedit"]
    assert florg.rounds == TEST_ROUNDS
    assert florg.params == (0.0, 1000.0, 2000.0, 3000.0, 4000.0)  # 200 per client a round
    assert fedit.params == (0.0, 2000.0, 4000.0, 6000.0, 8000.0)
    assert florg.per_round == 200.0 and fedit.per_round == 400.0
    assert fedit.scores == pytest.approx((0.5, 1.625 / 3, 0.625, 2.125 / 3, 0.75))
    assert found["fedsa-lora"].scores[1] == 1.0  # its personalised score, not the global 0


def test_reach_the_target_first_round_parameters_and_seeds(evidence):
    found = ctt.curves(ctt.chosen_runs(evidence, sources(), TASK)[0])
    assert ctt.targets(found, (1.0, 0.9)) == [0.75, 0.675]
    fedit = found["fedit"].reach(0.75)
    assert (fedit.round, fedit.params) == (20, 8000.0)  # its own final, by construction
    assert fedit.seed_rounds == {0: 15, 1: None, 2: 10} and fedit.seeds_reached == 2
    florg = found["florg"].reach(0.75)
    assert (florg.round, florg.params) == (10, 2000.0)
    assert florg.seed_rounds == {0: 5, 1: 10, 2: 5} and florg.seeds_reached == 3
    ffa = found["ffa-lora"].reach(0.75)
    assert ffa.round is None and ffa.params is None
    assert (ffa.best, ffa.best_round, ffa.seeds_reached) == (0.625, 15, 0)
    # at 90 % of the target FedIT gets there at round 15 (mean 0.708), FLoRG at round 5
    assert found["fedit"].reach(0.675).params == 6000.0
    assert found["florg"].reach(0.675).params == 1000.0


def test_the_table_states_the_target_and_each_reach(evidence):
    runs, missing = ctt.chosen_runs(evidence, sources((EXACT,)), TASK)
    text = ctt.markdown(ctt.curves(runs), missing, (1.0, 0.9))
    assert text.startswith("Target: fedit's final seed-mean test score, 0.750 (round 20, 3 seeds)")
    assert "90% of it, 0.675" in text and "(0, 5, 10, 15, 20)" in text
    assert "| florg | 3 | 200 | 0.750 | 10 | 2,000 | 0.250 | 3 of 3: 5 / 10 / 5 |" in text
    assert "| fedit | 3 | 400 | 0.750 | 20 | 8,000 | 1.000 | 2 of 3: 15 / – / 10 |" in text
    assert (
        "| ffa-lora | 3 | 200 | 0.750 | not reached (best 0.625, round 15) | – | – "
        "| 0 of 3: – / – / – |" in text
    )
    assert "| florg | 3 | 200 | 0.675 | 5 | 1,000 | 0.167 |" in text
    assert text.endswith("\n\nfedera, rolora, fed-sb: not published yet.")


def test_without_fedit_there_is_no_target_and_the_long_grid_copes(tmp_path):
    """The long-budget grid, read by its tuning.json: only FLoRG chosen so far."""
    choices = {"method=florg,task=snli": 0.001}
    (tmp_path / "tuning.json").write_text(json.dumps({"choices": choices}))
    for seed in (0, 1):
        write_run(tmp_path / "runs", "florg", seed, 0.001, FLORG[seed], 100, task="snli")
    write_run(tmp_path / "runs", "florg", 0, 0.002, [1.0] * 5, 100, task="snli")  # tuning
    found, missing = ctt.from_long_budget(tmp_path, ("florg", "fedit", "federa"))
    assert list(found) == ["florg"] and found["florg"].seeds == (0, 1)
    assert missing == ["fedit", "federa"]
    text = ctt.markdown(found, missing, (1.0, 0.9))
    assert "fedit is not published yet, so there is no target" in text
    assert "| florg | 2 | 200 | – | – (best 0.812, round 10) | – | – | – |" in text
    assert text.endswith("fedit, federa: not published yet.")


def test_the_figure_is_written(evidence, tmp_path):
    found = ctt.curves(ctt.chosen_runs(evidence, sources(), TASK)[0])
    path = tmp_path / "figure" / "comm.png"
    ctt.plot(found, path, (1.0, 0.9), "synthetic")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_figure_is_written_without_fedit_with_no_target_line(evidence, tmp_path):
    """A grid part-way (FedIT's curve not in yet) still draws, without the target lines."""
    found = ctt.curves(ctt.chosen_runs(evidence, sources(), TASK)[0])
    without_fedit = {method: found_curve for method, found_curve in found.items()
                     if method != ctt.TARGET_METHOD}  # fmt: skip
    assert without_fedit and len(without_fedit) < len(found)
    path = tmp_path / "comm.png"
    ctt.plot(without_fedit, path, (1.0, 0.9), "synthetic")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
