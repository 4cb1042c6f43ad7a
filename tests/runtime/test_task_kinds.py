"""The task-kind registry (flower_app/task_kinds/): what it checks, and that a new kind of
task is one module plus one registry line, run in-process and end to end through the real
Flower simulation, in a copy of the app."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from florg_tools.flwr_cli import run_flower_app
from florg_tools.synthetic import make_sentiment_task, make_tiny_bert
from flower_app.settings.config import ConfigError, resolve_config
from flower_app.task_kinds import get_kind, kind_names, register_kind
from tests.harness.app_copy import ROOT, app_with_registered_module
from tests.harness.flower_harness import local_simulation_superlink

NUM_NODES = 2

# A toy kind, written as a new kind module would be: is the sentence's length in characters
# odd? Its own target column (the partition's pseudo-label too), features, head, loss
# (cross-entropy computed here, not the model's) and metric name.
TOY_MODULE = '''
"""A toy task kind (tests/runtime/test_task_kinds.py): the parity of a sentence's length."""

from __future__ import annotations

import math

import torch

from flower_app.data.batching import make_loader
from flower_app.task_kinds.base import TaskKind
from flower_app.task_kinds.classification import load_classifier

PARITY = "parity"


class Parity(TaskKind):
    name = "parity"
    score_metric = "parity-accuracy"
    metric_names = ("parity-accuracy",)

    def load_splits(self, spec, *, max_train, max_eval, seed):
        from flower_app.data.loading import load_task_splits

        train, evaluation = load_task_splits(spec, max_train=max_train, max_eval=max_eval,
                                             seed=seed)
        text = spec.text_fields[0]

        def add(batch):
            return {PARITY: [len(t) % 2 for t in batch[text]]}

        return train.map(add, batched=True), evaluation.map(add, batched=True), 2

    def partition_field(self, spec):
        return PARITY

    def features(self, config, spec, tokenizer, examples):
        text = spec.text_fields[0]

        def encode(batch):
            enc = tokenizer(
                batch[text], truncation=True, padding="max_length", max_length=config.max_seq_length
            )
            return {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"],
                    "labels": batch[PARITY]}

        return examples.map(encode, batched=True, remove_columns=examples.column_names).with_format(
            "torch"
        )

    def load_model(self, name, num_labels, seed, pad_token_id):
        return load_classifier(name, num_labels, seed, pad_token_id)

    def training_loss(self, model, batch):
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        return torch.nn.functional.cross_entropy(model(**inputs).logits, batch["labels"])

    @torch.no_grad()
    def evaluate(self, model, data, device):
        model.to(device).eval()
        loss_sum, correct, n = 0.0, 0, 0
        for batch in make_loader(data.features(), data.config.eval_batch_size, False, 0):
            batch = {k: v.to(device) for k, v in batch.items()}
            loss = self.training_loss(model, batch)
            logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits
            m = int(batch["labels"].shape[0])
            loss_sum += float(loss) * m
            correct += int((logits.argmax(-1) == batch["labels"]).sum())
            n += m
        accuracy = correct / n if n else math.nan
        return {"parity-accuracy": accuracy, "loss": loss_sum / n if n else math.nan,
                "score": accuracy, "num-examples": n}


KINDS = (Parity(),)
'''

# In the copy: the toy kind's data, partitions, model, one client round, evaluation and a
# metrics row, through the app's own modules.
RUN_TOY_IN_PROCESS = """
import strategies.registry
import json, sys
import torch
from flower_app.client.round import train_round
from flower_app.settings.config import resolve_config
from flower_app.run_output.recorder import RunRecorder
from flower_app.cache.per_process import cached_adapted_model
from flower_app.task_data import load_task_data, tokenized_split
from flower_app.task_eval import evaluate_task

model, task, out = sys.argv[1:4]
config = resolve_config({}, {
    "model": model, "task": "local", "data-path": task, "text-fields": "sentence",
    "task-kind": "parity", "rank": 2, "local-steps": 2, "batch-size": 8,
    "partitioner": "dirichlet", "dirichlet-alpha": 0.3,
})
data = load_task_data(config)
parts = [[int(x) for x in tokenized_split(config, "train", pid, 2)["labels"]] for pid in range(2)]
parities = [[len(s) % 2 for s in data.train["sentence"]]]
adapted = cached_adapted_model(config, data.num_labels, data.spec.kind)
reply = train_round(config, adapted, server_round=1, partition_id=0, num_partitions=2)
metrics = evaluate_task(config, adapted.model, torch.device("cpu"))
recorder = RunRecorder(__import__("pathlib").Path(out), config, kind=data.kind)
row = recorder.record(1, metrics, {})
summary = recorder.write_summary({})
print(json.dumps({
    "kind": data.spec.kind, "score-metric": data.score_metric, "parts": parts,
    "train-parity": parities[0], "train-labels": list(data.train["label"]),
    "reply": {k: reply.metrics[k] for k in ("steps", "train-loss")}, "metrics": metrics,
    "row": row, "summary": {k: summary.get(k) for k in ("score-metric", "final-parity-accuracy",
                                                        "final-score")},
}))
"""


def _app_with_toy_kind(folder: Path) -> Path:
    """A copy of the app whose only change is the toy kind's module and its registry line."""
    app_with_registered_module(folder, "task_kinds", "parity", TOY_MODULE, "KIND_MODULES")
    changed = sorted(
        str(path.relative_to(folder))
        for path in folder.rglob("*.py")
        if not (ROOT / path.relative_to(folder)).exists()
        or path.read_text() != (ROOT / path.relative_to(folder)).read_text()
    )
    assert changed == ["flower_app/task_kinds/__init__.py", "flower_app/task_kinds/parity.py"]
    return folder


def test_the_registered_kinds_and_their_headline_metrics():
    assert kind_names() == ("classification", "extractive-qa", "causal-lm")
    assert get_kind("classification").score_metric == "accuracy"
    assert get_kind("extractive-qa").metric_names == ("exact-match", "f1")
    assert get_kind("causal-lm").default_target_modules == "q_proj,v_proj"


def test_unknown_kinds_and_specs_a_kind_refuses_are_config_errors(tmp_path):
    from flower_app.task_data import task_spec

    with pytest.raises(ValueError, match="unknown task kind 'ranking'; choose one of classif"):
        get_kind("ranking")
    with pytest.raises(ValueError, match="registered already"):
        register_kind(get_kind("classification"))
    task = make_sentiment_task(tmp_path / "task", n_train=20, n_eval=10, n_test=0)
    local = {"task": "local", "data-path": str(task), "text-fields": "sentence"}
    assert task_spec(resolve_config({}, local)).kind == "classification"
    with pytest.raises(ConfigError, match="task-kind: unknown task kind 'ranking'"):
        task_spec(resolve_config({}, {**local, "task-kind": "ranking"}))
    with pytest.raises(ConfigError, match=r"task: .*extractive QA needs text-fields"):
        task_spec(resolve_config({}, {**local, "task-kind": "extractive-qa"}))


def test_no_kind_branches_outside_the_kind_modules():
    """The kind-specific code lives in flower_app/task_kinds/: no module elsewhere asks
    whether a task is QA (issue 28)."""
    pattern = re.compile(r"is_qa|EXTRACTIVE_QA")
    offenders = [
        str(path.relative_to(ROOT))
        for package in (
            "flower_app",
            "client_app",
            "server_app",
            "strategies",
            "benchmarks",
            "florg_tools",
        )  # fmt: skip
        for path in (ROOT / package).rglob("*.py")
        if "task_kinds" not in path.parts and pattern.search(path.read_text())
    ]
    assert offenders == []


def test_a_new_kind_is_one_module_plus_one_registry_line(tmp_path):
    app = _app_with_toy_kind(tmp_path / "app")
    model, task = make_tiny_bert(tmp_path / "model"), make_sentiment_task(tmp_path / "task")
    (tmp_path / "run").mkdir()
    out = subprocess.run(
        [sys.executable, "-c", RUN_TOY_IN_PROCESS, str(model), str(task), str(tmp_path / "run")],
        cwd=app, capture_output=True, text=True, env={**os.environ, "FLORG_DISK_CACHE": "0"},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert (result["kind"], result["score-metric"]) == ("parity", "parity-accuracy")
    # The features carry the kind's target, and the partitions are disjoint and covering.
    labels = sorted(result["parts"][0] + result["parts"][1])
    assert labels == sorted(result["train-parity"]) and labels != sorted(result["train-labels"])
    assert result["reply"]["steps"] == 2 and result["reply"]["train-loss"] > 0
    metrics = result["metrics"]
    assert set(metrics) == {"parity-accuracy", "loss", "score", "num-examples"}
    assert 0 <= metrics["score"] == metrics["parity-accuracy"] <= 1
    assert metrics["num-examples"] == 80
    row = result["row"]
    assert row["parity-accuracy"] == metrics["parity-accuracy"]
    assert row["score-metric"] == "parity-accuracy" and row["accuracy"] is None
    assert result["summary"] == {
        "score-metric": "parity-accuracy",
        "final-parity-accuracy": metrics["parity-accuracy"],
        "final-score": metrics["score"],
    }


@pytest.mark.integration
def test_a_new_kind_runs_end_to_end_through_the_flower_simulation(tmp_path):
    app = _app_with_toy_kind(tmp_path / "app")
    model, task = make_tiny_bert(tmp_path / "model"), make_sentiment_task(tmp_path / "task")
    config = {
        "method": "fedit",
        "model": str(model),
        "task": "local",
        "data-path": str(task),
        "text-fields": "sentence",
        "task-kind": "parity",
        "rank": 2,
        "num-server-rounds": 1,
        "min-available-nodes": NUM_NODES,
        "batch-size": 16,
        "output-dir": str(tmp_path / "outputs"),
        "run-name": "toy-kind",
    }
    with local_simulation_superlink(tmp_path / "superlink", num_supernodes=NUM_NODES) as sim:
        home, connection = sim
        outcome = run_flower_app(app, connection, config, home, timeout=600, stream=None)
    assert outcome.ok, f"{outcome.message}\n{outcome.log_text[-4000:]}"
    run_dir = tmp_path / "outputs" / "toy-kind"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [0, 1]
    for row in rows:
        assert row["score-metric"] == "parity-accuracy" and row["accuracy"] is None
        assert 0 <= row["score"] == row["parity-accuracy"] <= 1
    assert rows[1]["train-loss"] > 0
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "finished"
    assert summary["final-parity-accuracy"] == rows[1]["parity-accuracy"]
