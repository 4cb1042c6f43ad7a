"""The launcher leaves no Flower process running: docs/faults.md's resume command,
``python -m florg_tools.launch --resume RUN_DIR``, on the quickstart's local-simulation
connection (address ':local:', whose SuperLink ``flwr run`` would start detached and leave
running). It runs in the deployment tests' process (scripts/test.sh): it starts SuperLinks
and waits on them, as those tests do."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from florg_tools.synthetic import make_sentiment_task, make_tiny_bert

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
NODES = 2


def flower_processes_of(home: Path) -> list[psutil.Process]:
    """The running flower-superlink / flower-superexec processes started for ``home``
    (their environment's FLWR_HOME)."""
    found = []
    for proc in psutil.process_iter(["name", "cmdline"]):
        try:
            words = " ".join(proc.info["cmdline"] or [proc.info["name"] or ""])
            ours = "flower-superlink" in words or "flower-superexec" in words
            if ours and proc.environ().get("FLWR_HOME") == str(home):
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def test_a_run_and_its_documented_resume_leave_no_flower_process(tmp_path):
    """A 1-round run, then the documented resume extending it to 2 rounds: both complete,
    the rows are rounds 0..2 once each, and no SuperLink or SuperExec started for that
    Flower home is left running after either launch."""
    model = make_tiny_bert(tmp_path / "model")
    task = make_sentiment_task(tmp_path / "task", n_train=60, n_eval=20, n_test=0)
    home, out = tmp_path / "flwr-home", tmp_path / "outputs"
    subprocess.run(
        [sys.executable, "-m", "florg_tools.flwr_home", "setup", "--flwr-home", str(home),
         "--num-supernodes", str(NODES), "--num-cpus", "1"],
        cwd=ROOT, check=True, capture_output=True,
    )  # fmt: skip
    env = {**os.environ, "FLWR_HOME": str(home), "FLORG_OUTPUT_ROOT": str(tmp_path),
           "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1", "HF_HUB_OFFLINE": "1"}  # fmt: skip
    settings = {"model": model, "task": "local", "data-path": task, "text-fields": "sentence",
                "rank": 2, "num-server-rounds": 1, "min-available-nodes": NODES,
                "batch-size": 16, "max-eval-examples": 20, "output-dir": out,
                "run-name": "resumed", "tensorboard": "off"}  # fmt: skip
    first = [arg for key, value in settings.items() for arg in ("--set", f"{key}={value}")]
    commands = (first, ["--resume", str(out / "resumed"), "--set", "num-server-rounds=2"])
    try:
        for args in commands:
            done = subprocess.run(
                [sys.executable, "-m", "florg_tools.launch", "--quiet", *args],
                cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
            )  # fmt: skip
            assert done.returncode == 0, done.stderr[-3000:]
            assert flower_processes_of(home) == []
        rows = (out / "resumed" / "metrics.jsonl").read_text().splitlines()
        assert [json.loads(r)["round"] for r in rows] == [0, 1, 2]
    finally:
        for proc in flower_processes_of(home):  # what a failing launcher left behind
            proc.kill()
