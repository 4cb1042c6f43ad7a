"""florg_lab.retune: choosing a tuned value on the mean over several seeds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from florg_lab.retune import choose, find_runs, main

PER = ("task", "method")


def write_run(
    root: Path,
    lr: float,
    seed: int,
    last3: tuple[float, float, float],
    test: float | None,
    *,
    method: str = "florg",
    status: str = "finished",
    val_key: str = "score",
    name: str | None = None,
) -> Path:
    """A run folder as the ServerApp writes it: rounds 0-4, validation in rounds 0, 2-4."""
    folder = root / (name or f"learning-rate={lr},method={method},seed={seed}")
    folder.mkdir(parents=True)
    config = {"task": "snli", "method": method, "learning-rate": lr, "seed": seed}
    (folder / "config.json").write_text(json.dumps(config))
    summary = {"status": status, "val-score-key": val_key, "final-test-score": test}
    (folder / "summary.json").write_text(json.dumps(summary))
    rows = [{"round": 0, val_key: 0.33}, {"round": 1, val_key: 0.99}]
    rows += [{"round": r, val_key: s} for r, s in zip((2, 3, 4), last3, strict=True)]
    (folder / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return folder


@pytest.fixture
def grid_folders(tmp_path: Path) -> tuple[Path, Path]:
    """Seed 0 in one grid folder, seed 1 in another: on seed 0 alone 1e-3 wins (0.6
    against 0.5), on the mean over seeds 0-1 2e-3 does (0.5 against 0.45)."""
    first, second = tmp_path / "grid-a", tmp_path / "grid-b"
    write_run(first, 0.001, 0, (0.5, 0.6, 0.7), 0.7)
    write_run(first, 0.002, 0, (0.5, 0.5, 0.5), 0.6)
    write_run(second, 0.001, 1, (0.3, 0.3, 0.3), 0.4)
    write_run(second, 0.002, 1, (0.4, 0.5, 0.6), 0.62)
    return first, second


def test_the_mean_over_seeds_can_choose_another_value(grid_folders):
    runs = find_runs(grid_folders, "learning-rate", PER)
    assert len(runs) == 4
    (one_seed,) = choose(runs, [0])
    (two_seeds,) = choose(runs, [0, 1])
    assert one_seed.chosen == 0.001
    assert two_seeds.chosen == 0.002
    # the selection score skips round 0 and averages the last three rounds
    assert two_seeds.scores[0.001] == pytest.approx([0.6, 0.3])
    assert two_seeds.mean(0.001) == pytest.approx(0.45)
    assert two_seeds.mean(0.002) == pytest.approx(0.5)


def test_no_choice_while_a_seed_is_missing(grid_folders):
    runs = find_runs(grid_folders, "learning-rate", PER)
    runs = [r for r in runs if (r.value, r.seed) != (0.002, 1)]
    (choice,) = choose(runs, [0, 1])
    assert choice.scores[0.002] == [0.5, None]
    assert choice.chosen is None


def test_ties_go_to_the_smaller_value(tmp_path):
    write_run(tmp_path, 0.002, 0, (0.5, 0.5, 0.5), 0.5)
    write_run(tmp_path, 0.001, 0, (0.5, 0.5, 0.5), 0.5)
    (choice,) = choose(find_runs([tmp_path], "learning-rate", PER), [0])
    assert choice.chosen == 0.001


def test_unfinished_runs_are_skipped_and_the_run_names_its_validation_key(tmp_path):
    write_run(tmp_path, 0.001, 0, (0.9, 0.9, 0.9), 0.9, status="running")
    write_run(tmp_path, 0.002, 0, (0.4, 0.5, 0.6), 0.5, val_key="personalized-val-score")
    (run,) = find_runs([tmp_path], "learning-rate", PER)
    assert run.value == 0.002
    assert run.validation == pytest.approx(0.5)


def test_a_run_found_twice_must_agree(tmp_path):
    write_run(tmp_path / "a", 0.001, 0, (0.5, 0.5, 0.5), 0.5)
    write_run(tmp_path / "b", 0.001, 0, (0.5, 0.5, 0.5), 0.5)
    assert len(find_runs([tmp_path / "a", tmp_path / "b"], "learning-rate", PER)) == 1
    write_run(tmp_path / "c", 0.001, 0, (0.6, 0.6, 0.6), 0.5)
    with pytest.raises(ValueError, match="same run"):
        find_runs([tmp_path / "a", tmp_path / "c"], "learning-rate", PER)


def test_cli_prints_both_choices_with_their_test_interval(grid_folders, capsys):
    assert main([*map(str, grid_folders), "--seeds", "0", "1", "--chance", "0.5"]) == 0
    out = capsys.readouterr().out
    assert "| task=snli,method=florg | 0.001 | 0.600 | 0.300 | 0.450 | seed 0 |" in out
    assert "| task=snli,method=florg | 0.002 | 0.500 | 0.500 | 0.500 | mean |" in out
    # 0.6 and 0.62: mean 0.61, sd 0.01414, t(0.975, 1) = 12.706 -> half-width 0.12706
    assert (
        "chosen on the mean: 0.002: seeds 0: 0.600, 1: 0.620; mean 0.6100 [0.4829, 0.7371]" in out
    )
    assert "above chance +0.110 [-0.017, +0.237]" in out
    assert "chosen on seed 0: 0.001: seeds 0: 0.700, 1: 0.400; mean 0.5500" in out
    # paired: 0.6 - 0.7 and 0.62 - 0.4 -> mean 0.06, sd 0.22627, half-width 2.0330
    assert "0.002 − 0.001, paired over seeds 0, 1: 0.0600 [-1.9730, 2.0930], ahead on 1 of 2" in out


def test_cli_rejects_an_empty_folder_and_a_missing_one(tmp_path, capsys):
    assert main([str(tmp_path), "--seeds", "0"]) == 2
    assert "no finished runs" in capsys.readouterr().out
    assert main([str(tmp_path / "nope"), "--seeds", "0"]) == 2
    assert "no such folder" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main([str(tmp_path), "--seeds", "0", "0"])
