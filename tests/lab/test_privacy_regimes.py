"""lab/florg_lab/privacy_regimes.py and its verdict-page blocks: runs of the
cross-silo grid (dp=example) and the cross-device one (dp=central, Poisson sampling),
written as the grids publish them, grouped into levels, paired by seed with ε = ∞."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from florg_lab import privacy_regimes
from florg_lab.page_text import Evidence
from florg_lab.privacy import Level
from florg_lab.privacy_regimes import REGIMES, collect_regime, markdown
from florg_lab.stats import paired_difference

SILO, DEVICE = REGIMES
NAMES = {"florg": "FLoRG", "fedit": "FedIT", "fed-sb": "Fed-SB"}
V2_LR = {"florg": 0.0005, "fedit": 0.004}  # evidence-v2's choices (the ε = ∞ runs' rate)
CHOSEN = {"florg": 0.001, "fedit": 0.002}  # the cross-silo tuning's choices at ε = 8


def write_run(folder: Path, config: dict, final: float, rows: list[dict], **summary) -> None:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config))
    done = {"status": "finished", "final-test-score": final, **summary}
    (folder / "summary.json").write_text(json.dumps(done))
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def silo_run(root: Path, method: str, lr: float, seed: int, final: float, target: float):
    config = {
        "method": method, "task": "movie-sentiment", "learning-rate": lr, "seed": seed,
        "dp": "example", "dp-sgd-target-epsilon": target, "dp-sgd-clipping-norm": 1.0,
    }  # fmt: skip
    rows = [{"round": 0, "dp-sgd-epsilon-max": 0.0}]
    for r in (1, 2):
        rows.append({
            "round": r, "clients": 6, "dp-sgd-clipped-fraction": 0.2 * r + 0.1 * seed,
            "dp-sgd-grad-norm-median": 2.0 * r, "dp-sgd-clipped-mean-norm": 0.5,
            "dp-sgd-noise-std": 0.1 * target, "dp-sgd-noise-norm": 3.0,
        })  # fmt: skip
    grid = "privacy-cross-silo" if target == 8 else "privacy-cross-silo-eps3"
    name = f"learning-rate={lr},method={method},seed={seed},task=movie-sentiment"
    eps = target - 0.01 * seed  # each client's delta differs: the largest is shown
    write_run(root / "lab/evidence/privacy-regimes/runs" / grid / name, config, final, rows,
              **{"dp-sgd-epsilon-max": eps})  # fmt: skip


# method -> level -> per-seed scores; "inf" from evidence-v2's runs
SILO_SCORES = {
    "florg": {"inf": [0.70, 0.60, 0.80], 8: [0.66, 0.55, 0.71], 3: [0.52, 0.50, 0.49]},
    "fedit": {"inf": [0.75, 0.49, 0.77], 8: [0.60, 0.49, 0.70], 3: [0.50, 0.51, 0.51]},
}


@pytest.fixture
def silo(tmp_path: Path) -> Path:
    """A repository with evidence-v2's summary and runs, and the cross-silo grid's runs:
    the chosen rate's at ε = 8 and 3, a tuning run at another rate (not shown), and
    evidence-v2 runs at a rate v2 did not choose (not ε = ∞)."""
    v2 = {"tasks": {"movie-sentiment": {"chance": 0.49, "methods": {
        m: {"lr": lr} for m, lr in V2_LR.items()}}}}  # fmt: skip
    (tmp_path / "lab/evidence/evidence-v2").mkdir(parents=True)
    (tmp_path / "lab/evidence/evidence-v2/summary.json").write_text(json.dumps(v2))
    v2_runs = tmp_path / "lab/evidence/evidence-v2/runs/evidence-v2"
    for method, levels in SILO_SCORES.items():
        for seed, score in enumerate(levels["inf"]):
            config = {"method": method, "task": "movie-sentiment", "seed": seed, "dp": "off",
                      "learning-rate": V2_LR[method]}  # fmt: skip
            write_run(v2_runs / f"{method}-{seed}", config, score, [{"round": 1, "clients": 6}])
            other = {**config, "learning-rate": V2_LR[method] * 2}
            write_run(v2_runs / f"{method}-{seed}-other", other, 0.1, [{"round": 1}])
        for target in (8, 3):
            for seed, score in enumerate(levels[target]):
                silo_run(tmp_path, method, CHOSEN[method], seed, score, target)
        silo_run(tmp_path, method, CHOSEN[method] * 4, 0, 0.2, 8)  # tuning, not chosen
    choices = {f"method={m},task=movie-sentiment": lr for m, lr in CHOSEN.items()}
    tuning = tmp_path / "lab/evidence/privacy-regimes/privacy-cross-silo-tuning.json"
    tuning.write_text(json.dumps({"choices": choices}))
    return tmp_path


def test_cross_silo_runs_group_by_target_epsilon_with_v2s_runs_at_infinity(silo):
    runs = collect_regime(SILO, silo, NAMES)
    assert len(runs) == 18  # 2 methods x 3 levels x 3 seeds: no tuning or unchosen run
    levels = {r.level for r in runs}
    assert levels == {Level("off", None), Level("example", None, target_epsilon=8.0),
                      Level("example", None, target_epsilon=3.0)}  # fmt: skip
    assert Level("example", None, target_epsilon=8.0).label() == "DP-SGD, target ε = 8"
    florg_inf = {r.seed: r.final for r in runs if r.arm == "FLoRG" and not r.level.private}
    assert florg_inf == dict(enumerate(SILO_SCORES["florg"]["inf"]))
    assert all(math.isinf(r.epsilon) for r in runs if not r.level.private)


def test_the_cross_silo_block_pairs_each_level_with_infinity_by_seed(silo):
    ev = Evidence(silo)
    text = privacy_regimes.privacy_regime("cross-silo")(ev)
    rows = [line for line in text.splitlines() if line.startswith("| FLoRG | DP-SGD")]
    # least private first; the level's epsilon is the largest client's over the seeds
    assert [row.split(" | ")[2] for row in rows] == ["8.00", "3.00"]
    florg = SILO_SCORES["florg"]
    cost = paired_difference(florg[3], florg["inf"]).difference
    assert f"{cost.mean:+.3f} [{cost.low:+.3f}, {cost.high:+.3f}]" in rows[1]
    gap = paired_difference(florg[8], SILO_SCORES["fedit"][8]).difference
    assert f"- ε = 8.00: FLoRG − FedIT: {gap.mean:+.3f}" in text
    mechanism = [line for line in text.splitlines() if line.startswith("| FLoRG | 8.00")]
    cells = mechanism[0].split(" | ")
    # the clipped fraction 0.2 r + 0.1 seed over rounds 1-2 and seeds 0-2: median 0.4
    assert float(cells[3]) == pytest.approx(0.4) and float(cells[4]) == pytest.approx(3.0)
    assert "clipped fraction (mean client)" in text
    figure = "![test score against ε, cross-silo](../lab/evidence/privacy-regimes/cross-silo.png)"
    assert figure in text


def test_the_figure_is_due_and_drawn_once_a_private_run_is_published(silo, tmp_path):
    ev = Evidence(silo)
    assert privacy_regimes.privacy_regime_drawn("cross-silo")(ev)
    assert not privacy_regimes.privacy_regime_drawn("cross-device")(ev)
    path = tmp_path / "out.png"
    assert privacy_regimes.privacy_regime_figure("cross-silo")(ev, path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_an_unpublished_regime_says_so_and_counts_the_runs(silo):
    text = markdown(DEVICE, silo, NAMES, 0.36, "x.png")
    assert text.startswith("Not yet run: lab/grids/privacy-cross-device.yaml is written from")
    assert "0 of at least 27 runs published" in text
    grid_file = silo / "lab/grids/privacy-cross-device.yaml"
    grid_file.parent.mkdir(parents=True)
    grid_file.write_text("name: privacy-cross-device\n")  # once written, it is queued
    assert markdown(DEVICE, silo, NAMES, 0.36, "x.png").startswith(
        "Not yet run: lab/grids/privacy-cross-device.yaml is queued in "
        "`bash lab/scripts/evidence_queue.sh`; 0 of at least 27"
    )
    empty = silo / "empty"
    (empty / "lab/evidence/evidence-v2").mkdir(parents=True)
    v2_summary = (silo / "lab/evidence/evidence-v2/summary.json").read_text()
    (empty / "lab/evidence/evidence-v2/summary.json").write_text(v2_summary)
    assert markdown(SILO, empty, NAMES, 0.49, "x.png").startswith(
        "Not yet run: lab/grids/privacy-cross-silo.yaml is queued in "
        "`bash lab/scripts/evidence_queue.sh`; 0 of at least 15"
    )


def test_cross_device_levels_name_z_and_q_and_show_the_sampled_clients(tmp_path):
    root = tmp_path / "lab/evidence/privacy-regimes/runs/privacy-cross-device"
    for method in ("florg", "fedit"):
        for seed in (0, 1):
            base = {"method": method, "task": "snli", "seed": seed, "learning-rate": 0.002,
                    "client-sampling": "poisson", "fraction-train": 0.05}  # fmt: skip
            off_rows = [{"round": 1, "clients": 50, "update-norm-median": 1.0}]
            write_run(root / f"{method}-off-{seed}", {**base, "dp": "off"}, 0.6, off_rows)
            private = {**base, "dp": "central", "dp-noise-multiplier": 1.2,
                       "dp-clipping-norm": 0.5}  # fmt: skip
            rows = [{"round": 1, "clients": 48, "dp-sampled": 48 + seed, "dp-divisor": 50,
                     "dp-clipped": 3, "dp-noise-std": 0.012}]  # fmt: skip
            write_run(root / f"{method}-z-{seed}", private, 0.5 - 0.01 * seed, rows,
                      **{"dp-epsilon": 7.9, "dp-delta": 1e-4})  # fmt: skip
    runs = collect_regime(DEVICE, tmp_path, NAMES)
    assert {r.level.label() for r in runs} == {"off", "central, z = 1.2, q = 0.05"}
    text = markdown(DEVICE, tmp_path, NAMES, 0.36, "x.png")
    assert "| FLoRG | central, z = 1.2, q = 0.05 | 7.90 | 0.5 |" in text
    assert "sampled clients" in text and "divisor" in text
    assert "tuning" not in text.splitlines()[0]  # one rate per method in the grid: no tuning
    mech = next(line for line in text.splitlines() if line.startswith("| FedIT | 7.90"))
    assert " 48.5 | 50 |" in mech  # the sampled count's median over seeds 0-1, then q N


def test_fed_sb_s1_arms_replace_the_s4_ones_which_stay_labelled(silo):
    """Fed-SB's arm is read from its s = 1 grids (their tuning's choice, its s = 1 protocol
    v2 runs at ε = ∞); its s = 4 runs in the regime's grids stay as a second arm, named so;
    a grid of the s = 1 arm with nothing published is named with its command."""
    s1 = silo / privacy_regimes.FED_SB_S1
    s4_choice, s1_choice, s1_v2 = 3.125e-5, 0.008, 0.032
    for seed, (s4, s1_score) in enumerate([(0.49, 0.494), (0.48, 0.490), (0.47, 0.489)]):
        silo_run(silo, "fed-sb", s4_choice, seed, s4, 8)
        config = {"method": "fed-sb", "task": "movie-sentiment", "learning-rate": s1_choice,
                  "seed": seed, "dp": "example", "dp-sgd-target-epsilon": 8,
                  "dp-sgd-clipping-norm": 1.0}  # fmt: skip
        rows = [{"round": 1, "clients": 6, "dp-sgd-clipped-fraction": 1.0}]
        write_run(s1 / "runs/fed-sb-s1-privacy-cross-silo" / f"s1-{seed}", config, s1_score,
                  rows, **{"dp-sgd-epsilon-max": 7.99})  # fmt: skip
        off = {"method": "fed-sb", "task": "movie-sentiment", "seed": seed, "dp": "off",
               "learning-rate": s1_v2}  # fmt: skip
        write_run(s1 / "runs/fed-sb-s1-v2-lr4x" / f"v2-{seed}", off, 0.7, [{"round": 1}])
    # a tuning run at another rate, not shown
    write_run(s1 / "runs/fed-sb-s1-privacy-cross-silo/s1-tune", {**config, "seed": 0,
              "learning-rate": 0.002}, 0.1, rows, **{"dp-sgd-epsilon-max": 7.99})  # fmt: skip
    (s1 / "fed-sb-s1-privacy-cross-silo-tuning.json").write_text(
        json.dumps({"choices": {"method=fed-sb,task=movie-sentiment": s1_choice}}))  # fmt: skip
    summary = {"tasks": {"movie-sentiment": {"methods": {"fed-sb": {"lr": s1_v2}}}}}
    (s1 / "summary.json").write_text(json.dumps(summary))
    tuning = silo / "lab/evidence/privacy-regimes/privacy-cross-silo-tuning.json"
    choices = json.loads(tuning.read_text())["choices"]
    tuning.write_text(json.dumps({"choices": {
        **choices, "method=fed-sb,task=movie-sentiment": s4_choice}}))  # fmt: skip

    runs = collect_regime(SILO, silo, NAMES)
    arms = {(r.arm, r.level.label(), r.seed): r.final for r in runs if "Fed-SB" in r.arm}
    assert arms == {
        **{("Fed-SB", "DP-SGD, target ε = 8", s): v for s, v in enumerate([0.494, 0.49, 0.489])},
        **{("Fed-SB", "off", s): 0.7 for s in range(3)},
        **{(privacy_regimes.FED_SB_BEFORE, "DP-SGD, target ε = 8", s): v
           for s, v in enumerate([0.49, 0.48, 0.47])},
    }  # fmt: skip
    text = markdown(SILO, silo, NAMES, 0.49, "x.png")
    assert "| Fed-SB (s = 4, before the fix) | DP-SGD, target ε = 8 |" in text
    assert "Fed-SB: fed-sb-s1-privacy-cross-silo-eps3 not run yet" in text
    assert "Fed-SB: fed-sb-s1-privacy-cross-silo not run yet" not in text
