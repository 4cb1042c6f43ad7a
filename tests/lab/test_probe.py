"""lab/florg_lab/probe.py on a run folder built from the tiny BERT and task."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.numpy import save_file

from florg_lab.probe import (
    ProbeError,
    _checkpoint_arrays,
    probe_row,
    refit_accuracy,
)
from flower_app.cache.per_process import cached_adapted_model
from flower_app.settings.config import resolve_config
from flower_app.task_data import load_task_data
from flower_app.task_eval import evaluate_task


def _run_folder(tmp_path, model_dir, task_dir, method: str):
    settings = {
        "method": method, "model": str(model_dir), "task": "local", "data-path": str(task_dir),
        "text-fields": "sentence", "rank": 2, "max-test-examples": 40, "seed": 3,
    }  # fmt: skip
    config = resolve_config({}, settings)
    folder = tmp_path / method
    (folder / "checkpoint" / "round-000002").mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config.as_dict()))
    data = load_task_data(config)
    adapted = cached_adapted_model(config, data.num_labels, data.spec.kind)
    torch.manual_seed(1)
    state = {k: v + 0.05 * torch.randn(v.shape).numpy() for k, v in adapted.shared_state().items()}
    save_file(state, str(folder / "checkpoint" / "round-000002" / "arrays.safetensors"))
    adapted.load_shared_state(state)
    test = evaluate_task(config, adapted.model, torch.device("cpu"), split="test")
    return folder, test["accuracy"]


def test_the_federated_head_scores_what_the_run_scored(tmp_path, tiny_bert_dir, sentiment_task_dir):
    folder, accuracy = _run_folder(tmp_path, tiny_bert_dir, sentiment_task_dir, "florg")
    cells = [c.strip() for c in probe_row(folder).strip("|").split("|")]
    assert cells[0] == "florg" and cells[1] == "2"
    assert float(cells[2]) == pytest.approx(accuracy, abs=5e-4)
    assert 0.0 <= float(cells[3]) <= 1.0
    assert float(cells[4]) == pytest.approx(float(cells[3]) - float(cells[2]), abs=1.5e-3)


def test_round_0_is_the_model_the_server_starts_from(tmp_path, tiny_bert_dir, sentiment_task_dir):
    folder, _ = _run_folder(tmp_path, tiny_bert_dir, sentiment_task_dir, "florg")
    config = resolve_config({}, json.loads((folder / "config.json").read_text()))
    data = load_task_data(config)
    initial = cached_adapted_model(config, data.num_labels, data.spec.kind)
    accuracy = evaluate_task(config, initial.model, torch.device("cpu"), split="test")["accuracy"]
    assert _checkpoint_arrays(folder, 0) == (0, None)  # no round-0 file: keep the init
    assert _checkpoint_arrays(folder, None)[0] == 2
    cells = [c.strip() for c in probe_row(folder, 0).strip("|").split("|")]
    assert cells[1] == "0"
    assert float(cells[2]) == pytest.approx(accuracy, abs=5e-4)
    with pytest.raises(ProbeError, match="no checkpoint of round 1"):
        probe_row(folder, 1)


def test_a_personal_methods_global_model_is_refused(tmp_path, tiny_bert_dir, sentiment_task_dir):
    folder, _ = _run_folder(tmp_path, tiny_bert_dir, sentiment_task_dir, "fedsa-lora")
    with pytest.raises(ProbeError, match="not its output alone"):
        probe_row(folder)


def test_refit_separates_separable_features():
    torch.manual_seed(0)
    y = torch.randint(0, 2, (200,))
    x = torch.randn(200, 5) + 6.0 * y[:, None]
    assert refit_accuracy(x[:150], y[:150], x[150:], y[150:], 2) == 1.0


def test_a_published_run_without_checkpoint_says_how_to_regenerate_it(tmp_path):
    run_id = "learning-rate=0.001,method=florg,seed=3,task=snli"
    evidence = tmp_path / "lab" / "evidence" / "evidence" / "runs" / "evidence-snli" / run_id
    older = tmp_path / "lab" / "evidence" / "main" / "runs" / "method=florg,seed=0"
    for folder in (evidence, older):
        folder.mkdir(parents=True)
        assert _checkpoint_arrays(folder, 0) == (0, None)  # round 0 needs no checkpoint
    with pytest.raises(ProbeError) as err:
        _checkpoint_arrays(evidence, None)
    message = str(err.value)
    assert "no checkpoint of any round" in message
    assert f"florg experiments run evidence-snli --out DIR --only {run_id}" in message
    assert "evidence-snli-tuning.json to DIR/tuning.json" in message  # published choices
    assert f"probe DIR/runs/{run_id}" in message
    with pytest.raises(ProbeError, match="florg experiments run main --out DIR") as err:
        _checkpoint_arrays(older, 20)
    assert "tuning.json" not in str(err.value)  # an untuned grid needs no choices
