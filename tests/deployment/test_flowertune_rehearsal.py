"""The FlowerTune general-NLP track rehearsed on this CPU (scripts/flowertune_rehearsal.sh,
docs/flowertune.md): ``--preset flowertune-general-nlp`` on 20 simulated SuperNodes with
the offline SmolLM2-135M and a small local Alpaca-format file runs 2 rounds through
``florg launch``, records its MB against the budget every round (equal to what was
projected before launch) and ends with the submission folder, whose checkpoint loads as
the leaderboard's evaluation loads it."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from flower_app.cache import assets as asset_registry

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.integration


def smollm2() -> Path:
    if "SmolLM2-135M" not in asset_registry.load_registry()["models"]:
        reason = "SmolLM2-135M not fetched (python -m florg_tools.assets fetch --all)"
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(reason)  # scripts/test.sh fetches it: in CI, missing is an error
        pytest.skip(reason)
    return asset_registry.model_path("SmolLM2-135M")


def test_the_general_nlp_rehearsal_runs_two_rounds_and_writes_the_submission(tmp_path):
    base = smollm2()
    env = {**os.environ, "FLORG_OUTPUT_ROOT": str(tmp_path),
           "FLOWERTUNE_FLWR_HOME": str(tmp_path / "home")}  # fmt: skip
    out = tmp_path / "outputs"
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / "flowertune_rehearsal.sh"), str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    assert "<- this run" in log and "checks lifted" in log  # the projection, printed

    run_dir = out / "flowertune-rehearsal"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [0, 1, 2]
    assert all(r["comm-budget-mb"] == 200_000 for r in rows)
    assert 0 == rows[0]["comm-mb"] < rows[1]["comm-mb"] < rows[2]["comm-mb"]
    # what travelled is what was projected before launch (2 clients, both ways, 2 rounds,
    # 4 bytes a parameter), plus the messages' framing the projection leaves out (names,
    # dtypes, shapes, configs, metadata: comm-mb counts the serialised messages' bytes)
    projected = next(line for line in log.splitlines() if "<- this run" in line)
    projected_mb = float(projected.split()[2].replace(",", ""))
    assert projected_mb <= rows[2]["comm-mb"] <= 1.01 * projected_mb

    folder = run_dir / "submission"
    settings = json.loads((folder / "config.json").read_text())
    assert settings["flowertune-track"] == "general-nlp" and settings["leaderboard"] is False
    assert settings["num-server-rounds"] == 2 and settings["text-fields"] == "instruction"
    comm = json.loads((folder / "communication.json").read_text())
    assert comm["total-mb"] == pytest.approx(rows[2]["comm-mb"])
    assert comm["within-budget"] is True and comm["peft"] == "peft_2"
    assert "--peft-path=" in (folder / "README.md").read_text()

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, torch_dtype=torch.float32)
    loaded = PeftModel.from_pretrained(model, folder / "peft_2", torch_dtype=torch.float32)
    ids = torch.tensor([[1, 504, 3458, 314, 253, 1934, 30]])
    with torch.no_grad():
        adapted = loaded.eval()(input_ids=ids).logits
        with loaded.disable_adapter():
            plain = loaded(input_ids=ids).logits
    assert torch.isfinite(adapted).all() and (adapted - plain).abs().max() > 0
