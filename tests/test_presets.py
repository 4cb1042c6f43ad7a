"""The LLM presets of issue 28, resolved without loading any model or data: ``sft-cpu``
(SmolLM2-135M, squad-gen, sized for this CPU) and ``flowertune`` (FlowerTune's
general-NLP setting as the flowertune-llm example ships it)."""

from __future__ import annotations

import pytest

from florg_tools.run_config import load_preset
from flower_app.asset_registry import model_path
from flower_app.config import resolve_config
from flower_app.lr_schedule import round_learning_rate


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


def test_flowertune_is_the_general_nlp_example():
    config = resolve_config({}, load_preset("flowertune"))
    assert config.model == "openlm-research/open_llama_3b_v2"
    assert (config.task, config.task_kind) == ("vicgalle/alpaca-gpt4", "causal-lm")
    assert (config.rank, config.alpha) == (32, 64.0)
    assert config.targets == ("q_proj", "v_proj")  # PEFT's default for Llama
    # 20 clients, 10 % per round, 100 rounds
    assert (config.min_available_nodes, config.fraction_train) == (20, 0.1)
    assert config.num_server_rounds == 100
    assert round(config.min_available_nodes * config.fraction_train) == config.min_train_nodes
    # per-device batch 16, max-steps 10, sequence length 512
    assert (config.batch_size, config.local_steps, config.max_seq_length) == (16, 10, 512)
    # QLoRA: a 4-bit base computing in bf16, checkpointed
    assert (config.quantization, config.precision) == ("4bit", "bf16")
    assert config.gradient_checkpointing is True
    # cosine over rounds from 5e-5 to 1e-6
    assert config.lr_schedule == "cosine"
    assert round_learning_rate(config, 100) == pytest.approx(1e-6)
    assert round_learning_rate(config, 1) == pytest.approx(5e-5, rel=1e-3)
    assert config.client_eval == "off"  # FlowerTune's fraction-evaluate = 0
