"""The names a run refers to (task, data, model, adapted modules) are checked before
anything starts: one line naming the key, no SuperLink, no run folder
(flower_app/preflight/references.py, the launcher's default validation)."""

from __future__ import annotations

import os

import pytest

from florg_tools.launch import main as launch_main
from flower_app.preflight.references import check_run
from flower_app.settings.config import ConfigError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize(
    ("settings", "key"),
    [
        ({"task": "nonexistent"}, "task"),
        ({"task": "local", "data-path": "/nonexistent/data"}, "data-path"),
        ({"model": "/nonexistent/path"}, "model"),
        ({"model": "org/two words"}, "model"),
        ({"target-modules": "query,nope"}, "target-modules"),
    ],
)
def test_a_name_that_does_not_exist_is_refused_naming_its_key(settings, key):
    with pytest.raises(ConfigError) as err:
        check_run(settings)
    message = str(err.value)
    assert message.startswith(f"{key}: ") and "\n" not in message


def test_existing_names_and_hub_names_pass(tiny_bert_dir, sentiment_task_dir):
    check_run({})  # the fetched default model and task
    check_run({"model": "bert-base-uncased"})  # a Hub name is not checked offline
    local = {"model": str(tiny_bert_dir), "task": "local", "data-path": str(sentiment_task_dir)}
    check_run({**local, "text-fields": "sentence", "target-modules": "query"})
    with pytest.raises(ConfigError, match="target-modules: \\['q_proj'\\]"):
        check_run({**local, "text-fields": "sentence", "target-modules": "q_proj"})


@pytest.mark.parametrize("setting", ["task=nonexistent", "model=/nonexistent/path"])
def test_the_launcher_refuses_before_starting_anything(tmp_path, monkeypatch, capsys, setting):
    """Exit status 2 and one line; no run folder. The guard of tests/conftest.py fails this
    test if a SuperLink is started."""
    monkeypatch.chdir(tmp_path)
    code = launch_main(["--app", ROOT, "--ephemeral-superlink", "--set", setting])
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: invalid run config: {setting.split('=')[0]}: ")
    assert len(err.splitlines()) == 1
    assert list(tmp_path.iterdir()) == []


def test_dp_sgd_on_a_task_kind_it_cannot_train_is_refused_before_launch():
    """Causal LM's loss averages over every token of the batch, so DP-SGD's per-example
    gradients would not be each example's own: refused here, not by every client."""
    check_run({"dp": "example"})  # classification: fine
    with pytest.raises(ConfigError) as err:
        check_run({"task": "snli-gen", "dp": "example"})
    message = str(err.value)
    assert message.startswith("dp: dp=example refused for task kind 'causal-lm'")
    assert "\n" not in message
