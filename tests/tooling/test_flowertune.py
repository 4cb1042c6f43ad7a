"""The FlowerTune LLM leaderboard's rules before launch (flower_app/preflight/leaderboard.py,
florg_tools/flowertune.py): the projected communication from a Mistral-7B-v0.3-shaped
config (no weights), every refusal naming its rule before anything starts, the lift, the
Hub named where a data set or a model's config cannot be had; and the templates' prompt
(prompt-format = flowertune, flower_app/data/sft.py)."""

from __future__ import annotations

import datasets
import pytest

from florg_tools.comm_projection import adapted_layer_shapes, clients_per_round, project
from florg_tools.flowertune import main as flowertune_main
from florg_tools.flwr_home import write_local_simulation_connection
from florg_tools.launch import main as launch_main
from florg_tools.run_config import load_preset
from flower_app.data import sft
from flower_app.preflight.leaderboard import BUDGET_MB, TRACKS
from flower_app.settings.config import resolve_config

ROOT = str(__import__("pathlib").Path(__file__).resolve().parents[2])


@pytest.fixture(scope="module")
def mistral(tmp_path_factory) -> str:
    """A folder holding only Mistral-7B-v0.3's config.json (its published shapes)."""
    from transformers import MistralConfig

    path = tmp_path_factory.mktemp("mistral-7b-v0.3")
    MistralConfig(
        vocab_size=32768, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        max_position_embeddings=32768, sliding_window=None,
    ).save_pretrained(path)  # fmt: skip
    return str(path)


def track_config(track: str, **settings) -> object:
    return resolve_config({}, {**load_preset(f"flowertune-{track}"), **settings})


# --------------------------------------------------------------------------- projection


@pytest.mark.parametrize("track", sorted(TRACKS))
def test_the_projection_counts_each_methods_messages_from_the_config(mistral, track):
    """On Mistral-7B's q_proj (4096 x 4096) and v_proj (1024 x 4096) in 32 layers at r = 32:
    FLoRG sends r k per module, LoRA r (d_in + d_out), as float32, each way, for every
    sampled client every round."""
    config = track_config(track, model=mistral)
    shapes = adapted_layer_shapes(config, "causal-lm")
    assert len(shapes) == 64
    assert set(shapes.values()) == {(4096, 4096), (1024, 4096)}
    spec = TRACKS[track]
    clients = clients_per_round(config, spec.num_supernodes)
    assert clients == max(int(spec.num_supernodes * spec.fraction_train), 2)
    by_method = {p.method: p for p in project(config, shapes, spec.num_supernodes)}
    florg_params = 32 * (32 * 4096 + 32 * 1024)  # r k per module
    lora_params = 32 * (32 * (4096 + 4096) + 32 * (4096 + 1024))  # r (d_in + d_out)
    mb = 4 / 1024**2
    florg, fedit = by_method["florg"], by_method["fedit"]
    assert (florg.up_params, florg.down_params) == (florg_params, florg_params)
    assert florg.total_mb == pytest.approx(200 * clients * 2 * florg_params * mb)
    assert fedit.total_mb == pytest.approx(200 * clients * 2 * lora_params * mb)
    # FLoRG: a small fraction of the budget, under half of FedIT's
    assert florg.total_mb < 0.25 * BUDGET_MB and florg.total_mb < 0.4 * fedit.total_mb
    # RoLoRA sends B up in odd rounds and A in even ones, both down; FedSVD B up, both down
    b_params = 32 * (32 * 4096 + 32 * 1024)  # r d_out per module: q_proj, v_proj
    a_params = 32 * (32 * 4096 + 32 * 4096)  # r d_in: both read 4096 features
    rolora, fedsvd = by_method["rolora"], by_method["fedsvd"]
    assert rolora.total_mb == pytest.approx(
        clients * (100 * b_params + 100 * a_params + 200 * lora_params) * mb
    )
    assert fedsvd.total_mb == pytest.approx(clients * 200 * (b_params + lora_params) * mb)


def test_the_general_nlp_fedit_projection_is_the_leaderboards_baseline_cost(mistral):
    """The leaderboard lists its Mistral-7B-v0.3 general-NLP baseline (FedAvg of PEFT
    LoRA, r = 32) at 40.7 GB: 41,600 MB here (= 40.6 GiB)."""
    config = track_config("general-nlp", model=mistral, method="fedit")
    (fedit,) = project(config, adapted_layer_shapes(config, "causal-lm"), 20, ("fedit",))
    assert fedit.total_mb == pytest.approx(41_600)


def test_florg_flowertune_projection_prints_every_method(mistral, capsys):
    assert flowertune_main(["projection", "--set", f"model={mistral}"]) == 0
    out = capsys.readouterr().out
    for track in TRACKS:
        assert f"[leaderboard] {track}: projected communication" in out
    assert out.count("<- this run") == 4 and " fedit " in out
    assert "16,000.0" in out  # FLoRG, 2 clients x 2 ways x 20 MB x 200 rounds


# --------------------------------------------------------------------------- the rules


@pytest.fixture
def home(tmp_path, monkeypatch):
    """A Flower home whose default connection simulates N SuperNodes (set by the test);
    the Hub out of reach whatever this machine's network and caches (HF_HUB_OFFLINE, no
    cached copy), so no launch here gets past the checks to start a SuperLink."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("flower_app.preflight.hub.cached", lambda repo_id, repo_type: False)
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "home"

    def make(num_supernodes: int) -> str:
        write_local_simulation_connection(
            path, num_supernodes=num_supernodes, num_cpus_per_client=1,
            num_gpus_per_client=0.0, set_default=True,
        )  # fmt: skip
        return str(path)

    return make


def launch(home_dir: str, *sets: str) -> int:
    argv = ["--app", ROOT, "--flwr-home", home_dir, "--ephemeral-superlink", "--quiet"]
    argv += ["--preset", "flowertune-general-nlp"]
    for item in sets:
        argv += ["--set", item]
    return launch_main(argv)


@pytest.mark.parametrize(
    ("sets", "supernodes", "rule", "detail"),
    [
        (("task=squad-gen",), 20, "static config", "task='squad-gen'"),
        (("max-train-examples=1000",), 20, "static config", "max-train-examples=1000"),
        (("partitioner=dirichlet",), 20, "static config", "partitioner='dirichlet'"),
        ((), 5, "SuperNodes", "simulates 5 SuperNodes, the track needs 20"),
        (("method=fedsa-lora",), 20, "one global PEFT checkpoint", "personal parts"),
        (("method=fedit", "num-server-rounds=1000"), 20, "communication budget", "208,000 MB"),
    ],
)
def test_a_broken_rule_is_refused_before_anything_starts(
    home, mistral, capsys, tmp_path, sets, supernodes, rule, detail
):
    """Exit 2 and one line naming the track and the rule; no SuperLink (tests/conftest.py's
    guard), no run folder."""
    code = launch(home(supernodes), f"model={mistral}", *sets)
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f"error: invalid run config: leaderboard (general-nlp, rule '{rule}')")
    assert detail in err and "leaderboard=false" in err
    assert not (tmp_path / "outputs").exists()


def test_the_rules_holding_the_projection_is_printed_then_the_hub_is_named(home, mistral, capsys):
    """The track's rules hold (20 SuperNodes, the static config, FLoRG well within the
    budget): the projection is printed beside every method's; the data set then cannot
    be had here (the Hub, offline), so the launch stops there, naming the Hub."""
    assert launch(home(20), f"model={mistral}") == 2
    err = capsys.readouterr().err
    assert "florg" in err and "<- this run" in err and "the track's rules hold" in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: invalid run config: task: flwrlabs/alpaca-gpt4")
    assert "Hugging Face Hub" in last


def test_leaderboard_false_lifts_the_checks(home, mistral, capsys):
    code = launch(home(5), f"model={mistral}", "leaderboard=false", "method=fedsa-lora")
    assert code == 2  # past the rules; refused at the Hub's data set
    err = capsys.readouterr().err
    assert "checks lifted" in err and "rule '" not in err
    assert "Hugging Face Hub" in err.strip().splitlines()[-1]


def test_a_base_model_config_out_of_reach_is_refused_naming_the_hub(home, capsys):
    assert launch(home(20)) == 2  # mistralai/Mistral-7B-v0.3, the Hub offline
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("error: invalid run config: model: cannot read its config")
    assert "mistralai/Mistral-7B-v0.3" in last and "Hugging Face Hub" in last


def test_a_run_in_no_track_is_not_gated(home, capsys):
    from florg_tools.flowertune import leaderboard_gate

    assert leaderboard_gate({}, __import__("pathlib").Path(home(2)), None) is None
    assert capsys.readouterr().err == ""


# --------------------------------------------------------------------------- the prompt


def test_the_flowertune_prompt_is_the_templates():
    """The templates' text: preamble, '### Instruction:', the instruction (two fields
    joined by a space), then '### Response: ' and the output, the loss on the output."""
    rows = datasets.Dataset.from_list(
        [{"instruction": "Classify.", "input": "Stocks rose.", "output": "positive"}]
    )
    one = sft.from_instructions(rows, ("instruction", "input"), "output", "flowertune")[0]
    assert one["prompt"] + one["response"] == (
        "Below is an instruction that describes a task. Write a response that appropriately "
        "completes the request.\n### Instruction:\nClassify. Stocks rose.\n### Response: positive"
    )
    assert one["response"] == " positive"
    alone = sft.from_instructions(rows, ("input",), "output", "flowertune")[0]
    assert "### Instruction:\nStocks rose.\n### Response:" in alone["prompt"]
    alpaca = sft.from_instructions(rows, ("instruction", "input"), "output")[0]
    assert alpaca["prompt"].startswith("### Instruction:\nClassify.\n\n### Input:\nStocks rose.")
    with pytest.raises(ValueError, match="prompt format"):
        sft.from_instructions(rows, ("instruction",), "output", "chatml")
