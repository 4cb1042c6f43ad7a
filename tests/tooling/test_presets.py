"""The LLM presets, resolved without loading any model or data: ``sft-cpu``
(SmolLM2-135M, squad-gen, sized for this CPU) and the four ``flowertune-<track>`` presets
(the FlowerTune LLM leaderboard's tracks as their templates ship them)."""

from __future__ import annotations

import pytest

from florg_tools.run_config import load_preset, preset_path
from flower_app.cache.assets import model_path
from flower_app.preflight.leaderboard import STATIC_KEYS, TEMPLATE_COMMIT, TRACKS, static_values
from flower_app.settings.config import resolve_config
from flower_app.training.lr_schedule import round_learning_rate


def test_sft_cpu_is_smollm2_on_squad_gen_sized_for_a_cpu():
    config = resolve_config({}, load_preset("sft-cpu"))
    assert (config.model, config.task, config.task_kind) == (
        "SmolLM2-135M", "squad-gen", "causal-lm"
    )  # fmt: skip
    assert model_path("SmolLM2-135M").name  # an offline asset the registry names
    assert config.targets == ("q_proj", "v_proj")
    # a few minutes a round on 2 cores: few clients, few short steps, a small dev set
    assert config.local_steps * config.batch_size <= 16
    assert config.max_seq_length <= 256 and config.max_new_tokens <= 16
    assert config.max_eval_examples <= 32 and 0 < config.max_train_examples <= 500
    assert config.min_train_nodes <= 2 and config.min_available_nodes <= 2
    assert config.lr_schedule == "constant"


@pytest.mark.parametrize("track", sorted(TRACKS))
def test_each_flowertune_preset_is_its_tracks_template(track):
    """conf/flowertune-<track>.toml: the template's static config and SuperNodes (what
    flower_app/preflight/leaderboard.py checks), its defaults, and a header naming its source."""
    text = preset_path(f"flowertune-{track}").read_text()
    assert f"examples/flowertune-llm-{track}/pyproject.toml" in text
    assert TEMPLATE_COMMIT in text
    config = resolve_config({}, load_preset(f"flowertune-{track}"))
    spec = TRACKS[track]
    assert config.flowertune_track == track and config.leaderboard is True
    assert {k: getattr(config, k.replace("-", "_")) for k in STATIC_KEYS} == static_values(spec)
    assert config.model == "mistralai/Mistral-7B-v0.3"  # the base model, a setting
    assert (config.min_available_nodes, config.fraction_train) == (
        spec.num_supernodes, spec.fraction_train
    )  # fmt: skip
    assert config.num_server_rounds == 200
    # Flower's FedAvg samples max(int(N * fraction), min-train-nodes)
    assert int(spec.num_supernodes * spec.fraction_train) >= config.min_train_nodes
    assert (config.rank, config.alpha) == (32, 64.0)
    assert config.targets == ("q_proj", "v_proj")  # PEFT's default for Mistral
    assert (config.batch_size, config.local_steps, config.max_seq_length) == (16, 10, 512)
    # the templates' BitsAndBytesConfig(load_in_4bit=True), torch_dtype bf16, checkpointed
    assert (config.quantization, config.precision) == ("4bit-fp4", "bf16")
    assert config.gradient_checkpointing is True
    assert config.lr_schedule == "cosine"
    assert round_learning_rate(config, 200) == pytest.approx(1e-6)
    assert round_learning_rate(config, 1) == pytest.approx(5e-5, rel=1e-3)
    assert config.client_eval == "off"  # the templates' fraction-evaluate = 0
    assert config.prompt_format == "flowertune"
    # the columns each template reads as the instruction (its dataset.py's reformat)
    expected = {
        "general-nlp": ("instruction",),
        "finance": ("instruction", "input"),
        "medical": ("input",),
        "code": ("instruction", "input"),
    }[track]
    assert tuple(config.text_fields.split(",")) == expected
