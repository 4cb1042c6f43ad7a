"""docs/secure-aggregation.md's evidence block (lab/florg_lab/page_secure.py) on small
synthetic runs whose numbers are known: arms found by their configs (method, dp, secure),
the paired difference over the seeds both arms finished, the goal met and missed, the
uplink bytes, failed secure rounds and the round where a seed's arms part read from the
rows, unfinished runs left out, and a pair not yet run saying how many seeds each arm holds.

Scores are multiples of 1/8 and byte counts integers, so every comparison is exact."""

from __future__ import annotations

import json
from pathlib import Path

from florg_lab import page_secure as ps
from florg_lab.page_text import Evidence


def write_run(root: Path, method: str, seed: int, score: float, secure: bool, **extra) -> None:
    status = extra.pop("status", "finished")
    dp = extra.pop("dp", "off")
    failed = extra.pop("secure_failed", 0)
    part_at = extra.pop("part_at", None)  # secure: validation scores an eighth up from there
    name = f"method={method},dp={dp},secure={secure},seed={seed}"
    run = root / ps.PUBLISHED / name
    run.mkdir(parents=True)
    config = {"method": method, "seed": seed, "dp": dp,
              "secure-aggregation": "secaggplus" if secure else "off"}  # fmt: skip
    (run / "config.json").write_text(json.dumps(config))
    (run / "summary.json").write_text(json.dumps({"status": status, "final-test-score": score}))
    up = 2000 if secure else 1000
    rows = [{"round": 0, "score": 0.5}] + [
        {"round": t, "uplink-bytes-per-client": up + 2 * t, "secure-failed": failed * (t == 1),
         "score": 0.5 + 0.125 * (secure and part_at is not None and t >= part_at)}
        for t in (1, 2)
    ]  # fmt: skip
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_pairs_their_differences_goal_bytes_and_waiting_pairs(tmp_path: Path):
    # FedIT: secure equal to plain on seeds 0-2 (the goal met); seed 3's secure run unfinished
    for seed, score in enumerate([0.75, 0.625, 0.875]):
        write_run(tmp_path, "fedit", seed, score, secure=False)
        write_run(tmp_path, "fedit", seed, score, secure=True, secure_failed=1)
    write_run(tmp_path, "fedit", 3, 0.5, secure=False)
    write_run(tmp_path, "fedit", 3, 0.5, secure=True, status="failed")
    # RoLoRA: secure an eighth lower on every seed (the goal missed), the validation
    # scores parting at round 2 (seed 0) and round 1 (seed 1)
    for seed in (0, 1):
        write_run(tmp_path, "rolora", seed, 0.75, secure=False)
        write_run(tmp_path, "rolora", seed, 0.625, secure=True, part_at=2 - seed)
    write_run(tmp_path, "florg", 0, 0.75, secure=False)  # one plain seed, no secure one
    text = ps.secure_table(Evidence(tmp_path))
    assert text.startswith("12 finished runs of the grid's 40")  # 7 FedIT, 4 RoLoRA, 1 FLoRG
    rows = {line.split(" | ")[0].lstrip("| "): line for line in text.splitlines()[4:]}
    fedit = rows["FedIT"]
    assert "| +0.000 [+0.000, +0.000] |" in fedit  # equal seed for seed: a zero-width interval
    assert "0: +0.000 / 1: +0.000 / 2: +0.000" in fedit and "| met |" in fedit
    assert "| 0: – / 1: – / 2: – |" in fedit  # equal validation scores at every round
    assert "1,003 → 2,003 (2.00x)" in fedit  # rows 1 and 2: 1002, 1004; 2002, 2004
    assert fedit.rstrip(" |").endswith("3")  # one failed secure round in each of 3 runs
    rolora = rows["RoLoRA"]
    assert "| −0.125 [−0.125, −0.125] |" in rolora and "0: −0.125 / 1: −0.125" in rolora
    assert "| missed |" in rolora and "| 0: 2 / 1: 1 |" in rolora
    assert "seeds finished: 1 plain, 0 secure" in rows["FLoRG"]
    assert "seeds finished: 0 plain, 0 secure" in rows["FedIT + dp=central"]


def test_dp_central_runs_are_their_own_pair(tmp_path: Path):
    for seed, score in enumerate([0.75, 0.5]):
        write_run(tmp_path, "fedit", seed, score, secure=False, dp="central")
        write_run(tmp_path, "fedit", seed, score + 0.125, secure=True, dp="central")
    text = ps.secure_table(Evidence(tmp_path))
    rows = {line.split(" | ")[0].lstrip("| "): line for line in text.splitlines()[4:]}
    assert "seeds finished: 0 plain, 0 secure" in rows["FedIT"]
    assert "0: +0.125 / 1: +0.125" in rows["FedIT + dp=central"]
