"""The adapter-kind registry (flower_app/adapters/): what it holds and checks, that
nothing outside a kind's own module branches on its name, and that a new kind is one module
plus one registry line (a toy kind, in a copy of the app, injected, trained for a client
round and aggregated by the common strategy)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from florg_tools.synthetic import make_sentiment_task, make_tiny_bert
from flower_app.adapters.registry import adapter_kind_names, get_adapter_kind, register_adapter_kind
from flower_app.methods.contract import Method
from flower_app.methods.registry import get_method, method_names
from tests.harness.app_copy import ROOT, app_with_adapter_kind_folder, changed_files


def test_the_registered_kinds_own_their_parts_and_shapes():
    assert adapter_kind_names() == ("florg", "lora", "lora-sb")
    florg, lora, sb = (get_adapter_kind(n) for n in adapter_kind_names())
    assert florg.part_params(["A"], 12, 8, 3) == 3 * 8  # r x min(d_in, d_out)
    assert lora.part_params(["A", "B"], 12, 8, 3) == 3 * 8 + 12 * 3
    assert sb.part_params(["R"], 12, 8, 3) == 9
    assert (lora.part_key("A"), lora.part_key("B"), sb.part_key("R")) == ("lora_A", "lora_B", "R")
    for name in method_names():  # every method's kind is registered and owns its parts
        method = get_method(name)
        assert set(method.shared) <= set(method.kind.parts)


def test_unknown_kinds_and_parts_are_refused():
    with pytest.raises(ValueError, match="unknown adapter kind 'dora'; choose one of florg"):
        get_adapter_kind("dora")
    with pytest.raises(ValueError, match="registered already"):
        register_adapter_kind(get_adapter_kind("lora"))
    with pytest.raises(ValueError, match="adapter must be one of"):
        Method(name="x", summary="", adapter="dora", shared=("A",))
    with pytest.raises(ValueError, match="parts of a lora-sb adapter are"):
        Method(name="x", summary="", adapter="lora-sb", shared=("A",))


# A comparison of something with a kind's name ('adapter == "florg"', 'in ("lora", ...)'):
# the code that depends on a kind asks the kind object instead.
KIND_BRANCH = re.compile(
    r"""(==|!=|\bin\b)\s*[(\[{]?\s*["'](florg|lora|lora-sb)["']|\bis_florg\b|\bis_lora_sb\b"""
)


def _is_kind_machinery(path: Path) -> bool:
    """A kind's own object (flower_app/adapters/<kind>/kind.py), the registry or the base."""
    adapters = ROOT / "flower_app" / "adapters"
    return (
        path.parent == adapters
        and path.name in ("registry.py", "base.py")
        or (path.parent.parent == adapters and path.name == "kind.py")
    )


def test_no_branch_on_a_kind_name_outside_its_own_module():
    """Over the runtime (the benchmarks name their own arms 'florg' and 'lora')."""
    offenders = [
        f"{path.relative_to(ROOT)}: {m.group(0)}"
        for package in ("flower_app", "client_app", "server_app", "strategies")
        for path in (ROOT / package).rglob("*.py")
        if not _is_kind_machinery(path)
        for m in KIND_BRANCH.finditer(path.read_text())
    ]
    assert offenders == []


# The toy kind: each targeted Linear's output scaled by (1 + s g), g (d_out) trained and
# shared: W = W0 + s diag(g) W0. Its kind.py is all a new kind needs.
TOY_KIND = '''
"""A toy adapter kind (tests/runtime/test_adapter_kinds.py): W = W0 + s diag(g) W0, g trained."""

from __future__ import annotations

from flower_app.adapters.base import AdapterKind, Part


def _layers(model):
    return {n: m for n, m in model.named_modules() if type(m).__name__ == "GainLinear"}


class GainKind(AdapterKind):
    def inject(self, model, config, method):
        import torch
        from torch import nn

        from flower_app.adapters.custom_adapter import replace_module
        from flower_app.adapters.targets import find_head_modules, find_target_linears

        class GainLinear(nn.Module):
            def __init__(self, base, scaling):
                super().__init__()
                self.base_layer, self.scaling = base, scaling
                self.g = nn.Parameter(torch.zeros(base.out_features))

            def forward(self, x):
                return self.base_layer(x) * (1 + self.scaling * self.g)

        heads = find_head_modules(model, config.heads)
        targets = find_target_linears(model, config.targets, exclude=heads)
        model.requires_grad_(False)
        scaling = method.adapter_alpha(config) / config.rank
        for name, linear in targets.items():
            replace_module(model, name, GainLinear(linear, scaling))
        for head in heads:
            model.get_submodule(head).requires_grad_(config.train_head)
        model.toy_heads = heads
        return model

    def _tensors(self, model):
        out = {f"{n}.g": m.g for n, m in _layers(model).items()}
        for head in model.toy_heads:
            for p_name, p in model.get_submodule(head).named_parameters():
                out[f"{head}.{p_name}"] = p
        return out

    def shared_state(self, model, config, method):
        from flower_app.adapters.state import to_numpy

        return {k: to_numpy(t) for k, t in self._tensors(model).items()}

    def load_shared_state(self, model, arrays, config, method):
        from flower_app.adapters.state import load_arrays

        load_arrays(self._tensors(model), arrays)


GAIN = Part("g", lambda d_out, d_in, r: (d_out,))
KINDS = (GainKind(name="toy-gain", summary="W0 + s diag(g) W0", parts={"g": GAIN}),)
'''

# In the copy: a method on the toy kind (declared here, as a test would), its model, a
# client round, the common strategy's aggregation of two replies and the communication count.
RUN_TOY_KIND = """
import json, sys
import numpy as np
import strategies.registry
from flwr.app import Message, MessageType, MetricRecord, RecordDict
from flwr.supercore.task_identity import TaskIdentity
from flower_app.client.round import train_round
from flower_app.settings.config import resolve_config
from flower_app.methods.registry import build_strategy, register_method
from flower_app.wire.records import to_array_record
from flower_app.cache.per_process import cached_adapted_model
from strategies.shared.base_method import BaseMethod

TaskIdentity.run_id = TaskIdentity.task_id = TaskIdentity.node_id = 1  # messages outside a run

class GainMean(BaseMethod):
    def aggregate(self, sent, payloads, weights):
        keys = [k for k in sent if k.endswith(".g")]
        return {k: sum(w * p[k] for w, p in zip(weights, payloads)) for k in keys}, {}

register_method(GainMean(name="toy-gain-mean", summary="", adapter="toy-gain", shared=("g",)),
                source=__name__)
model, task = sys.argv[1:3]
config = resolve_config({}, {"model": model, "task": "local", "data-path": task,
                             "text-fields": "sentence", "method": "toy-gain-mean", "rank": 2,
                             "local-steps": 3, "batch-size": 8, "learning-rate": 0.05})
adapted = cached_adapted_model(config, 2)
start = adapted.shared_state()
reply = train_round(config, adapted, server_round=1, partition_id=0, num_partitions=2)
strategy = build_strategy(config, start)
messages = []
for pid, scale in ((0, 1.0), (1, 3.0)):
    arrays = {k: (v + scale * (reply.shared[k] - v)).astype(np.float32) for k, v in start.items()}
    content = RecordDict({"arrays": to_array_record(arrays),
                          "metrics": MetricRecord({"num-examples": 10, "partition-id": pid})})
    messages.append(Message(content=content, dst_node_id=1, message_type=MessageType.TRAIN))
strategy.aggregate_train(1, messages)
g = [k for k in start if k.endswith(".g")]
print(json.dumps({
    "keys": sorted(reply.shared), "g": g,
    "moved": [float(np.abs(reply.shared[k] - start[k]).max()) for k in g],
    "mean-is-2x": [
        float(np.abs(strategy.global_state[k] - start[k] - 2 * (reply.shared[k] - start[k])).max())
        for k in g
    ],
    "up": adapted.method.adapter_params(12, 8, 2),
}))
"""


def test_a_new_adapter_kind_is_one_folder_plus_one_registry_line(tmp_path):
    app = app_with_adapter_kind_folder(tmp_path / "app", "toy_gain", TOY_KIND)
    assert changed_files(app) == [
        "flower_app/adapters/registry.py",
        "flower_app/adapters/toy_gain/kind.py",
    ]
    model = make_tiny_bert(tmp_path / "model")
    task = make_sentiment_task(tmp_path / "task", n_train=40, n_eval=10, n_test=0)
    out = subprocess.run(
        [sys.executable, "-c", RUN_TOY_KIND, str(model), str(task)],
        cwd=app, capture_output=True, text=True,
        env={**os.environ, "FLORG_DISK_CACHE": "0", "HF_HUB_OFFLINE": "1"},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["g"] and all(
        k.endswith(".g") or k.startswith("classifier") for k in result["keys"]
    )
    assert min(result["moved"]) > 0  # the client trained g
    assert max(result["mean-is-2x"]) < 1e-6  # the common strategy averaged the replies
    assert result["up"] == 12  # the kind's part shapes: g is d_out


def test_injecting_and_exporting_a_peft_lora_prints_no_library_future_warning(tmp_path):
    """PEFT reads transformers' deprecated ``is_gradient_checkpointing`` in get_peft_model;
    the app silences that one warning where it calls PEFT (``quiet_get_peft_model``), so a
    run's console carries none."""
    import warnings

    from transformers import BertForSequenceClassification

    from florg_tools.synthetic import tiny_bert_config
    from flower_app.adapters.lora.layer import LoRAConfig, inject_lora

    model = BertForSequenceClassification(tiny_bert_config(num_labels=2))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        inject_lora(model, LoRAConfig(r=2, target_modules=("query", "value")))
    assert [w for w in caught if issubclass(w.category, FutureWarning)] == []
