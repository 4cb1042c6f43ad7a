"""The template comparison (benchmarks/overhead/template_comparison.py): its reading of a
run's streamed log (rounds timed from Flower's round lines to the strategy's end, each
round's aggregated training loss), the printed intervals and ratios over repetitions, and
the run-time patch that gives the template a float32 base, dropout 0 and the repetition's
seed (on a stand-in for the template's modules, with real transformers and PEFT). The
comparison itself needs the template's checkout and its own environment: its command is
in docs/benchmarks.md."""

from __future__ import annotations

import pytest

from benchmarks.overhead.template_comparison import Repetition, Side, comparison_lines

LOG = [
    (0.0, "INFO :      Starting FedAvg strategy:"),
    (1.0, "INFO :      [ROUND 1/2]"),
    (4.0, "(ClientAppActor pid=1) {'train_runtime': 4.6, 'train_loss': 1.23, 'epoch': 0.08}"),
    (5.0, "INFO :      └──> Aggregated MetricRecord: {'train_loss': 2.5}"),
    (9.0, "INFO :      [ROUND 2/2]"),
    (14.0, "INFO :      └──> Aggregated MetricRecord: {'train_loss': 2.25}"),
    (17.0, "INFO :      Strategy execution finished in 16.00s"),
]


def read(name: str, log: list[tuple[float, str]]) -> Side:
    side = Side(name)
    for now, line in log:
        side.read(line, now)
    return side


def test_rounds_are_timed_from_their_lines_and_each_rounds_aggregated_loss_kept():
    """A client's own Trainer line (printed by its actor, at times after the round's
    aggregation) is not a round's loss."""
    side = read("template", LOG)
    assert side.seconds_per_round() == pytest.approx((17.0 - 1.0) / 2)
    assert side.train_losses == [2.5, 2.25] and side.train_loss == 2.25


def repetition(seed: int, speed: float, losses: list[float]) -> Repetition:
    ours = read("app", [(t * speed, line.replace("train_loss", "train-loss")) for t, line in LOG])
    template = read("template", LOG)
    ours.peak_rss, template.peak_rss = 2**30, 2**31
    ours.peak_by_role = {"ServerApp": 2**29, "ClientApps": 2**29}
    template.peak_by_role = {"ServerApp": 2**28, "ClientApps": 2**30, "Flower and Ray": 2**29}
    ours.train_losses = losses
    return Repetition(seed, ours, template, 100.0, 200.0)


def test_repetitions_print_intervals_ratios_and_the_loss_at_each_round():
    lines = comparison_lines(
        [
            repetition(0, 0.4, [2.0, 1.5]),
            repetition(1, 0.5, [2.2, 1.75]),
            repetition(2, 0.6, [2.4, 2.0]),
        ]  # fmt: skip
    )
    seconds = next(line for line in lines if line.startswith("seconds per round"))
    # the app's 8 s a round scaled by 0.4, 0.5, 0.6: 4.0 ± t(0.975, 2) * 0.8 / sqrt(3)
    assert "4.0 ± 2.0 s" in seconds and "8.0 ± 0.0 s" in seconds and "0.50 ± 0.25x" in seconds
    memory = next(line for line in lines if line.startswith("peak memory"))
    assert "1,024.0 ± 0.0 MB" in memory and "2,048.0 ± 0.0 MB" in memory
    assert memory.endswith("0.50 ± 0.00x")
    by_role = {line.split("  ")[1]: line for line in lines if line.startswith("  ")}
    assert by_role["ServerApp"].endswith("2.00 ± 0.00x")  # 512 MB against 256 MB
    assert by_role["ClientApps"].endswith("0.50 ± 0.00x")
    assert "0.0 ± 0.0 MB" in by_role["Flower and Ray"]  # none of this app's: 0, ratio 0
    assert next(line for line in lines if line.startswith("bytes per round")).endswith(
        "0.50 ± 0.00x"
    )
    round_2 = next(line for line in lines if line.strip().startswith("round 2"))
    # the app's 1.5, 1.75, 2.0 against the template's 2.25 each time: sd 0.25, the half-width
    # t(0.975, 2) * 0.25 / sqrt(3) = 0.6210
    assert "1.7500 ± 0.6210" in round_2 and "2.2500 ± 0.0000" in round_2
    assert round_2.endswith("-0.5000 ± 0.6210")


def test_each_process_of_a_tree_has_its_role():
    from benchmarks.overhead.template_comparison import process_role

    assert process_role("/v/bin/python /v/bin/flwr-simulation --runtime-api-address x") == (
        "ServerApp"
    )
    assert process_role("ray::ClientAppActor.run") == "ClientApps"
    assert process_role("ray::ClientAppActor") == "ClientApps"
    assert process_role("/v/bin/python /v/bin/flower-superlink --insecure") == "Flower and Ray"


def test_losses_read_unalike_are_reported_not_compared():
    rep = repetition(0, 0.5, [2.0])  # one round of losses against the template's two
    assert "not read alike" in comparison_lines([rep])[-1]


def test_a_log_without_a_finished_round_is_an_error():
    with pytest.raises(ValueError, match="no complete round"):
        read("template", LOG[:2]).seconds_per_round()


def test_failed_training_replies_are_counted():
    """A round whose clients failed times nothing worth comparing: the benchmark stops
    with the errors (run_side) once its log counted them."""
    side = read(
        "template", [(0.0, "INFO :      aggregate_train: Received 0 results and 2 failures")]
    )
    assert side.failures == 2


def test_a_side_that_prints_nothing_is_stopped_at_its_timeout():
    """The deadline holds without a line to check it on: a silent process is killed."""
    import subprocess
    import sys
    import time

    from benchmarks.overhead.template_comparison import read_until

    silent = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                              stdout=subprocess.PIPE, text=True)  # fmt: skip
    start = time.monotonic()
    assert read_until(silent, lambda line: None, timeout=1.0) is False
    assert time.monotonic() - start < 30 and silent.poll() is not None
    lines: list[str] = []
    talking = subprocess.Popen([sys.executable, "-c", "print('a'); print('b')"],
                               stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert read_until(talking, lines.append, timeout=60.0) is True and lines == ["a", "b"]


STAND_IN = {  # the template's two patched modules, reduced to the calls the patch changes
    "flowertune_llm/__init__.py": "",
    "flowertune_llm/models.py": """
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, BitsAndBytesConfig


def get_model(name):
    model = AutoModelForCausalLM.from_pretrained(
        name,
        quantization_config=BitsAndBytesConfig(load_in_4bit=True),
        torch_dtype=torch.bfloat16,
    )
    config = LoraConfig(r=2, lora_alpha=4, lora_dropout=0.075, task_type="CAUSAL_LM")
    return get_peft_model(model, config)
""",
    "flowertune_llm/client_app.py": """
from dataclasses import dataclass


@dataclass
class TrainingArguments:
    output_dir: str = ""
    seed: int = 42


def arguments():
    return TrainingArguments(output_dir="out")
""",
}

PROBE = """
import json, sys
from flowertune_llm.client_app import arguments
from flowertune_llm.models import get_model
model = get_model(sys.argv[1])
dropouts = {getattr(m, "p", 0.0)  # PEFT's dropout 0 is an Identity
            for n, m in model.named_modules() if n.endswith("lora_dropout.default")}
print(json.dumps({"dtype": str(next(model.parameters()).dtype), "seed": arguments().seed,
                  "dropouts": sorted(dropouts)}))
"""


def run_stand_in(tmp_path, env_extra: dict[str, str]) -> dict:
    """PROBE in a fresh interpreter with the stand-in on its path after ``env_extra``'s."""
    import json
    import os
    import subprocess
    import sys

    from florg_tools.synthetic import make_tiny_causal_lm

    for name, text in STAND_IN.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    model = make_tiny_causal_lm(tmp_path / "base")
    env = {**os.environ, **env_extra}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [env_extra.get("PYTHONPATH"), str(tmp_path)]))
    done = subprocess.run([sys.executable, "-c", PROBE, str(model)], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    found = json.loads(done.stdout.splitlines()[-1]) if done.returncode == 0 else {}
    return {"rc": done.returncode, "stderr": done.stderr, **found}


def test_the_patch_gives_the_template_a_float32_base_dropout_0_and_the_seed(tmp_path):
    """Through the real import system: the stand-in's get_model asks for a 4-bit
    bitsandbytes base in bfloat16 with dropout 0.075 (bitsandbytes is not installed here,
    so unpatched it cannot load at all); patched, it loads in float32 with dropout 0 and
    seed 3, and the marker records both for check_template_patch."""
    from benchmarks.overhead.template_comparison import check_template_patch, template_env

    marker = tmp_path / "marker.jsonl"
    found = run_stand_in(tmp_path, template_env("float32", 3, marker))
    assert found["rc"] == 0, found["stderr"][-2000:]
    assert (found["dtype"], found["dropouts"], found["seed"]) == ("torch.float32", [0.0], 3)
    check_template_patch(marker, "float32", 3)  # raises if the marker says otherwise
    with pytest.raises(RuntimeError, match="seeds were"):
        check_template_patch(marker, "float32", 4)


def test_without_the_patch_the_stand_in_asks_for_bitsandbytes_and_the_check_refuses(tmp_path):
    """The same probe without the patch: get_model keeps its 4-bit request (it fails for
    want of bitsandbytes, or loads with it: seed 42, dropout 0.075); a run that left no
    marker is refused."""
    from benchmarks.overhead.template_comparison import check_template_patch

    found = run_stand_in(tmp_path, {})
    if found["rc"] == 0:  # bitsandbytes installed: the template's own numerics, unpatched
        assert (found["seed"], found["dropouts"]) == (42, [0.075])
    else:
        assert "bitsandbytes" in found["stderr"].lower()
    with pytest.raises(RuntimeError, match="did not reach"):
        check_template_patch(tmp_path / "absent.jsonl", "float32", 0)
