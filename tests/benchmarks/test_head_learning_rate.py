"""The ``head-learning-rate`` setting: the task head (and every other trained non-adapter
parameter) gets its own AdamW rate, in the ClientApp and in the centralised benchmarks;
its default (0) is the adapter's rate, one parameter group, as every published run."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, Metadata, RecordDict

from flower_app.cache.per_process import cached_adapted_model
from flower_app.settings.config import ConfigError, resolve_config
from flower_app.task_data import load_task_data, make_loader, tokenized_split
from flower_app.training.loop import is_adapter_parameter, make_optimizer, train_local
from flower_app.wire.records import ADAPTER_SUFFIXES, from_array_record, to_array_record


def _settings(model, task, **extra) -> dict:
    return {
        "model": str(model),
        "task": "local",
        "data-path": str(task),
        "text-fields": "sentence",
        "rank": 2,
        "batch-size": 8,
        "local-steps": 3,
        "max-train-examples": 64,
        "max-eval-examples": 16,
        "progress-bar": False,
        **extra,
    }


def test_head_learning_rate_defaults_to_the_learning_rate():
    assert resolve_config({}, {"learning-rate": 3e-3}).head_lr == 3e-3
    config = resolve_config({}, {"learning-rate": 3e-3, "head-learning-rate": 1e-2})
    assert config.head_lr == 1e-2
    assert config.learning_rate == 3e-3


def test_negative_head_learning_rate_is_refused_naming_the_key():
    with pytest.raises(ConfigError, match="head-learning-rate"):
        resolve_config({}, {"head-learning-rate": -1e-3})


@pytest.mark.parametrize("method", ["florg", "fedit", "ffa-lora", "fedex-lora"])
def test_optimizer_puts_the_adapter_and_the_head_in_their_groups(
    method, tiny_bert_dir, sentiment_task_dir
):
    config = resolve_config({}, _settings(tiny_bert_dir, sentiment_task_dir, method=method))
    model = cached_adapted_model(config, 2).model
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    adapter = {id(p) for n, p in named if is_adapter_parameter(n)}
    head = {id(p) for n, p in named if not is_adapter_parameter(n)}
    assert adapter and head  # both are trained by every method here

    one = make_optimizer(model, lr=1e-3, head_lr=1e-3, weight_decay=0.0)
    assert len(one.param_groups) == 1 and one.param_groups[0]["lr"] == 1e-3

    two = make_optimizer(model, lr=1e-3, head_lr=5e-3, weight_decay=0.01)
    groups = {g["lr"]: {id(p) for p in g["params"]} for g in two.param_groups}
    assert groups == {1e-3: adapter, 5e-3: head}
    assert all(g["weight_decay"] == 0.01 for g in two.param_groups)
    # the adapter group holds exactly the tensors that travel as adapter matrices
    names = {n for n, p in named if id(p) in adapter}
    assert all(n.endswith(".A") or ".lora_" in n for n in names)


def _trained(config, data) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    adapted = cached_adapted_model(config, data.num_labels)
    before = adapted.shared_state()
    loader = make_loader(tokenized_split(config, "train", 0, 1), 8, shuffle=True, seed=0)
    torch.manual_seed(0)
    train_local(
        adapted.model, loader, epochs=1, max_steps=3, lr=config.learning_rate,
        head_lr=config.head_lr, weight_decay=0.0, device=torch.device("cpu"),
    )  # fmt: skip
    return before, adapted.shared_state()


def _moved(before: dict, after: dict, adapter: bool) -> float:
    keys = [k for k in before if k.endswith(ADAPTER_SUFFIXES) == adapter]
    assert keys
    return max(float(np.abs(after[k] - before[k]).max()) for k in keys)


def test_a_frozen_head_rate_moves_only_the_adapter(tiny_bert_dir, sentiment_task_dir):
    settings = _settings(tiny_bert_dir, sentiment_task_dir, method="fedit")
    config = resolve_config({}, {**settings, "learning-rate": 1e-2, "head-learning-rate": 1e-12})
    data = load_task_data(config)
    before, after = _trained(config, data)
    assert _moved(before, after, adapter=True) > 1e-4
    assert _moved(before, after, adapter=False) < 1e-9

    config = resolve_config({}, {**settings, "learning-rate": 1e-12, "head-learning-rate": 1e-2})
    before, after = _trained(config, data)
    assert _moved(before, after, adapter=True) < 1e-9
    assert _moved(before, after, adapter=False) > 1e-4


def test_equal_rates_train_exactly_as_the_default(tiny_bert_dir, sentiment_task_dir):
    settings = _settings(tiny_bert_dir, sentiment_task_dir, method="florg")
    default = resolve_config({}, {**settings, "learning-rate": 5e-3})
    explicit = resolve_config({}, {**settings, "learning-rate": 5e-3, "head-learning-rate": 5e-3})
    data = load_task_data(default)
    _, a = _trained(default, data)
    _, b = _trained(explicit, data)
    assert a.keys() == b.keys()
    assert all(np.array_equal(a[k], b[k]) for k in a)


def test_the_client_app_trains_the_head_at_its_own_rate(tiny_bert_dir, sentiment_task_dir):
    """The ClientApp's train function, called with a real Flower Message and Context."""
    from client_app.client_app import train as client_train

    run_config = _settings(tiny_bert_dir, sentiment_task_dir, method="florg")
    run_config |= {"learning-rate": 1e-2, "head-learning-rate": 1e-12}
    config = resolve_config({}, run_config)
    sent = cached_adapted_model(config, 2).shared_state()
    content = RecordDict(
        {"arrays": to_array_record(sent), "config": ConfigRecord({"server-round": 1})}
    )
    metadata = Metadata(
        run_id=1,
        message_id="m1",
        src_node_id=0,
        dst_node_id=1,
        reply_to_message_id="",
        group_id="1",
        created_at=time.time(),
        ttl=600.0,
        message_type="train",
    )  # fmt: skip  (as a SuperNode hands it to the ClientApp)
    msg = Message(content=content, metadata=metadata)
    context = Context(
        run_id=1, node_id=1, node_config={"partition-id": 0, "num-partitions": 2},
        state=RecordDict(), run_config=dict(run_config),
    )  # fmt: skip
    reply = client_train(msg, context)
    arrays = reply.content["arrays"]
    assert isinstance(arrays, ArrayRecord)
    received = from_array_record(arrays)
    assert _moved(sent, received, adapter=True) > 1e-4
    assert _moved(sent, received, adapter=False) < 1e-9
