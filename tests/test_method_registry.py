"""The method registry (strategies/): what it checks, and that a new method is one
module plus one registry line, run end to end through the real Flower simulation."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from florg_tools.flwr_cli import run_flower_app
from florg_tools.synthetic import make_sentiment_task, make_tiny_bert
from flower_app.adapters.targets import adapter_layout
from flower_app.config import ConfigError, resolve_config
from strategies.registry import Method, get_method, method_names, register_method
from tests.app_copy import ROOT, app_with_registered_module
from tests.flower_harness import local_simulation_superlink
from tests.strategy_helpers import strategy_for

NUM_NODES = 2
RANK = 2

# A toy method: LoRA with A frozen at its seeded initialisation and B averaged (FFA-LoRA's
# rule), under its own name, written as a new method module would be.
TOY_MODULE = '''
"""A toy method (tests/test_method_registry.py): only B travels, A is frozen."""

from __future__ import annotations

from strategies.method import Method


class ToyFrozenA(Method):
    def build_strategy(self, config, initial_state, *, fingerprint=None, run_dir=None):
        from strategies.common.lora_strategies import FFALoRAStrategy

        return FFALoRAStrategy(initial_state, **self.strategy_settings(config, run_dir=run_dir))


TOY = ToyFrozenA(
    name="toy-frozen-a", summary="toy", adapter="lora", shared=("B",), frozen=("A",)
)
METHODS = (TOY,)
'''


def test_every_method_is_registered_with_a_consistent_declaration():
    assert method_names() == (
        "florg", "florg-no-procrustes", "florg-signed", "fedit", "federa", "ffa-lora",
        "fedsa-lora", "fedex-lora", "hetlora", "flexlora",
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


def test_each_method_builds_its_strategy_from_the_run_settings(tmp_path):
    state = {"l.lora_A": np.zeros((2, 3)), "l.lora_B": np.zeros((3, 2))}
    fedex = strategy_for("fedex-lora", state, fedex_residual="factored", fingerprint=7)
    assert fedex.residual_mode == "factored"
    florg = strategy_for(
        "florg-no-procrustes", {"l.A": np.eye(2)}, fingerprint=7, rank_mismatch="truncate",
        server_device="cpu", screen_kappa=3.0, aggregation_weights="num-examples",
    )  # fmt: skip
    assert florg.fingerprint == 7 and not florg.procrustes and florg.rank_mismatch == "truncate"
    assert florg.server_device.type == "cpu" and florg.screen_kappa == 3.0
    assert florg.weighting == "num-examples" and florg.updates_dir is None
    ffa = strategy_for("ffa-lora", {"l.lora_B": np.zeros((3, 2))}, min_train_nodes=3)
    assert ffa.method == "ffa-lora" and ffa.min_train_nodes == 3 and ffa.fraction_evaluate == 0
    # client-eval=auto: a method with personal parts is evaluated on its clients
    fedsa = strategy_for("fedsa-lora", {"l.lora_A": np.zeros((2, 3))}, save_client_updates=True)
    assert fedsa.fraction_evaluate == 1.0 and fedsa.updates_dir is None  # no run folder
    saved = strategy_for(
        "fedit", state, run_dir=tmp_path, save_client_updates=True, screen_updates=False
    )
    assert saved.updates_dir == tmp_path / "updates" and not saved.screen_updates


# A new strategy option of one method (docs/adding-a-strategy-option.md): FLoRG's L/R
# fingerprint check made optional. One setting in flower_app/config.py ...
NEW_SETTING = """    florg_check_fingerprint: bool = setting(
        True, "FLoRG: reject a client whose L/R fingerprint differs", affects=()
    )
"""
# ... and its use in strategies/florg/method.py.
NEW_USE = (
    "            fingerprint=fingerprint,\n",
    "            fingerprint=fingerprint if config.florg_check_fingerprint else None,\n",
)
CHECK_NEW_OPTION = """
import numpy as np
from flower_app.config import resolve_config
from strategies.registry import build_strategy

state = {"l.A": np.eye(2)}
on = build_strategy(resolve_config({}), state, fingerprint=7)
off = build_strategy(resolve_config({}, {"florg-check-fingerprint": False}), state, fingerprint=7)
signed = resolve_config({}, {"method": "florg-signed", "florg-check-fingerprint": False})
fedit = resolve_config({}, {"method": "fedit", "florg-check-fingerprint": False})
lora = {"l.lora_A": np.zeros((2, 3)), "l.lora_B": np.zeros((3, 2))}
print(on.fingerprint, off.fingerprint, build_strategy(signed, state, fingerprint=7).fingerprint,
      build_strategy(fedit, lora, fingerprint=7).method)
"""


def test_a_new_strategy_option_is_one_setting_plus_its_use_in_the_method_module(tmp_path):
    """In a copy of the app, a FLoRG option added as one RunConfig field and one line of
    strategies/florg/method.py reaches FLoRG's strategy (and florg-signed's, which builds
    its strategy as FLoRG does), from the run settings, with no other file touched."""
    app = tmp_path / "app"
    for part in ("flower_app", "strategies"):
        shutil.copytree(ROOT / part, app / part, ignore=shutil.ignore_patterns("__pycache__"))
    config_py = app / "flower_app" / "config.py"
    text = config_py.read_text()
    anchor = "    lora_init: str = setting(\n"
    assert text.count(anchor) == 1
    config_py.write_text(text.replace(anchor, NEW_SETTING + anchor))
    florg_py = app / "flower_app" / "methods" / "florg.py"
    text = florg_py.read_text()
    assert text.count(NEW_USE[0]) == 1
    florg_py.write_text(text.replace(*NEW_USE))
    changed = sorted(
        str(path.relative_to(app))
        for path in app.rglob("*.py")
        if path.read_text() != (ROOT / path.relative_to(app)).read_text()
    )
    assert changed == ["flower_app/config.py", "strategies/florg/method.py"]
    out = subprocess.run(
        [sys.executable, "-c", CHECK_NEW_OPTION], cwd=app, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["7", "None", "None", "fedit"]


def _app_with_toy_method(folder: Path) -> Path:
    """A copy of the app whose only change is the toy module and its registry line."""
    return app_with_registered_module(folder, "methods", "toy", TOY_MODULE, "METHOD_MODULES")


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
