"""florg_lab.contrast: the same arms and seeds across values of one key."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from florg_lab.contrast import collect, main, parse_arm, report

KEY = "dirichlet-alpha"
FLORG = "method=florg,learning-rate=1e-3"
FEDIT = "method=fedit,learning-rate=0.002"


def write_run(
    root: Path,
    method: str,
    lr: float,
    rho: float,
    seed: int,
    final: float,
    *,
    last3: float | None = None,
    status: str = "finished",
    name: str | None = None,
) -> Path:
    folder = root / (name or f"{method},{lr},{rho},{seed}")
    folder.mkdir(parents=True)
    config = {"method": method, "learning-rate": lr, KEY: rho, "seed": seed, "task": "snli"}
    summary = {
        "status": status,
        "final-test-score": final,
        "test-last3": final if last3 is None else last3,
    }
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "summary.json").write_text(json.dumps(summary))
    return folder


@pytest.fixture
def two_grids(tmp_path: Path) -> list[Path]:
    """rho 0.5 in one folder, rho 1 in another; seeds 0-2 for both arms."""
    harsh, mild = tmp_path / "rho-0.5", tmp_path / "rho-1"
    for seed, (florg, fedit) in enumerate([(0.40, 0.50), (0.36, 0.36), (0.44, 0.52)]):
        write_run(harsh, "florg", 0.001, 0.5, seed, florg)
        write_run(harsh, "fedit", 0.002, 0.5, seed, fedit)
    for seed, (florg, fedit) in enumerate([(0.60, 0.62), (0.50, 0.56), (0.58, 0.60)]):
        write_run(mild, "florg", 0.001, 1.0, seed, florg)
        write_run(mild, "fedit", 0.002, 1.0, seed, fedit)
    # another learning rate of FLoRG: no arm matches it
    write_run(harsh, "florg", 0.002, 0.5, 0, 0.9)
    return [harsh, mild]


def test_arms_match_numbers_by_value_and_text_by_text():
    arm = parse_arm("method=florg,learning-rate=1e-3")
    assert arm.matches({"method": "florg", "learning-rate": 0.001, "seed": 3})
    assert not arm.matches({"method": "florg", "learning-rate": 0.002})
    assert not arm.matches({"method": "fedit", "learning-rate": 0.001})
    assert not arm.matches({"learning-rate": 0.001})
    with pytest.raises(ValueError, match="key=value"):
        parse_arm("method=florg,learning-rate")


def test_collect_keeps_the_arms_runs_and_their_values(two_grids):
    runs = collect(two_grids, KEY, [parse_arm(FLORG), parse_arm(FEDIT)])
    assert len(runs) == 12
    florg_mild = sorted((r.seed, r.final) for r in runs if r.arm == FLORG and r.value == 1.0)
    assert florg_mild == [(0, 0.60), (1, 0.50), (2, 0.58)]


def test_report_pairs_by_seed_across_values_and_arms(two_grids):
    runs = collect(two_grids, KEY, [parse_arm(FLORG), parse_arm(FEDIT)])
    text = report(runs, [FLORG, FEDIT], KEY, chance=0.36)
    # FLoRG at rho 1: mean 0.56, above chance +0.20
    assert f"| {FLORG} | 1 | 0.600 | 0.500 | 0.580 | 0.5600 [" in text
    # rho 1 − rho 0.5 for FLoRG, per seed +0.20, +0.14, +0.14: mean +0.16, higher on 3
    assert f"{FLORG}: {KEY} 1 − 0.5: +0.160 [" in text
    assert "higher on 3 of 3" in text
    # FLoRG − FedIT at rho 0.5: −0.10, 0, −0.08 (mean −0.06); at rho 1: −0.02, −0.06,
    # −0.02 (mean −0.033); the gap moved by +0.08, −0.06, +0.06: mean +0.027
    assert f"{FLORG} − {FEDIT}, {KEY} 0.5: -0.060 [" in text
    assert f"{FLORG} − {FEDIT}, {KEY} 1: -0.033 [" in text
    assert f"the gap at {KEY} 1 − the gap at 0.5: +0.027 [" in text
    assert "higher on 2 of 3" in text


def test_interval_matches_a_hand_computed_t_interval(two_grids):
    # FLoRG at rho 1: 0.60, 0.50, 0.58 -> sd 0.052915, t(0.975, 2) = 4.302653,
    # half-width 4.302653 * 0.052915 / sqrt(3) = 0.131446
    runs = collect(two_grids, KEY, [parse_arm(FLORG)])
    text = report(runs, [FLORG], KEY, chance=float("nan"))
    assert "0.5600 [0.4286, 0.6914]" in text
    assert "above chance" not in text


def test_a_run_in_two_arms_or_twice_with_other_scores_is_an_error(two_grids, tmp_path):
    with pytest.raises(ValueError, match="narrower"):
        collect(two_grids, KEY, [parse_arm("method=florg"), parse_arm("learning-rate=0.001")])
    copy = tmp_path / "copy"
    write_run(copy, "florg", 0.001, 1.0, 0, 0.61)
    with pytest.raises(ValueError, match="same run"):
        collect([*two_grids, copy], KEY, [parse_arm(FLORG)])


def test_unfinished_runs_are_skipped(tmp_path):
    write_run(tmp_path, "florg", 0.001, 1.0, 0, 0.5)
    write_run(tmp_path, "florg", 0.001, 1.0, 1, 0.9, status="running")
    runs = collect([tmp_path], KEY, [parse_arm(FLORG)])
    assert [(r.seed, r.final) for r in runs] == [(0, 0.5)]


def test_main_gives_clear_errors(two_grids, tmp_path, capsys):
    args = [str(p) for p in two_grids]
    assert main([*args, "--key", KEY, "--arms", FLORG, FEDIT, "--chance", "0.36"]) == 0
    assert "the gap at" in capsys.readouterr().out
    assert main([str(tmp_path / "missing"), "--key", KEY, "--arms", FLORG]) == 2
    assert "no such folder" in capsys.readouterr().out
    assert main([*args, "--key", KEY, "--arms", "method=ffa-lora"]) == 2
    assert "no finished run" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main([*args, "--key", KEY, "--arms", f"method=florg,{KEY}=1"])
    assert "must not fix" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([*args, "--key", KEY, "--arms", FLORG, FLORG])
    assert "repeats" in capsys.readouterr().err
