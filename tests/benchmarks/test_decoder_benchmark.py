"""Smoke test of the decoder benchmark (benchmarks/core/decoder_benchmark.py): a tiny random
decoder, one step per method, through the real driver and its fresh worker processes. It
checks that the benchmark runs and prints its ratio lines; no timing is asserted."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

from benchmarks import REPO_ROOT


def test_quick_run_prints_the_ratio_lines():
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.core.decoder_benchmark", "--quick", "--device", "cpu"],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO_ROOT,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    time_line = re.search(r"tiny-bf16: step time FLoRG / LoRA (\d+\.\d+) \(cpu time", out)
    mem_line = re.search(r"tiny-bf16: peak memory FLoRG / LoRA (\d+\.\d+) \(VmHWM", out)
    assert time_line and mem_line, out
    assert "(target <= 1.05:" in out and "(target <= 1.03:" in out
    result = json.loads(out.strip().splitlines()[-1])["arms"]["tiny-bf16"]
    assert abs(result["time_ratio"] - float(time_line.group(1))) < 1e-3  # printed to 3 places
    assert result["time_ratio"] > 0 and result["memory_ratio"] > 0
    assert result["florg_peak_bytes"] > 0 and result["lora_peak_bytes"] > 0


def test_the_smollm2_shaped_arm_has_the_assets_parameter_count():
    """The random-weight SmolLM2 arms (for machines without the asset) build a decoder of
    SmolLM2-135M's shape: 272 parameter tensors, 134,515,008 parameters, as the asset's
    safetensors hold (30 layers x 9 tensors, the embedding, the final norm)."""
    from benchmarks.core.decoder_benchmark import SHAPE_ARMS, build_base

    shaped = build_base(SHAPE_ARMS["smollm2shape-fp32"], seed=0)
    params = dict(shaped.named_parameters())
    assert len(params) == 272
    assert sum(p.numel() for p in params.values()) == 134_515_008
    assert tuple(params["model.layers.0.self_attn.v_proj.weight"].shape) == (192, 576)
