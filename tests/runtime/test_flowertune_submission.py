"""The FlowerTune submission folder (flower_app/run_output/submission.py): its PEFT checkpoint
loads the way the leaderboard's evaluation scripts load it
(benchmarks/flowertune-llm/evaluation/*/eval.py in flwrlabs/flower:
``AutoModelForCausalLM.from_pretrained(base, quantization_config=..., torch_dtype=...)``
then ``PeftModel.from_pretrained(model, peft_path, torch_dtype=...)``) and computes what the
app's global model computes; here on the tiny causal LM in float32, and on a 4-bit base
where CUDA is there. A method without one global PEFT model writes none, saying why."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from florg_tools.synthetic import make_tiny_causal_lm
from flower_app.cache.per_process import cached_adapted_model
from flower_app.run_output.submission import write_submission
from flower_app.settings.config import resolve_config

ROUNDS = 3
INPUT_IDS = torch.tensor([[5, 9, 12, 7, 3, 11], [4, 4, 8, 15, 2, 6]])


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory) -> Path:
    return make_tiny_causal_lm(tmp_path_factory.mktemp("tiny-causal") / "base")


def rows(per_round: int) -> list[dict]:
    """Recorder rows of a run of ROUNDS rounds, ``per_round`` parameters each way."""
    out = [{"round": 0, "up-params": 0, "down-params": 0, "cum-up-params": 0,
            "cum-down-params": 0}]  # fmt: skip
    for t in range(1, ROUNDS + 1):
        out.append({"round": t, "up-params": per_round, "down-params": per_round,
                    "cum-up-params": t * per_round, "cum-down-params": t * per_round})  # fmt: skip
    return out


def trained_submission(base_dir: Path, tmp_path: Path, method: str):
    """A global model of ``method`` moved off its start, and its submission folder."""
    config = resolve_config(
        {},
        {"model": str(base_dir), "task": "squad-gen", "task-kind": "causal-lm",
         "method": method, "rank": 4, "alpha": 8.0, "num-server-rounds": ROUNDS,
         "flowertune-track": "general-nlp", "leaderboard": False},
    )  # fmt: skip
    adapted = cached_adapted_model.__wrapped__(config, 0, "causal-lm")
    rng = np.random.default_rng(0)
    state = adapted.shared_state()
    adapted.load_shared_state(
        {k: v + rng.normal(0.0, 0.3, v.shape).astype(v.dtype) for k, v in state.items()}
    )
    folder = write_submission(tmp_path, config, adapted, str(base_dir), rows(1000))
    return adapted, folder


def load_as_the_evaluation_does(base_dir: Path, peft_path: Path, quantization_config=None):
    """eval.py's calls, with the dtype it pairs with 4-bit (float32); no .to("cuda")."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    kwargs = {"quantization_config": quantization_config} if quantization_config else {}
    model = AutoModelForCausalLM.from_pretrained(base_dir, torch_dtype=torch.float32, **kwargs)
    return PeftModel.from_pretrained(model, peft_path, torch_dtype=torch.float32).eval()


@pytest.mark.parametrize("method", ["florg", "fedit", "ffa-lora"])
def test_the_checkpoint_loads_as_the_evaluation_loads_it_and_is_the_global_model(
    base_dir, tmp_path, method
):
    adapted, folder = trained_submission(base_dir, tmp_path, method)
    peft_path = folder / f"peft_{ROUNDS}"
    assert (peft_path / "adapter_config.json").is_file()
    assert (peft_path / "adapter_model.safetensors").is_file()
    adapter_config = json.loads((peft_path / "adapter_config.json").read_text())
    assert adapter_config["task_type"] == "CAUSAL_LM"
    assert adapter_config["base_model_name_or_path"] == str(base_dir)
    assert {n.rsplit(".", 1)[-1] for n in adapter_config["target_modules"]} == {
        "q_proj", "v_proj"
    }  # fmt: skip
    loaded = load_as_the_evaluation_does(base_dir, peft_path)
    with torch.no_grad():
        app = adapted.model.eval()(input_ids=INPUT_IDS).logits
        evaluated = loaded(input_ids=INPUT_IDS).logits
    torch.testing.assert_close(evaluated, app, rtol=0, atol=1e-5)
    from transformers import AutoModelForCausalLM

    with torch.no_grad():
        plain = AutoModelForCausalLM.from_pretrained(base_dir).eval()(input_ids=INPUT_IDS).logits
    assert (evaluated - plain).abs().max() > 1e-3  # the adapter does something

    settings = json.loads((folder / "config.json").read_text())
    assert settings["method"] == method and settings["flowertune-track"] == "general-nlp"
    comm = json.loads((folder / "communication.json").read_text())
    assert comm["total-mb"] == pytest.approx(ROUNDS * 2000 * 4 / 1024**2)
    assert [r["round"] for r in comm["rounds"]] == [1, 2, 3]
    assert comm["within-budget"] is True and comm["budget-mb"] == 200_000
    assert comm["leaderboard-checks"] is False and comm["peft"] == f"peft_{ROUNDS}"
    readme = (folder / "README.md").read_text()
    assert f"--peft-path={peft_path.resolve()}" in readme and "rehearsal" in readme


def test_a_method_with_personal_parts_writes_no_checkpoint_and_says_why(base_dir, tmp_path):
    _, folder = trained_submission(base_dir, tmp_path, "fedsa-lora")
    assert not list(folder.glob("peft_*"))
    comm = json.loads((folder / "communication.json").read_text())
    assert comm["peft"] is None and "personal parts" in comm["no-peft-reason"]
    assert "No PEFT checkpoint" in (folder / "README.md").read_text()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_checkpoint_loads_on_a_4bit_base_as_the_evaluation_loads_it(base_dir, tmp_path):
    """eval.py's 4-bit path: BitsAndBytesConfig(load_in_4bit=True), float32 elsewhere; the
    adapter's weights arrive as saved and the logits stay near the float32 model's."""
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import load_file
    from transformers import BitsAndBytesConfig

    _, folder = trained_submission(base_dir, tmp_path, "florg")
    peft_path = folder / f"peft_{ROUNDS}"
    loaded = load_as_the_evaluation_does(
        base_dir, peft_path, BitsAndBytesConfig(load_in_4bit=True)
    ).to("cuda")
    saved = load_file(str(peft_path / "adapter_model.safetensors"))
    got = get_peft_model_state_dict(loaded)
    assert set(got) == set(saved)
    for key, value in saved.items():
        torch.testing.assert_close(got[key].float().cpu(), value.float())
    reference = load_as_the_evaluation_does(base_dir, peft_path)
    with torch.no_grad():
        four = loaded(input_ids=INPUT_IDS.to("cuda")).logits.float().cpu()
        full = reference(input_ids=INPUT_IDS).logits
    assert torch.isfinite(four).all()
    assert (four - full).abs().max() < 0.5 * full.abs().max()
