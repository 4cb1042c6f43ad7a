"""Run settings: one declaration (RunConfig) -> schema, pyproject and cache groups; presets
resolved before the run, the same through plain `flwr run` and the launcher; errors that
name the key."""

from __future__ import annotations

import dataclasses
import pickle
import tomllib
from pathlib import Path

import pytest
from flwr.common.config import get_fused_config_from_dir, parse_config_args

from florg_tools import settings as settings_tool
from florg_tools.launch import _build_parser
from florg_tools.run_config import collect_run_config, load_preset, write_run_config_toml
from flower_app.cache.per_process import cached_adapted_model
from flower_app.settings import setting
from flower_app.settings.config import (
    CONF_DIR,
    DATA,
    MODEL,
    TOKENISATION,
    ConfigError,
    RunConfig,
    composed_run_config,
    defaults,
    keys_affecting,
    method_setting_owners,
    method_settings_classes,
    resolve_config,
    run_config_class,
    schema,
    settings_for,
    to_attr,
)

ROOT = Path(__file__).resolve().parents[2]
PRESETS = sorted(p.stem for p in CONF_DIR.glob("*.toml"))


def test_pyproject_config_equals_schema_defaults():
    app_config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["flwr"]["app"]
    assert app_config["config"] == defaults()
    # the core's keys, the methods' own, the testing-only ones: every key once
    ordered = [key for _, keys in settings_tool.key_sections() for key in keys]
    assert list(app_config["config"]) == ordered and sorted(ordered) == sorted(schema())
    assert app_config["components"]["serverapp"] == "server_app.server_app:app"
    assert app_config["components"]["clientapp"] == "client_app.client_app:app"


def test_pyproject_table_is_the_generated_one():
    """Comments (help, groups) included: regenerate with python -m florg_tools.settings --write."""
    text = (ROOT / "pyproject.toml").read_text()
    assert settings_tool.table_in(text) == settings_tool.generated_table()
    assert settings_tool.main(["--check"]) == 0


def test_settings_check_fails_and_write_repairs_a_stale_table(tmp_path, capsys):
    stale = tmp_path / "pyproject.toml"
    text = (ROOT / "pyproject.toml").read_text()
    stale.write_text(text.replace("\nrank = 4  #", "\nrank = 8  #"))
    assert stale.read_text() != text
    assert settings_tool.main(["--check", "--pyproject", str(stale)]) == 1
    assert "+rank = 4" in capsys.readouterr().out
    assert settings_tool.main(["--write", "--pyproject", str(stale)]) == 0
    assert stale.read_text() == text


def test_the_schema_is_derived_from_the_runconfig_fields():
    fields = dataclasses.fields(run_config_class())
    assert [to_attr(key) for key in schema()] == [f.name for f in fields]
    assert run_config_class()() == resolve_config({})  # the field defaults are the defaults
    core = [f.name for f in dataclasses.fields(RunConfig)]
    assert [f.name for f in fields][: len(core)] == core  # the core's keys first
    assert schema()["rank"].kind is int and schema()["alpha"].kind is float
    assert schema()["train-head"].kind is bool and schema()["method"].kind is str
    assert "florg" in schema()["method"].check.options
    with pytest.raises(ValueError, match="unknown setting group"):
        setting(1, "x", affects=("optimizer",))


def test_a_methods_own_settings_are_declared_in_its_folder_and_join_the_run_config():
    """Every method-declared key comes from a settings class in its method's folder, is
    set and read like a core key, and pickles (the apps hand configs to worker
    processes); a key declared twice is refused."""
    owners = method_setting_owners()
    assert {"fedex-residual", "lora-init", "fed-sb-init-examples", "rank-mismatch"} <= set(owners)
    for declared in method_settings_classes():
        assert declared.__module__.startswith("strategies.") and declared.__module__.endswith(
            ".settings"
        ), declared
    assert owners["fed-sb-init-examples"] == ("fed-sb",)
    assert set(owners["rank-mismatch"]) >= {"florg", "florg-no-procrustes", "florg-signed"}
    config = resolve_config({"fed-sb-init-examples": 32, "fedex-residual": "factored"})
    assert config.fed_sb_init_examples == 32 and config.fedex_residual == "factored"
    assert config.as_dict()["fed-sb-init-examples"] == 32
    assert pickle.loads(pickle.dumps(config)) == config
    with pytest.raises(ConfigError, match="fedex-residual"):
        resolve_config({"fedex-residual": "sparse"})

    @dataclasses.dataclass(frozen=True)
    class Clashing:
        rank: int = setting(4, "a second rank", affects=())

    with pytest.raises(TypeError, match="'rank' .* declared by the core already"):
        composed_run_config((Clashing,))


def test_cache_groups_cover_what_the_hand_written_lists_did():
    """The keys of the former disk_cache exclusion lists, derived now; doc-stride (QA
    windows) no longer keys the model cache."""
    assert set(keys_affecting(MODEL)) == {
        "method", "model", "target-modules", "head-modules", "train-head", "rank", "alpha",
        "seed", "a-init-std", "projection-init", "subtract-init", "projection-sharing",
        "lora-init", "fedex-residual", "precision", "gradient-checkpointing", "quantization",
    }  # fmt: skip
    assert set(keys_affecting(DATA, TOKENISATION)) == {
        "model", "task", "data-path", "text-fields", "label-field", "num-labels", "seed",
        "partitioner", "dirichlet-alpha", "max-train-examples", "max-eval-examples",
        "max-test-examples", "max-seq-length", "doc-stride", "task-kind", "prompt-template",
        "prompt-format",
    }  # fmt: skip
    config = resolve_config({}, {"rank": 8, "learning-rate": 0.1})
    assert settings_for(config, MODEL)["rank"] == 8
    assert "learning-rate" not in settings_for(config, *schema()["rank"].affects)
    with pytest.raises(ValueError, match="unknown setting group"):
        keys_affecting("optimizer")


@pytest.mark.parametrize("preset", PRESETS)
def test_every_preset_resolves(preset):
    values = load_preset(preset)
    config = resolve_config({}, values)
    for key, value in values.items():
        assert config.as_dict()[key] == value, key


def test_the_presets_are_the_toml_files():
    assert PRESETS == [
        "cpu-default", "flowertune-code", "flowertune-finance", "flowertune-general-nlp",
        "flowertune-medical", "paper", "sft-cpu", "squad-cpu", "squad-paper",
    ]  # fmt: skip
    assert not list(CONF_DIR.glob("*.yaml"))  # no second format to drift from


def test_cpu_default_preset_is_the_default():
    assert resolve_config({}, load_preset("cpu-default")) == resolve_config({})


def _plain_flwr_run(*run_config: str) -> RunConfig:
    """What the apps receive from `flwr run . CONN --run-config ...`: Flower's own parsing
    and fusing with pyproject's defaults, then the apps' resolve_config."""
    return resolve_config(get_fused_config_from_dir(ROOT, parse_config_args(list(run_config))))


def _launcher(tmp_path: Path, *argv: str) -> RunConfig:
    """What the apps receive from python -m florg_tools.launch ...: its merged layers,
    written as the TOML file it submits, read back by Flower."""
    args = _build_parser().parse_args(["--app", str(ROOT), *argv])
    path = write_run_config_toml(collect_run_config(args), tmp_path / "run-config.toml")
    return _plain_flwr_run(str(path))


@pytest.mark.parametrize("preset", PRESETS)
def test_plain_flwr_run_and_the_launcher_resolve_a_preset_alike(preset, tmp_path):
    plain = _plain_flwr_run(str(CONF_DIR / f"{preset}.toml"))
    assert plain == _launcher(tmp_path, "--preset", preset)
    assert plain == resolve_config({}, load_preset(preset))
    assert plain != resolve_config({}) or preset == "cpu-default"


def test_an_explicit_value_always_wins_even_when_it_equals_the_default(tmp_path):
    paper = _plain_flwr_run(str(CONF_DIR / "paper.toml"))
    assert paper.learning_rate == 5e-5 and paper.batch_size == 4
    assert paper.min_available_nodes == 20
    # batch-size 16 is the default; it still beats the preset's 4
    forced = _launcher(tmp_path, "--preset", "paper", "--set", "batch-size=16")
    assert forced.batch_size == 16 and forced.learning_rate == 5e-5
    assert dataclasses.replace(forced, batch_size=4) == paper
    # flwr run takes one TOML file: the preset copied with the value changed, same result
    edited = tmp_path / "paper-b16.toml"
    edited.write_text(
        (CONF_DIR / "paper.toml").read_text().replace("batch-size = 4", "batch-size = 16")
    )
    assert _plain_flwr_run(str(edited)) == forced
    # inline values equal to a default are kept as given (nothing compares to defaults)
    assert _plain_flwr_run("batch-size=16 method='fedit'") == resolve_config(
        {}, {"method": "fedit"}
    )
    # layers: --run-config-file < --preset < --set
    layer = tmp_path / "layer.toml"
    layer.write_text('batch-size = 2\nlearning-rate = 0.5\nmethod = "fedit"\n')
    mixed = _launcher(
        tmp_path, "--run-config-file", str(layer), "--preset", "paper", "--set", "rank=2"
    )
    assert (mixed.batch_size, mixed.learning_rate, mixed.method, mixed.rank) == (
        4, 5e-5, "florg", 2,
    )  # fmt: skip


def test_preset_key_is_refused_with_a_pointer_to_the_toml_layer():
    with pytest.raises(ConfigError, match=r"preset: .*--run-config conf/NAME\.toml"):
        resolve_config({"preset": "paper"})
    assert resolve_config({"preset": ""}) == resolve_config({})


def test_a_bad_preset_file_names_the_file_and_the_key(tmp_path):
    with pytest.raises(ValueError, match=r"--preset: .*nonexistent\.toml not found.*paper"):
        load_preset("nonexistent")
    bad = tmp_path / "bad.toml"
    bad.write_text("rank = 2\nnum-epochs = 3\n")
    with pytest.raises(ConfigError, match="num-epochs"):
        load_preset(str(bad))
    bad.write_text("rank = 0\n")
    with pytest.raises(ConfigError, match="rank"):
        load_preset(str(bad))
    bad.write_text("rank = \n")
    with pytest.raises(ValueError, match="--preset: cannot read"):
        load_preset(str(bad))


def test_the_launcher_refuses_a_missing_preset(tmp_path):
    args = _build_parser().parse_args(["--app", str(ROOT), "--preset", "nonexistent"])
    with pytest.raises(ValueError, match="--preset"):
        collect_run_config(args)


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
        ({"preset": "paper"}, "preset"),
        ({"server-device": "gpu"}, "server-device"),
        ({"rank-mismatch": "svd"}, "rank-mismatch"),
        ({"projection-sharing": "layer"}, "projection-sharing"),
    ],
)
def test_bad_values_name_the_key(values, key):
    with pytest.raises(ConfigError, match=key):
        resolve_config(values)


@pytest.mark.parametrize(
    "key",
    ["dp-sgd-clipping-norm", "dp-sgd-noise-multiplier", "dp-sgd-target-epsilon",
     "dp-max-epsilon", "fed-sb-init-noise-multiplier"],
)  # fmt: skip
@pytest.mark.parametrize("value", [float("inf"), "inf", "-inf", float("nan"), "nan"])
def test_non_finite_dp_sgd_settings_are_refused_naming_the_key(key, value):
    """As dp=central's clipping norm and noise multiplier are: an infinite C or z is no
    mechanism, and an infinite target epsilon no guarantee."""
    with pytest.raises(ConfigError, match=rf"^{key}: bad value .*finite"):
        resolve_config({}, {"dp": "example", key: value})


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
