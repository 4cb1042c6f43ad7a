"""The method registry (strategies/): what it checks, and that a new method is one
module plus one registry line, run end to end through the real Flower simulation."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest

from florg_tools.flwr_cli import run_flower_app
from florg_tools.synthetic import make_sentiment_task, make_tiny_bert
from flower_app.methods.contract import Method
from flower_app.methods.registry import get_method, method_names, register_method
from flower_app.settings.config import ConfigError, resolve_config
from tests.harness.app_copy import ROOT, app_with_method_folder, changed_files
from tests.harness.flower_harness import local_simulation_superlink
from tests.harness.strategy_helpers import strategy_for

NUM_NODES = 2
RANK = 2

# A toy method with a rule, a central-DP mechanism and heterogeneous ranks of its own,
# written as a new method folder would be: half a step from the global factors toward their
# weighted mean, each client's B and A zero-padded to the largest rank.
TOY = "toy_half_step"
TOY_FILES = {
    "__init__.py": '"""A toy method (tests/runtime/test_method_registry.py): half a step."""\n',
    "rule.py": '''
"""The toy rule, numpy: sent + (sum_n w_n pad(X_n) - sent) / 2."""

import numpy as np


def half_step(sent, clients, weights):
    padded = [np.pad(c, [(0, s - d) for s, d in zip(sent.shape, c.shape)]) for c in clients]
    mean = sum(w * c for w, c in zip(weights, padded))
    return sent + 0.5 * (mean - sent)
''',
    "method.py": '''
"""The toy method: LoRA, both factors shared, clients of any rank."""

from flower_app.methods.contract import adapter_layers, stacked
from strategies.shared.base_method import BaseMethod


class ToyHalfStep(BaseMethod):
    def aggregate(self, sent, payloads, weights):
        from strategies.toy_half_step.rule import half_step

        new = {}
        for layer in adapter_layers(sent):
            for part in ("lora_A", "lora_B"):
                key = f"{layer}.{part}"
                new[key] = half_step(sent[key], stacked(payloads, key), weights)
        return new, {"toy-step": 0.5}

    def aggregate_private(self, dp, sent, payloads, num_sampled):
        """The mean mechanism, then the half step (post-processing)."""
        from strategies.server.central_dp import mean_mechanism

        state, info = mean_mechanism(dp, sent, payloads, num_sampled)
        half = {k: sent[k] + 0.5 * (v - sent[k]) for k, v in state.items()}
        return half, {**info, "toy-dp": 1.0}


METHODS = (
    ToyHalfStep(
        name="toy-half-step", summary="toy", adapter="lora", shared=("A", "B"),
        heterogeneous_ranks=True, dp_mechanism="toy-half-mean",
    ),
)
''',
}
# Run in the copy: the toy's strategy from the run settings, its rule and its mechanism.
CHECK_TOY = """
import numpy as np
import strategies.registry
from flower_app.settings.config import resolve_config
from strategies.server.central_dp import CentralDP
from flower_app.methods.registry import build_strategy

rng = np.random.default_rng(0)
sent = {"l.lora_A": rng.standard_normal((2, 3)), "l.lora_B": rng.standard_normal((4, 2))}
low = {"l.lora_A": rng.standard_normal((1, 3)), "l.lora_B": rng.standard_normal((4, 1))}
full = {k: rng.standard_normal(v.shape) for k, v in sent.items()}
mixed = build_strategy(resolve_config({}, {"method": "toy-half-step", "client-ranks": "1,2"}), sent)
new, info = mixed.aggregate_adapter(1, [low, full], np.array([0.5, 0.5]))
pad = {"l.lora_A": np.pad(low["l.lora_A"], ((0, 1), (0, 0))),
       "l.lora_B": np.pad(low["l.lora_B"], ((0, 0), (0, 1)))}
for k in sent:
    assert np.allclose(new[k], sent[k] + 0.5 * ((pad[k] + full[k]) / 2 - sent[k]), atol=1e-12)
private = build_strategy(resolve_config({}, {"method": "toy-half-step", "dp": "central"}), sent)
assert private.dp.mechanism == "toy-half-mean"
private.dp = CentralDP("toy-half-mean", 1e6, 0.0, 1e-5, rng)  # no clipping, no noise
new, private_info = private.aggregate_private(1, [full], 1)
for k in sent:
    assert np.allclose(new[k], sent[k] + 0.5 * (full[k] - sent[k]), atol=1e-12)
print(info["toy-step"], private_info["toy-dp"], mixed.method.heterogeneous_ranks)
"""


def test_every_method_is_registered_with_a_consistent_declaration():
    assert method_names() == (
        "florg", "florg-no-procrustes", "florg-signed", "fedit", "federa", "ffa-lora",
        "fedsa-lora", "fedex-lora", "hetlora", "flexlora", "rolora", "fedsvd", "flora", "fed-sb",
        "fedrot-lora",
    )  # fmt: skip
    assert get_method("fedsa-lora").personal and not get_method("fedit").personal
    assert get_method("ffa-lora").frozen == ("A",)
    assert get_method("florg").adapter == get_method("florg-no-procrustes").adapter == "florg"
    assert get_method("fed-sb").adapter == "lora-sb" and get_method("fed-sb").shared == ("R",)


def test_unknown_methods_and_bad_declarations_are_refused():
    with pytest.raises(ValueError, match="unknown method 'fedavg'; choose one of florg"):
        get_method("fedavg")
    with pytest.raises(ConfigError, match="method: bad value 'fedavg'.*fedex-lora"):
        resolve_config({"method": "fedavg"})
    with pytest.raises(ValueError, match="registered already"):
        register_method(get_method("fedit"), source=__name__)
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
    assert florg.server_device.type == "cpu" and florg.gate.screen_kappa == 3.0
    assert florg.weighting == "num-examples" and florg.updates_dir is None
    ffa = strategy_for("ffa-lora", {"l.lora_B": np.zeros((3, 2))}, min_train_nodes=3)
    assert ffa.method.name == "ffa-lora" and ffa.min_train_nodes == 3 and ffa.fraction_evaluate == 0
    # client-eval=auto: a method with personal parts is evaluated on its clients
    fedsa = strategy_for("fedsa-lora", {"l.lora_A": np.zeros((2, 3))}, save_client_updates=True)
    assert fedsa.fraction_evaluate == 1.0 and fedsa.updates_dir is None  # no run folder
    saved = strategy_for(
        "fedit", state, run_dir=tmp_path, save_client_updates=True, screen_updates=False
    )
    assert saved.updates_dir == tmp_path / "updates" and not saved.gate.screen_updates


# A new strategy option of one method (docs/adding-a-strategy-option.md): FLoRG's L/R
# fingerprint check made optional. One setting in its group (flower_app/settings/) ...
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
import strategies.registry
from flower_app.settings.config import resolve_config
from flower_app.methods.registry import build_strategy

state = {"l.A": np.eye(2)}
on = build_strategy(resolve_config({}), state, fingerprint=7)
off = build_strategy(resolve_config({}, {"florg-check-fingerprint": False}), state, fingerprint=7)
signed = resolve_config({}, {"method": "florg-signed", "florg-check-fingerprint": False})
fedit = resolve_config({}, {"method": "fedit", "florg-check-fingerprint": False})
lora = {"l.lora_A": np.zeros((2, 3)), "l.lora_B": np.zeros((3, 2))}
print(on.fingerprint, off.fingerprint, build_strategy(signed, state, fingerprint=7).fingerprint,
      build_strategy(fedit, lora, fingerprint=7).method.name)
"""


def test_a_new_strategy_option_is_one_setting_plus_its_use_in_the_method_folder(tmp_path):
    """In a copy of the app, a FLoRG option added as one field of FLoRG's settings
    (strategies/florg/settings.py) and one line of strategies/florg/method.py reaches
    FLoRG's strategy (and florg-signed's, which builds its strategy as FLoRG does), from the
    run settings, with no file outside FLoRG's folder touched."""
    app = tmp_path / "app"
    for part in ("flower_app", "strategies"):
        shutil.copytree(ROOT / part, app / part, ignore=shutil.ignore_patterns("__pycache__"))
    config_py = app / "strategies" / "florg" / "settings.py"
    text = config_py.read_text()
    anchor = "    server_device: str = setting(\n"
    assert text.count(anchor) == 1
    config_py.write_text(text.replace(anchor, NEW_SETTING + anchor))
    florg_py = app / "strategies" / "florg" / "method.py"
    text = florg_py.read_text()
    assert text.count(NEW_USE[0]) == 1
    florg_py.write_text(text.replace(*NEW_USE))
    changed = sorted(
        str(path.relative_to(app))
        for path in app.rglob("*.py")
        if path.read_text() != (ROOT / path.relative_to(app)).read_text()
    )
    assert changed == ["strategies/florg/method.py", "strategies/florg/settings.py"]
    out = subprocess.run(
        [sys.executable, "-c", CHECK_NEW_OPTION], cwd=app, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["7", "None", "None", "fedit"]


def test_a_new_method_folder_brings_its_own_rule_mechanism_and_ranks(tmp_path):
    """In a copy of the app with only the toy's folder and its registry line added, the
    toy's strategy is built from the run settings and runs the toy's rule over clients of
    different rank, and its own central-DP mechanism under dp=central."""
    app = app_with_method_folder(tmp_path / "app", TOY, TOY_FILES)
    assert changed_files(app) == sorted(
        ["strategies/registry.py", *(f"strategies/{TOY}/{name}" for name in TOY_FILES)]
    )
    out = subprocess.run([sys.executable, "-c", CHECK_TOY], cwd=app, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["0.5", "1.0", "True"]


@pytest.mark.integration
def test_a_new_method_is_one_folder_plus_one_registry_line_end_to_end(tmp_path):
    app = app_with_method_folder(tmp_path / "app", TOY, TOY_FILES)
    model, task = make_tiny_bert(tmp_path / "model"), make_sentiment_task(tmp_path / "task")
    config = {
        "method": "toy-half-step",
        "client-ranks": "1,2,2",
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
    # Clients of ranks 1, 2, 2: the toy's rule ran (its diagnostic) over all three, and
    # the global adapter has the largest rank.
    assert [r["toy-step"] for r in rows[1:]] == [0.5, 0.5]
    assert [r["clients"] for r in rows[1:]] == [NUM_NODES, NUM_NODES]
    assert rows[2]["up-params-r1"] < rows[2]["up-params-r2"]
    from safetensors.numpy import load_file

    arrays = load_file(str(run_dir / "adapter.safetensors"))
    assert {v.shape[0] for k, v in arrays.items() if k.endswith(".lora_A")} == {RANK}
