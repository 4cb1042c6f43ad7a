"""Run settings: schema == pyproject, presets, precedence, and errors that name the key."""

from __future__ import annotations

import dataclasses
import tomllib
from pathlib import Path

import pytest

from flower_app.config import CONF_DIR, DEFAULTS, ConfigError, load_preset, resolve_config
from flower_app.runtime import cached_adapted_model

ROOT = Path(__file__).resolve().parent.parent


def test_pyproject_config_equals_schema_defaults():
    app_config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["flwr"]["app"]
    assert app_config["config"] == DEFAULTS
    assert app_config["components"]["serverapp"] == "server_app.server_app:app"
    assert app_config["components"]["clientapp"] == "client_app.client_app:app"


@pytest.mark.parametrize("preset", sorted(p.stem for p in CONF_DIR.glob("*.yaml")))
def test_every_preset_resolves(preset):
    values = load_preset(preset)
    config = resolve_config({"preset": preset})
    for key, value in values.items():
        assert config.as_dict()[key] == value, key


def test_cpu_default_preset_is_the_default():
    assert dataclasses.replace(resolve_config({"preset": "cpu-default"}), preset="") == (
        resolve_config({})
    )


def test_precedence_defaults_preset_explicit():
    paper = resolve_config({"preset": "paper"})
    assert paper.learning_rate == 5e-5 and paper.batch_size == 4
    assert paper.min_available_nodes == 20
    # a run-config value that differs from the default wins over the preset
    mixed = resolve_config({"preset": "paper", "method": "fedit", "batch-size": 8})
    assert mixed.method == "fedit" and mixed.batch_size == 8 and mixed.learning_rate == 5e-5
    # the launcher's explicit overrides always win
    forced = resolve_config({"preset": "paper"}, {"batch-size": 16})
    assert forced.batch_size == 16


@pytest.mark.parametrize(
    "values,key",
    [
        ({"method": "fedavg"}, "method"),
        ({"dirichlet-alpha": 0.0}, "dirichlet-alpha"),
        ({"dirichlet-alpha": -1.0}, "dirichlet-alpha"),
        ({"fraction-train": 0.0}, "fraction-train"),
        ({"fraction-train": 1.5}, "fraction-train"),
        ({"rank": 0}, "rank"),
        ({"rank": 2.5}, "rank"),
        ({"learning-rate": "fast"}, "learning-rate"),
        ({"train-head": "maybe"}, "train-head"),
        ({"target-modules": " , "}, "target-modules"),
        ({"preset": "nonexistent"}, "preset"),
        ({"server-device": "gpu"}, "server-device"),
        ({"rank-mismatch": "svd"}, "rank-mismatch"),
        ({"projection-sharing": "layer"}, "projection-sharing"),
    ],
)
def test_bad_values_name_the_key(values, key):
    with pytest.raises(ConfigError, match=key):
        resolve_config(values)


def test_unknown_keys_are_rejected():
    with pytest.raises(ConfigError, match="learning_rate"):
        resolve_config({"learning_rate": 0.1})
    with pytest.raises(ConfigError, match="num-epochs"):
        resolve_config({}, {"num-epochs": 3})


def test_rank_larger_than_k_fails_before_training(tiny_bert_dir):
    model = tiny_bert_dir
    config = resolve_config({"model": str(model), "rank": 64})
    with pytest.raises(ConfigError, match="rank: .*exceeds k"):
        cached_adapted_model(config, 2)
    bad_target = resolve_config({"model": str(model), "target-modules": "q_proj"})
    with pytest.raises(ConfigError, match="target-modules"):
        cached_adapted_model(bad_target, 2)


def test_string_booleans_and_numbers_are_coerced():
    config = resolve_config({"train-head": "false", "rank": "8", "alpha": 32})
    assert config.train_head is False and config.rank == 8 and config.alpha == 32.0
