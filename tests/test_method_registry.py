"""The method registry (flower_app/methods/): what it checks, and that a new method is one
module plus one registry line, run end to end through the real Flower simulation."""

from __future__ import annotations

import json
import shutil
import textwrap
from pathlib import Path

import numpy as np
import pytest

from florg_tools.flwr_cli import run_flower_app
from florg_tools.synthetic import make_sentiment_task, make_tiny_bert
from flower_app.adapters.targets import adapter_layout
from flower_app.config import ConfigError, resolve_config
from flower_app.methods import Method, build_strategy, get_method, method_names, register_method
from tests.flower_harness import local_simulation_superlink

ROOT = Path(__file__).resolve().parent.parent
APP_PARTS = ("pyproject.toml", "flower_app", "client_app", "server_app", "strategies", "conf")
NUM_NODES = 2
RANK = 2

# A toy method: LoRA with A frozen at its seeded initialisation and B averaged (FFA-LoRA's
# rule), under its own name, written as a new method module would be.
TOY_MODULE = '''
"""A toy method (tests/test_method_registry.py): only B travels, A is frozen."""

from __future__ import annotations

from flower_app.methods.base import Method


class ToyFrozenA(Method):
    def build_strategy(self, initial_state, options, **kwargs):
        from strategies.flower.lora_strategies import FFALoRAStrategy

        return FFALoRAStrategy(initial_state, **kwargs)


TOY = ToyFrozenA(
    name="toy-frozen-a", summary="toy", adapter="lora", shared=("B",), frozen=("A",)
)
METHODS = (TOY,)
'''


def test_every_method_is_registered_with_a_consistent_declaration():
    assert method_names() == (
        "florg", "florg-no-procrustes", "florg-signed", "fedit", "federa", "ffa-lora",
        "fedsa-lora", "fedex-lora",
    )  # fmt: skip
    assert get_method("fedsa-lora").personal and not get_method("fedit").personal
    assert get_method("ffa-lora").frozen == ("A",)
    assert get_method("florg").adapter == get_method("florg-no-procrustes").adapter == "florg"


def test_unknown_methods_and_bad_declarations_are_refused():
    with pytest.raises(ValueError, match="unknown method 'fedavg'; choose one of florg"):
        get_method("fedavg")
    with pytest.raises(ConfigError, match="method: bad value 'fedavg'.*fedex-lora"):
        resolve_config({"method": "fedavg"})
    with pytest.raises(ValueError, match="registered already"):
        register_method(get_method("fedit"))
    with pytest.raises(ValueError, match="parts of a florg adapter"):
        Method(name="x", summary="", adapter="florg", shared=("B",))
    with pytest.raises(ValueError, match="adapter must be one of"):
        Method(name="x", summary="", adapter="dora", shared=("A",))
    with pytest.raises(ValueError, match="shared part cannot be local or frozen"):
        Method(name="x", summary="", adapter="lora", shared=("A",), frozen=("A",))


def test_the_strategy_factory_passes_each_method_only_what_it_reads():
    state = {"l.lora_A": np.zeros((2, 3)), "l.lora_B": np.zeros((3, 2))}
    fedex = build_strategy("fedex-lora", state, residual_mode="factored", fingerprint=7)
    assert fedex.residual_mode == "factored"
    florg = build_strategy("florg-no-procrustes", {"l.A": np.eye(2)}, fingerprint=7)
    assert florg.fingerprint == 7 and not florg.procrustes
    assert build_strategy("ffa-lora", {"l.lora_B": np.zeros((3, 2))}).method == "ffa-lora"


def _app_with_toy_method(folder: Path) -> Path:
    """A copy of the app whose only change is the toy module and its registry line."""
    folder.mkdir(parents=True)
    for part in APP_PARTS:
        source = ROOT / part
        if source.is_dir():
            shutil.copytree(source, folder / part, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(source, folder / part)
    (folder / "flower_app" / "methods" / "toy.py").write_text(textwrap.dedent(TOY_MODULE))
    registry = folder / "flower_app" / "methods" / "__init__.py"
    text = registry.read_text()
    assert text.count("METHOD_MODULES = (\n") == 1
    registry.write_text(text.replace("METHOD_MODULES = (\n", 'METHOD_MODULES = (\n    "toy",\n'))
    return folder


@pytest.mark.integration
def test_a_new_method_is_one_module_plus_one_registry_line_end_to_end(tmp_path):
    app = _app_with_toy_method(tmp_path / "app")
    model, task = make_tiny_bert(tmp_path / "model"), make_sentiment_task(tmp_path / "task")
    config = {
        "method": "toy-frozen-a",
        "model": str(model),
        "task": "local",
        "data-path": str(task),
        "text-fields": "sentence",
        "rank": RANK,
        "num-server-rounds": 2,
        "min-available-nodes": NUM_NODES,
        "batch-size": 16,
        "output-dir": str(tmp_path / "outputs"),
        "run-name": "toy",
    }
    with local_simulation_superlink(tmp_path / "superlink", num_supernodes=NUM_NODES) as sim:
        home, connection = sim
        outcome = run_flower_app(app, connection, config, home, timeout=600, stream=None)
    assert outcome.ok, f"{outcome.message}\n{outcome.log_text[-4000:]}"
    run_dir = tmp_path / "outputs" / "toy"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [0, 1, 2]
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "finished"
    # What travelled is the toy's declaration: B and the head, never A.
    from safetensors.numpy import load_file
    from transformers import AutoModelForSequenceClassification

    keys = set(load_file(str(run_dir / "adapter.safetensors")))
    assert any(k.endswith(".lora_B") for k in keys)
    assert not any(k.endswith(".lora_A") for k in keys)
    shapes, head = adapter_layout(
        AutoModelForSequenceClassification.from_pretrained(model, num_labels=2),
        ("query", "value"),
        None,
    )
    b_params = sum(d_out * RANK for d_out, _ in shapes.values())
    assert rows[1]["up-params"] == NUM_NODES * (b_params + head)
    assert rows[2]["down-params"] == rows[1]["up-params"]
