"""florg_lab.privacy: test score against ε, per method, paired by seed."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from florg_lab.contrast import parse_arm
from florg_lab.privacy import Level, collect, main, report
from florg_lab.stats import mean_interval, paired_difference

FLORG = "method=florg,learning-rate=0.0005"
FEDIT = "method=fedit,learning-rate=0.004"
DELTA = 1 / 2400
# (z, epsilon) as the accountant would report them for q = 1, T = 20 at DELTA
BUDGETS = {2.434: 8.0, 7.697: 2.0}


def write_run(
    root: Path,
    method: str,
    seed: int,
    final: float,
    *,
    z: float | None = None,
    clip: float = 1.0,
    epsilon: float | None = None,
    name: str | None = None,
) -> Path:
    lr = 0.0005 if method == "florg" else 0.004
    folder = root / (name or f"{method},{z},{seed}")
    folder.mkdir(parents=True)
    config = {"method": method, "learning-rate": lr, "seed": seed, "dp": "off"}
    summary: dict[str, object] = {"status": "finished", "final-test-score": final}
    if z is not None:
        config |= {"dp": "central", "dp-noise-multiplier": z, "dp-clipping-norm": clip}
        summary |= {
            "dp-epsilon": BUDGETS[z] if epsilon is None else epsilon,
            "dp-delta": DELTA,
        }
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "summary.json").write_text(json.dumps(summary))
    rows = [{"round": 0, "update-norm-median": 99.0}]  # round 0 trains nothing: not counted
    for round_ in (1, 2, 3):
        row = {"round": round_, "clients": 6, "update-norm-median": clip * round_ / 2}
        if z is not None:
            row |= {"dp-clipped": round_ - 1, "dp-noise-std": z * clip / 6 * (1 + seed)}
        rows.append(row)
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


SCORES = {  # method -> z -> per-seed test scores
    "florg": {None: [0.70, 0.60, 0.80], 2.434: [0.66, 0.55, 0.71], 7.697: [0.52, 0.50, 0.49]},
    "fedit": {None: [0.75, 0.49, 0.77], 2.434: [0.60, 0.49, 0.70], 7.697: [0.50, 0.49, 0.51]},
}


@pytest.fixture
def grid(tmp_path: Path) -> Path:
    root = tmp_path / "runs"
    for method, levels in SCORES.items():
        clip = 0.3 if method == "florg" else 1.7
        for z, scores in levels.items():
            for seed, score in enumerate(scores):
                write_run(root, method, seed, score, z=z, clip=clip)
    return root


def arms() -> list:
    return [parse_arm(FLORG), parse_arm(FEDIT)]


def test_runs_are_grouped_by_noise_multiplier_with_each_methods_own_clipping_norm(grid):
    runs = collect([grid], arms())
    assert len(runs) == 18
    levels = {r.level for r in runs}
    assert levels == {Level("off", None), Level("central", 2.434), Level("central", 7.697)}
    assert {r.clipping_norm for r in runs if r.arm == FLORG and r.level.private} == {0.3}
    assert all(math.isinf(r.epsilon) for r in runs if not r.level.private)


def test_table_rows_and_paired_differences(grid):
    text = report(collect([grid], arms()), [FLORG, FEDIT], chance=0.49)
    scores = text[: text.index("Paired by seed")]
    rows = [line for line in scores.splitlines() if line.startswith(f"| {FLORG}")]
    # least private first: epsilon = inf, then 8, then 2
    assert [row.split(" | ")[2] for row in rows] == ["∞", "8.00", "2.00"]
    florg = SCORES["florg"]
    inf_mean = mean_interval(florg[None])
    assert f"{inf_mean.mean:.3f} [{inf_mean.low:.3f}, {inf_mean.high:.3f}]" in rows[0]
    cost = paired_difference(florg[7.697], florg[None]).difference
    assert f"{cost.mean:+.3f} [{cost.low:+.3f}, {cost.high:+.3f}], higher on 0 of 3" in rows[2]
    assert "| 0.3 |" in rows[1] and "| 1.7 |" not in rows[1]
    gap = paired_difference(florg[2.434], SCORES["fedit"][2.434])
    d = gap.difference
    line = f"- ε = 8.00: {FLORG} − {FEDIT}: {d.mean:+.3f} [{d.low:+.3f}, {d.high:+.3f}]"
    assert line in text
    assert f"higher on {gap.wins} of 3" in text


def test_arms_at_one_budget_pair_across_noise_multipliers(tmp_path):
    # FedIT reaches epsilon = 8 at another z (as a method with a release before round 1
    # does): the two arms pair at that budget, in one line
    root = tmp_path / "runs"
    pairs = zip([0.66, 0.55, 0.71], [0.60, 0.49, 0.70], strict=True)
    for seed, (mine, theirs) in enumerate(pairs):
        write_run(root, "florg", seed, mine, z=2.434)
        write_run(root, "fedit", seed, theirs, z=2.5, epsilon=8.0)
    text = report(collect([root], arms()), [FLORG, FEDIT])
    paired = [line for line in text.splitlines() if line.startswith("- ε =")]
    d = paired_difference([0.66, 0.55, 0.71], [0.60, 0.49, 0.70]).difference
    assert paired == [
        f"- ε = 8.00: {FLORG} − {FEDIT}: {d.mean:+.3f} [{d.low:+.3f}, {d.high:+.3f}], "
        "higher on 3 of 3"
    ]


def test_a_level_whose_runs_report_different_epsilons_is_refused(tmp_path):
    root = tmp_path / "runs"
    write_run(root, "florg", 0, 0.6, z=2.434)
    write_run(root, "florg", 1, 0.6, z=2.434, epsilon=9.5)
    with pytest.raises(ValueError, match="different budgets"):
        report(collect([root], arms()), [FLORG, FEDIT])


def test_a_private_run_without_epsilon_is_refused(tmp_path):
    root = tmp_path / "runs"
    folder = write_run(root, "florg", 0, 0.6, z=2.434)
    summary = json.loads((folder / "summary.json").read_text())
    del summary["dp-epsilon"]
    (folder / "summary.json").write_text(json.dumps(summary))
    with pytest.raises(ValueError, match="no dp-epsilon"):
        collect([root], arms())


def test_a_reused_run_must_agree_with_its_rerun(tmp_path):
    first, second = tmp_path / "a", tmp_path / "b"
    write_run(first, "florg", 0, 0.6)
    write_run(second, "florg", 0, 0.6)
    assert len(collect([first, second], arms())) == 1
    write_run(second, "florg", 0, 0.61, name="again")
    with pytest.raises(ValueError, match="different test scores"):
        collect([first, second], arms())


def test_seeds_filter(grid):
    runs = collect([grid], arms(), seeds=[0, 2])
    assert {r.seed for r in runs} == {0, 2}


def test_main_writes_the_table_and_the_plot(grid, tmp_path, capsys):
    out = tmp_path / "published"
    assert main([str(grid), "--arms", FLORG, FEDIT, "--chance", "0.49", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    table = (out / "privacy-utility.md").read_text()
    assert table.strip() in printed
    assert (out / "privacy-utility.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_main_refuses_an_arm_that_fixes_the_privacy_level(grid):
    with pytest.raises(SystemExit) as raised:
        main([str(grid), "--arms", FLORG + ",dp=off"])
    assert raised.value.code == 2


def test_main_with_nothing_matching_fails_with_a_message(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert main([str(tmp_path / "empty"), "--arms", FLORG]) == 2
    assert "no finished run" in capsys.readouterr().out


def test_the_mechanism_table_holds_medians_over_rounds_and_seeds(grid):
    text = report(collect([grid], arms()), [FLORG, FEDIT])
    table = text[text.index("The mechanism") :].splitlines()
    cells = [line.split(" | ") for line in table if line.startswith("| method=")]
    rows = {tuple(c[:2]): c for c in cells}
    header = table[2].split(" | ")
    col = {name.strip(" |"): i for i, name in enumerate(header)}
    florg_8 = rows[(f"| {FLORG}", "8.00")]
    # update norms clip * round / 2 over rounds 1-3 of three seeds: median 0.3 * 2 / 2
    assert float(florg_8[col["update norm (median client)"]]) == pytest.approx(0.3)
    assert float(florg_8[col["clipped clients"]]) == 1.0
    # noise std z C / 6 * (1 + seed): the median over seeds 0-2 is the seed-1 value
    expected = 2.434 * 0.3 / 6 * 2
    assert float(florg_8[col["noise std"]]) == pytest.approx(expected, rel=1e-3)
    off = rows[(f"| {FEDIT}", "∞")]
    assert off[col["noise std"]].strip() == "–"  # dp=off rows carry no noise
    assert float(off[col["update norm (median client)"]]) == pytest.approx(1.7)
