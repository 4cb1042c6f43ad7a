"""Accuracy per byte (lab/florg_lab/page_encodings.py) on small synthetic evidence whose
numbers are known: the published fp32 runs found by protocol v2's summaries, the encoded
runs by their configs' encodings, the paired difference and the goal, fp32's bytes taken
from the check run, bytes to FedIT-fp32's final score, and a run at the wrong rate refused.

Scores are multiples of 1/8 and byte counts integers, so every comparison is exact."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from florg_lab import page_encodings as pe
from florg_lab.page_text import Evidence
from florg_lab.page_v2 import EXACT, V2, task_folders

TASK = "movie-sentiment"
ROUNDS, CLIENTS = 20, 6
TEST_ROUNDS = (0, 10, 20)
RATES = {"florg": 0.0005, "fedit": 0.004, "rolora": 0.001}
SEEDS = (0, 1, 2)
# per client per round, each way
BYTES = {"fp32": 1000, "bf16": 500, "int8": 260}
FP32 = {  # seed -> test scores at TEST_ROUNDS
    "florg": {0: [0.5, 0.625, 0.75], 1: [0.5, 0.75, 0.875], 2: [0.5, 0.625, 0.75]},
    "fedit": {0: [0.5, 0.75, 0.875], 1: [0.5, 0.75, 0.875], 2: [0.5, 0.75, 0.875]},
}


def write_run(folder: Path, method: str, seed: int, scores: list[float], **config) -> None:
    """A finished run; ``encoding`` in ``config`` (both ways) adds byte counts to its rows,
    the published fp32 runs have none (they predate the byte count)."""
    encoding = config.pop("encoding", None)
    name = f"method={method},seed={seed},enc={encoding}"
    run = folder / name
    run.mkdir(parents=True)
    settings = {"method": method, "seed": seed, "learning-rate": RATES[method], "task": TASK,
                **config}  # fmt: skip
    if encoding is not None and encoding != "fp32":
        settings.update({"uplink-encoding": encoding, "downlink-encoding": encoding})
    (run / "config.json").write_text(json.dumps(settings))
    (run / "summary.json").write_text(json.dumps({"status": "finished", "rounds": ROUNDS}))
    rows = []
    for t in range(ROUNDS + 1):
        row: dict = {"round": t, "up-params": 100 * CLIENTS * bool(t)}
        row["down-params"] = row["up-params"]
        if t:
            row.update(clients=CLIENTS, failures=0, rejected=0, screened=0)
            if encoding is not None:
                sent = BYTES[encoding] * CLIENTS + seed  # a seed's varints: a byte or two
                row.update({"uplink-bytes": sent, "downlink-bytes": BYTES[encoding] * CLIENTS})
        if t in TEST_ROUNDS:
            row["test-score"] = scores[TEST_ROUNDS.index(t)]
        rows.append(row)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """Protocol v2's published FLoRG and FedIT (no RoLoRA: the exact grid is absent), the
    encoded runs: bf16 equal to fp32 seed for seed, int8 an eighth lower on seeds 1 and 2;
    FLoRG's and FedIT's fp32 checks."""
    v2_folder, _ = task_folders(TASK)
    methods = {m: {"lr": RATES[m], "seeds": list(SEEDS)} for m in FP32}
    summary = tmp_path / V2
    summary.parent.mkdir(parents=True)
    summary.write_text(json.dumps({"tasks": {TASK: {"methods": methods}}}))
    encodings = tmp_path / pe.PUBLISHED / "runs" / pe.GRIDS[TASK]
    for method, by_seed in FP32.items():
        for seed, scores in by_seed.items():
            write_run(tmp_path / v2_folder, method, seed, scores)
            write_run(encodings, method, seed, scores, encoding="bf16")
            low = [s - (0.125 if seed else 0.0) for s in scores]
            write_run(encodings, method, seed, low, encoding="int8")
        write_run(encodings, method, 0, by_seed[0], encoding="fp32")
    assert not (tmp_path / EXACT).exists()
    # the grid plans these three seeds an arm (the real file, five seeds cut to three)
    grid = Path(__file__).parents[2] / "lab" / "grids" / f"{pe.GRIDS[TASK]}.yaml"
    text = grid.read_text()
    assert text.count("seed: [0, 1, 2, 3, 4]") == 6
    (tmp_path / "lab" / "grids").mkdir(parents=True)
    (tmp_path / "lab" / "grids" / grid.name).write_text(
        text.replace("seed: [0, 1, 2, 3, 4]", "seed: [0, 1, 2]")
    )
    return tmp_path


def test_the_arms_are_read_by_method_and_encoding(root):
    found = pe.arms(root, TASK)
    assert sorted(found.reference) == ["fedit", "florg"]
    assert sorted(found.encoded) == [(m, e) for m in ("fedit", "florg")
                                     for e in ("bf16", "fp32", "int8")]  # fmt: skip
    assert sorted(found.arm("florg", "int8")) == list(SEEDS)
    assert found.check("fedit") is not None and found.check("rolora") is None
    assert found.missing == ("rolora",)


def test_bytes_are_per_client_per_round_up_and_down():
    run = pe.Run("florg", 0, [
        {"round": 0},
        {"round": 1, "clients": 2, "uplink-bytes": 200, "downlink-bytes": 100},
        {"round": 2, "clients": 1, "screened": 1, "uplink-bytes": 400, "downlink-bytes": 0},
    ])  # fmt: skip
    assert pe.bytes_per_round(run) == (150 + 200) / 2


def table_rows(text: str) -> dict[str, list[str]]:
    """A markdown table's body rows by their first cell (head and rule left out)."""
    rows = [line.strip("|").split(" | ") for line in text.splitlines() if line.startswith("| ")]
    return {cells[0].strip(): [c.strip() for c in cells] for cells in rows[1:]}


def test_the_table_pairs_each_encoding_with_fp32_and_judges_the_goal(root):
    text = pe.table(TASK)(Evidence(root))
    rows = table_rows(text)
    fp32, bf16, int8 = rows["FLoRG fp32"], rows["FLoRG bf16"], rows["FLoRG int8"]
    assert fp32[3] == "(reference: published)" and fp32[5:] == ["2,000", "1.000"]  # check's
    assert bf16[3] == "+0.000 [+0.000, +0.000], 0 up / 0 down of 3" and bf16[4] == "met"
    assert bf16[5:] == ["1,000", "0.500"]
    # int8: an eighth lower on seeds 1 and 2, a mean of -1/12, its interval past -0.02
    assert int8[3].startswith("−0.083 [") and int8[3].endswith("0 up / 2 down of 3")
    assert int8[4] == "not met"
    # bytes per client per round: (260 * 6 + seed + 260 * 6) / 6, over fp32's 2000
    expected = sum((260 * 12 + s) / 6 for s in SEEDS) / 3 / 2000
    assert int8[6] == f"{expected:.3f}"
    assert "FLoRG 0.7500 (published 0.7500); FedIT 0.8750 (published 0.8750)" in text
    assert "RoLoRA: no published fp32 runs." in text


def test_an_arm_not_yet_whole_is_not_judged(root):
    folder = root / pe.PUBLISHED / "runs" / pe.GRIDS[TASK]
    for run in folder.glob("method=florg,seed=2,enc=int8"):
        for file in run.iterdir():
            file.unlink()
        run.rmdir()
    text = pe.table(TASK)(Evidence(root))
    # of the grid's 3 x (3 + 3 + 1) = 21 runs, FedIT's and FLoRG's 2 x 7 less the one removed
    assert text.startswith("13 of the grid's 21 runs published (`bash lab/scripts/")
    rows = table_rows(text)
    assert rows["FLoRG int8"][1] == "2"
    assert rows["FLoRG int8"][4] == "– (2 of 3 seeds run)"
    assert rows["FLoRG bf16"][4] == "met"


def test_fp32_at_every_seed_at_the_grids_commit_is_the_reference_and_the_drift_is_shown(root):
    """A grid that plans fp32 at every seed (SNLI's): once they are all in, the encoded arms
    pair with them, not with the published runs, and the drift between the two is printed."""
    grid = root / "lab" / "grids" / f"{pe.GRIDS[TASK]}.yaml"
    text = grid.read_text()
    assert text.count("seed: [0]\n") == 3  # the fp32 checks
    grid.write_text(text.replace("seed: [0]\n", "seed: [0, 1, 2]\n"))
    folder = root / pe.PUBLISHED / "runs" / pe.GRIDS[TASK]
    for seed in (1, 2):  # FLoRG's fp32 at the grid's commit: an eighth lower than published
        low = [s - 0.125 for s in FP32["florg"][seed]]
        write_run(folder, "florg", seed, low, encoding="fp32")
    found = pe.arms(root, TASK)
    assert found.same_commit == ("florg",)  # FedIT's fp32 has one of its three seeds
    assert found.reference["florg"] is found.arm("florg", "fp32")
    assert found.reference["fedit"] is found.published_fp32["fedit"]
    rows = table_rows(pe.table(TASK)(Evidence(root)))
    assert rows["FLoRG fp32"][3] == "(reference: the grid's commit)"
    assert rows["FedIT fp32"][3] == "(reference: published)"
    # int8 is an eighth lower on seeds 1 and 2, as the grid's own fp32 is: no difference left
    assert rows["FLoRG int8"][3] == "+0.000 [+0.000, +0.000], 0 up / 0 down of 3"
    assert rows["FLoRG int8"][4] == "met"
    assert rows["FLoRG bf16"][3].endswith("2 up / 0 down of 3")
    text = pe.table(TASK)(Evidence(root))
    assert "fp32 at the grid's commit − published fp32, paired" in text
    assert "FLoRG −0.083 [" in text and "0 up / 2 down of 3." in text
    # the check line compares the check with the published run, not with itself
    shutil.rmtree(folder / "method=florg,seed=0,enc=fp32")
    write_run(folder, "florg", 0, [0.5, 0.5, 0.5], encoding="fp32")
    pe._arms.cache_clear()  # the page reads a root's runs once
    text = pe.table(TASK)(Evidence(root))
    assert "(the check): FLoRG 0.5000 (published 0.7500)" in text


def test_the_verdict_judges_int8_per_method_on_accuracy_and_bytes(root, monkeypatch):
    text = pe.table(TASK)(Evidence(root))
    head = "The goal for int8 both ways (within ±0.01 of fp32, its interval inside ±0.02, "
    assert head + "at most 0.25 of fp32's bytes): " in text
    # int8 sends (260 * 12 + seed) / 6 of fp32's 2,000 bytes: 0.260 > 0.25
    assert "FLoRG: accuracy not met, bytes 0.260 of fp32's (not met); FedIT: accuracy not met" \
        in text  # fmt: skip
    assert "In all, methods judged 2: accuracy met by 0, the bytes by 0, both by 0." in text
    # FLoRG's int8 level with fp32 at every seed, FedIT's int8 short of a seed, a looser
    # bytes goal: FLoRG meets both parts, FedIT is named and not judged
    folder = root / pe.PUBLISHED / "runs" / pe.GRIDS[TASK]
    for name in ("method=florg,seed=1,enc=int8", "method=florg,seed=2,enc=int8",
                 "method=fedit,seed=2,enc=int8"):  # fmt: skip
        for file in (folder / name).iterdir():
            file.unlink()
        (folder / name).rmdir()
    for seed in (1, 2):
        write_run(folder, "florg", seed, FP32["florg"][seed], encoding="int8")
    monkeypatch.setattr(pe, "GOAL_BYTES", 0.3)
    found = pe.verdict(pe.arms(root, TASK))
    assert "FLoRG: accuracy met, bytes 0.260 of fp32's (met)" in found
    assert "FedIT not judged yet (2 of 3 seeds run)" in found
    assert found.endswith("In all, methods judged 1: accuracy met by 1, the bytes by 1, "
                          "both by 1.")  # fmt: skip


def test_a_run_at_another_rate_than_the_published_one_is_refused(root):
    folder = root / pe.PUBLISHED / "runs" / pe.GRIDS[TASK]
    write_run(folder, "florg", 3, [0.5, 0.5, 0.5], encoding="int8", **{"learning-rate": 0.001})
    with pytest.raises(ValueError, match="learning rate"):
        pe.arms(root, TASK)


def test_bytes_to_target_counts_bytes_to_fedit_fp32s_final(root, tmp_path):
    text = pe.bytes_to_target(TASK)(Evidence(root))
    assert "Target: FedIT fp32's final seed-mean test score, 0.875" in text
    assert "Bytes are counted per client" in text and "bytes per client per round" in text
    # FedIT int8: seed mean at round 20 is (0.875 + 0.75 + 0.75) / 3 < 0.875: not reached;
    # FedIT bf16 reaches it at round 20
    lines = [line for line in text.splitlines() if line.startswith("| FedIT int8 | 3 |")]
    assert lines and "not reached (best 0.792, round 20)" in lines[0]
    lines = [line for line in text.splitlines() if line.startswith("| FedIT bf16 | 3 |")]
    assert lines and " | 20 | 20,003 | 0.500 | " in lines[0]  # half fp32's 40,000
    path = tmp_path / "figure.png"
    assert pe.figure(TASK)(Evidence(root), path) and path.stat().st_size > 0


def test_nothing_published_says_how_to_run_it(tmp_path):
    assert "not run yet" in pe.table(TASK)(Evidence(tmp_path))
    assert not pe.published(Evidence(tmp_path), TASK)
