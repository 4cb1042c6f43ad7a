"""The long-budget verdict as a curve (lab/florg_lab/long_budget.py), on a
synthetic grid folder whose numbers are known: the chosen runs, the curve's intervals and
paired differences, the convergence slopes, the markdown and the plot."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from florg_lab import long_budget
from florg_lab.stats import mean_interval, paired_difference

ROUNDS = 40


def write_run(root: Path, method: str, lr: float, seed: int, score) -> None:
    """A finished run whose test and validation score at round t is ``score(t)``."""
    folder = root / "runs" / f"learning-rate={lr},method={method},seed={seed},task=snli"
    folder.mkdir(parents=True)
    config = {"method": method, "learning-rate": lr, "seed": seed, "task": "snli"}
    (folder / "config.json").write_text(json.dumps(config))
    rows = [
        {"round": t, "score": score(t) if t % 5 == 0 else None,
         "test-score": score(t) if t % 10 == 0 else None}
        for t in range(ROUNDS + 1)
    ]  # fmt: skip
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "summary.json").write_text(json.dumps({"status": "finished"}))


@pytest.fixture
def grid(tmp_path: Path) -> Path:
    choices = {"method=florg,task=snli": 0.002, "method=fedit,task=snli": 0.001}
    (tmp_path / "tuning.json").write_text(json.dumps({"key": "learning-rate", "choices": choices}))
    for seed in range(3):
        # FLoRG: starts 0.1 behind and catches up linearly, flat over the last 20 rounds
        write_run(tmp_path, "florg", 0.002, seed, lambda t, s=seed: 0.5 + 0.01 * s
                  + (0.1 * min(t, 20) / 20) - 0.1)  # fmt: skip
        # FedIT: flat at 0.5 + 0.01 s, and still rising by 0.001 a round
        write_run(tmp_path, "fedit", 0.001, seed, lambda t, s=seed: 0.5 + 0.01 * s + 0.001 * t)
        # a run at a learning rate not chosen: left out
        write_run(tmp_path, "fedit", 0.004, seed, lambda t: 0.0)
    return tmp_path


def test_the_curve_pairs_seeds_at_each_round(grid):
    runs = long_budget.chosen_runs(grid)
    assert sorted(runs) == ["fedit", "florg"] and sorted(runs["fedit"]) == [0, 1, 2]
    table = long_budget.curve(runs, [10, 40], ["fedit", "federa"])
    at10, at40 = table
    florg10 = [0.5 + 0.01 * s - 0.05 for s in range(3)]
    fedit10 = [0.5 + 0.01 * s + 0.01 for s in range(3)]
    assert at10["scores"]["florg"].mean == pytest.approx(mean_interval(florg10).mean)
    assert at10["scores"]["florg"].high == pytest.approx(mean_interval(florg10).high)
    paired = paired_difference(florg10, fedit10)
    assert at10["differences"]["fedit"].difference.mean == pytest.approx(paired.difference.mean)
    assert at10["differences"]["fedit"].losses == paired.losses == 3
    assert "federa" not in at10["differences"]  # no runs of it
    assert at40["differences"]["fedit"].difference.mean == pytest.approx(-0.04)
    assert at40["differences"]["fedit"].losses == 3


def test_convergence_flags_a_method_still_rising(grid):
    converged = long_budget.convergence(long_budget.chosen_runs(grid), last=20)
    assert converged["fedit"].mean == pytest.approx(0.1)  # 0.001 a round = 0.1 per 100
    assert long_budget.still_rising(converged["fedit"])  # the same slope on every seed
    assert not long_budget.still_rising(converged["florg"])
    assert converged["florg"].mean == pytest.approx(0.0, abs=1e-12)


def test_the_command_prints_the_table_and_writes_plot_and_json(grid, tmp_path, capsys):
    plot, out = tmp_path / "curve.png", tmp_path / "curve.json"
    assert long_budget.main([str(grid), "--rounds", "20", "40", "--last", "20",
                             "--plot", str(plot), "--json", str(out)]) == 0  # fmt: skip
    text = capsys.readouterr().out
    assert "| round | florg | fedit | florg − fedit |" in text
    assert "| 40 |" in text and "does not hold" in text
    # per seed: FLoRG's seed 2 at round 20 is 0.5 + 0.02 (caught up), FedIT's seed 1 at 40
    # is 0.5 + 0.01 + 0.04
    assert "| florg | 2 | 0.520 | 0.520 |" in text and "| fedit | 1 | 0.530 | 0.550 |" in text
    assert plot.stat().st_size > 0
    data = json.loads(out.read_text())
    assert data["seeds"] == {"florg": [0, 1, 2], "fedit": [0, 1, 2]}
    assert [e["round"] for e in data["curve"]] == [20, 40]


def test_the_page_block_lists_tuning_runs_until_tuning_chooses_then_the_curve(grid, tmp_path):
    """Before a choice: each finished run's test scores, no verdict; after: the curve."""
    tuning = json.loads((grid / "tuning.json").read_text())
    (grid / "tuning.json").write_text(json.dumps({**tuning, "choices": {}}))
    before = long_budget.progress_markdown(grid, 21, (10, 20, 40), ("fedit",), 20)
    assert before.startswith(f"{len(list((grid / 'runs').iterdir()))} runs finished, of 21")
    assert "no verdict" in before and "florg − fedit" not in before
    assert "| florg | 0.002 | 0.450 | 0.500 | 0.500 |" in before  # seed 0: 0.4 + 0.1 min(t, 20)/20
    figure = tmp_path / "before.png"
    long_budget.progress_plot(grid, figure)
    assert figure.stat().st_size > 1000

    (grid / "tuning.json").write_text(json.dumps(tuning))
    after = long_budget.progress_markdown(grid, 21, (10, 20, 40), ("fedit",), 20)
    assert "florg − fedit" in after and "still rising" in after and "no verdict" not in after
    assert "| fedit | 0 | 0.510 | 0.520 | 0.540 |" in after  # per seed, at rounds 10, 20, 40
    assert "| fedit | 0 | 0.000" not in after  # the run at a rate not chosen is left out


def test_the_plot_keeps_the_score_axis_at_0_to_1_when_few_seeds_widen_the_band(
    grid, tmp_path, monkeypatch
):
    """Two seeds' t interval (t = 12.7) reaches far past [0, 1]; the axis stays at the
    score's range, so the curves keep the figure's height."""
    limits = []
    save = long_budget._save

    def recording_save(fig, ax, path):
        save(fig, ax, path)
        limits.append(ax.get_ylim())

    monkeypatch.setattr(long_budget, "_save", recording_save)
    runs = long_budget.chosen_runs(grid)
    two_seeds = {method: dict(list(by_seed.items())[:2]) for method, by_seed in runs.items()}
    long_budget.plot(two_seeds, tmp_path / "curve.png")
    assert limits == [(0.0, 1.0)]


def test_the_planned_count_adds_the_rates_tuning_extended_past_an_end(grid):
    """tuning.json's path past its grid values adds a run each: FLoRG's 5e-4 below
    {1e-3, 2e-3, 4e-3} makes 21 planned runs 22."""
    assert long_budget.planned_runs(grid, 21) == 21  # no table yet: nothing extended
    tuning = json.loads((grid / "tuning.json").read_text())
    table = {
        "method=florg,task=snli": {"path": [0.001, 0.002, 0.004, 0.0005]},
        "method=fedit,task=snli": {"path": [0.001, 0.002, 0.004]},
    }
    values = [0.001, 0.002, 0.004]
    (grid / "tuning.json").write_text(json.dumps({**tuning, "values": values, "table": table}))
    assert long_budget.planned_runs(grid, 21) == 22
    text = long_budget.progress_markdown(grid, 21, (10, 20, 40), ("fedit",), 20)
    assert "runs finished, of 22 planned" in text
    (grid / "tuning.json").unlink()
    assert long_budget.planned_runs(grid, 21) == 21


def test_the_readme_headline_row_sorts_the_baselines_by_their_verdict_at_the_last_round(
    tmp_path,
):
    """README's HEADLINE row for the long budget (page_headline): FedIT ahead of FLoRG by about
    0.1 on every seed (does not hold), FeDeRA ahead on one seed and behind on another
    (inconclusive)."""
    from florg_lab.page_headline import verdict_cells
    from florg_lab.page_text import Evidence

    grid = tmp_path / long_budget.PUBLISHED
    grid.mkdir(parents=True)
    choices = {f"method={m},task=snli": 0.001 for m in long_budget.methods()}
    (grid / "tuning.json").write_text(json.dumps({"key": "learning-rate", "choices": choices}))
    federa_offsets = (-0.05, 0.0, 0.06)
    for seed in range(3):
        write_run(grid, "florg", 0.001, seed, lambda t, s=seed: 0.5 + 0.01 * s)
        write_run(grid, "fedit", 0.001, seed, lambda t, s=seed: 0.6 + 0.01 * s + 0.001 * s * s)
        write_run(grid, "federa", 0.001, seed,
                  lambda t, s=seed: 0.5 + 0.01 * s + federa_offsets[s])  # fmt: skip
    what, task, verdicts = long_budget.headline_verdicts(Evidence(tmp_path), ROUNDS)
    assert (what, task) == (f"long budget (`evidence-long-snli`, round {ROUNDS})", "snli")
    assert verdict_cells(verdicts) == ["–", "FedIT", "FeDeRA"]
