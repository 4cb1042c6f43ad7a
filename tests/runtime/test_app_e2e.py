"""The Flower App end to end through the real simulation engine (SuperLink + Ray).

One SuperLink (our own, on a free port: conftest.py's ``tiny_superlink``) serves every run
of this module, its runs on one private Ray cluster (tests/harness/ray_harness.py); each run is a
tiny random BERT on a small local task, 3 supernodes, 2 rounds
(``tests.harness.flower_harness.run_tiny_app``).

Resumption (issue 15, item 1) runs here too, on the same SuperLink: a ServerApp that dies
right after checkpointing round 1 (``fault-server-round=1``, the run ends ``finished:failed``)
is resumed with the launcher's settings (``resume_run_config``: the run folder's config.json
plus ``resume=RUN_DIR``); no round runs twice or is skipped, metrics.jsonl continues, and the
final adapter equals the uninterrupted run's -- the end-to-end run of the same method, reused
(the tiny model trains deterministically).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from florg_tools.flwr_cli import RunOutcome, run_flower_app
from florg_tools.run_config import resume_run_config
from flower_app.adapters.targets import adapter_layout
from flower_app.methods.communication import round_communication
from flower_app.methods.registry import get_method, method_names
from flower_app.privacy.accounting import epsilon_for
from strategies.florg.rule import aggregate_florg
from strategies.florg_signed.rule import aggregate_florg_signed
from tests.harness.flower_harness import TINY_NUM_NODES, TINY_RANK, run_tiny_app

METHODS = method_names()
pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
NUM_NODES, RANK = TINY_NUM_NODES, TINY_RANK


# This module's settings on top of the tiny app's (run_tiny_app): every client's update saved
# (the FLoRG round's check reads them) and a small test split.
E2E = {"batch-size": 16, "save-client-updates": True, "max-test-examples": 40}


def run(tiny_superlink, tiny_assets, name: str, **settings) -> tuple[RunOutcome, Path]:
    return run_tiny_app(tiny_superlink, tiny_assets, name, **{**E2E, **settings})


@pytest.fixture(scope="module")
def clean_run(tiny_superlink, tiny_assets) -> Callable[[str], tuple[RunOutcome, Path]]:
    """``clean_run(method)``: the module's end-to-end run of ``method``, made once (the
    resumption tests compare with it)."""
    made: dict[str, tuple[RunOutcome, Path]] = {}

    def get(method: str) -> tuple[RunOutcome, Path]:
        if method not in made:
            made[method] = run(tiny_superlink, tiny_assets, f"e2e-{method}", method=method)
        return made[method]

    return get


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def expected_params(method: str, model_dir: Path, n: int, server_round: int = 1) -> tuple[int, int]:
    """(up, down) in ``server_round`` for n clients from the core's accounting."""
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(model_dir, num_labels=2)
    shapes, head = adapter_layout(model, ("query", "value"), None)
    c = round_communication(method, shapes, RANK, head, num_clients=n, server_round=server_round)
    return n * c.up_params, n * c.down_params


@pytest.mark.parametrize("method", METHODS)
def test_every_method_runs_end_to_end(tiny_assets, clean_run, method):
    outcome, run_dir = clean_run(method)
    assert outcome.ok, f"{outcome.message}\n{outcome.log_text[-4000:]}"
    history = rows(run_dir)
    assert [r["round"] for r in history] == [0, 1, 2]
    for r in history:
        assert isinstance(r["accuracy"], float) and 0.0 <= r["accuracy"] <= 1.0
        assert np.isfinite(r["loss"])
    up, down = expected_params(method, tiny_assets[0], NUM_NODES)
    second_up, second_down = expected_params(method, tiny_assets[0], NUM_NODES, server_round=2)
    first_down = (
        expected_params("fedit", tiny_assets[0], NUM_NODES)[1]
        if get_method(method).writes_base_weights  # no fold to send before round 2
        else down
    )
    # Round 0 sends nothing, except for a method that initialises from its clients first
    # (Fed-SB: their gradients of every adapted W0 up).
    zeroth_up, zeroth_down = expected_params(method, tiny_assets[0], NUM_NODES, server_round=0)
    assert (history[0]["up-params"], history[0]["down-params"]) == (zeroth_up, zeroth_down)
    assert history[1]["up-params"] == up and history[2]["up-params"] == second_up
    # A fold into W0 (FedEx's residual, FLoRA's update) of round t travels with round t+1's
    # message; Fed-SB's B and A with round 1's only.
    assert history[1]["down-params"] == first_down and history[2]["down-params"] == second_down
    assert history[2]["cum-up-params"] == zeroth_up + up + second_up
    assert history[2]["clients"] == NUM_NODES
    # The bytes that travelled, read from the serialised messages: each float32 entry's 4
    # bytes plus the messages' framing (array names, dtypes, shapes, the config, metadata).
    for r in history[1:]:
        for direction, params in (("uplink", r["up-params"]), ("downlink", r["down-params"])):
            sent = r[f"{direction}-bytes"]
            assert 4 * params < sent < 4 * params + 16_384 * NUM_NODES, (direction, r)
            assert r[f"{direction}-bytes-per-client"] == pytest.approx(sent / NUM_NODES)
            assert r[f"{direction}-bytes-max"] >= r[f"{direction}-bytes-per-client"]
    assert history[2]["cum-uplink-bytes"] == sum(r.get("uplink-bytes", 0) for r in history)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["final-accuracy"] == history[-1]["accuracy"]
    assert (run_dir / "adapter.safetensors").exists()
    config = json.loads((run_dir / "config.json").read_text())
    assert config["method"] == method and config["rank"] == RANK

    if get_method(method).writes_base_weights:  # its folds live in W0: the merged model
        assert (run_dir / "merged_model" / "config.json").exists()
    if method.startswith("florg") or get_method(method).adapter == "lora-sb":
        assert (run_dir / "peft_lora" / "adapter_model.safetensors").exists()
    if method.startswith("florg"):
        for key in ("rank", "gram_rel_error", "drift", "eigengap", "agg-seconds"):
            assert np.isfinite(history[2][key]), key
        check_florg_round(run_dir / "updates" / "round-2.npz", method)
    assert [r["round"] for r in history if "test-score" in r] == [0, 1, 2]
    if method == "fedsa-lora":
        check_personalised_scores(history, summary)
    else:
        assert summary["test-score-key"] == "test-score"
        assert summary["final-test-score"] == history[2]["test-score"]


def test_a_run_records_its_commit_and_its_rerun_repeats_it(tiny_superlink, tiny_assets, clean_run):
    """The run's config.json names the commit of this checkout (app-commit, set by the
    launcher's run_flower_app); ``florg launch --rerun RUN_DIR``'s run config (from that
    config.json alone) runs it again to the same rows and adapter, bit for bit."""
    from ci.behaviour_snapshot import compare_case
    from florg_tools.flwr_cli import run_flower_app
    from florg_tools.provenance import checkout_commit
    from florg_tools.run_config import rerun_run_config

    outcome, run_dir = clean_run("florg")
    assert outcome.ok, outcome.message
    config = json.loads((run_dir / "config.json").read_text())
    assert config["app-commit"] == checkout_commit(ROOT) and len(config["app-commit"]) >= 40
    home, connection = tiny_superlink
    rerun = rerun_run_config(run_dir, {"output-dir": str(run_dir.parent)})
    assert rerun["run-name"] == "e2e-florg-rerun" and "app-commit" not in rerun
    again = run_flower_app(ROOT, connection, rerun, home, timeout=600, stream=None)
    assert again.ok, f"{again.message}\n{again.log_text[-3000:]}"
    assert compare_case(run_dir, run_dir.parent / "e2e-florg-rerun") == []


# Issue 29's command, `florg launch --set dp=central --set dp-noise-multiplier=1.0
# --set dp-clipping-norm=1.0 --set method=M --set num-server-rounds=2`, on the tiny model.
DP = {"dp": "central", "dp-noise-multiplier": 1.0, "dp-clipping-norm": 1.0}
# The DP runs keep no client updates (refused under dp=central) and skip what they do not check.
CHEAP_DP = {"save-client-updates": False, "max-test-examples": 0, "client-eval": "off"}


# FedIT's mechanism runs through the simulation in the resumed DP run below (its checks and
# the ledger's continuation), not in a run of its own here.
DP_RESUMED = "fedit"


def _dp_methods() -> list[str]:
    """One method per central-DP mechanism (every method's mechanism, florg-signed's sign
    blocks included, is checked on the strategy in tests/runtime/test_dp_app.py) and FedSA-LoRA
    (clients evaluate): each path through the simulation once, keeping CI's time down. A
    method that refuses dp=central (FedEx-LoRA, FLoRA) fails in resolve_config, as
    test_bad_config_fails_the_run_naming_the_key's run does; its reason is checked in
    tests/runtime/test_dp_app.py."""
    chosen: dict[str, str] = {}
    for name in METHODS:
        mechanism = get_method(name).dp_mechanism
        if mechanism is not None:
            chosen.setdefault(mechanism, name)
    assert chosen[get_method(DP_RESUMED).dp_mechanism] == DP_RESUMED
    return sorted({*chosen.values(), "fedsa-lora"} - {DP_RESUMED})


@pytest.mark.parametrize("method", _dp_methods())
def test_each_dp_path_runs_with_central_dp_and_reports_epsilon(tiny_superlink, tiny_assets, method):
    """Every row has dp-epsilon, 0 before training, then the accountant's epsilon after t
    rounds of z = 1 at q = 1 and the default delta."""
    outcome, run_dir = run(
        tiny_superlink, tiny_assets, f"dp-{method}", method=method, **DP, **CHEAP_DP
    )
    assert outcome.ok, f"{outcome.message}\n{outcome.log_text[-4000:]}"
    check_dp_run(run_dir, outcome.log_text, delta=1e-5)


@pytest.mark.parametrize("method", ["florg", "fedit"])
def test_poisson_client_sampling_with_central_dp_reports_q_the_count_and_epsilon(
    tiny_superlink, tiny_assets, method
):
    """client-sampling=poisson at q = fraction-train = 2/3 over the 3 nodes: every row has
    q, N, the count and the accountant's epsilon at q (amplified: below q = 1's), and the
    divisor is q N whatever the count."""
    q = 2 / 3
    poisson = {"client-sampling": "poisson", "fraction-train": q}
    outcome, run_dir = run(
        tiny_superlink,
        tiny_assets,
        f"dp-poisson-{method}",
        method=method,
        **DP,
        **CHEAP_DP,
        **poisson,
    )
    assert outcome.ok, f"{outcome.message}\n{outcome.log_text[-4000:]}"
    history = rows(run_dir)
    assert [r["round"] for r in history] == [0, 1, 2] and history[0]["dp-epsilon"] == 0.0
    for t in (1, 2):
        row = history[t]
        assert row["dp-epsilon"] == pytest.approx(epsilon_for(1.0, q, t, 1e-5), rel=1e-9)
        assert row["dp-epsilon"] < epsilon_for(1.0, 1.0, t, 1e-5)
        assert row["sample-rate"] == pytest.approx(q) and row["population"] == NUM_NODES
        assert row["sampled"] == row["dp-sampled"] and 0 <= row["sampled"] <= NUM_NODES
        assert row["clients"] <= row["sampled"]
        assert row["dp-divisor"] == pytest.approx(q * NUM_NODES)
        assert np.isfinite(row["loss"])
    state = json.loads((run_dir / "checkpoint" / "round-000002" / "state.json").read_text())
    assert state["strategy"]["dp"]["compositions"] == [[1.0, pytest.approx(q), 2]]


def test_fed_sb_with_central_dp_accounts_round_0_and_reports_epsilon_in_every_row(
    tiny_superlink, tiny_assets
):
    """Fed-SB under dp=central (docs/privacy.md section 2.1): round 0's gradient estimate goes
    through the Gaussian mechanism, noised and recorded by the accountant before the rounds'
    mean mechanism on R, so every row's dp-epsilon is finite, row 0's is one release's (not
    0) and row t's that of t + 1; the checkpointed ledger holds the three releases."""
    outcome, run_dir = run(
        tiny_superlink, tiny_assets, "dp-fed-sb", method="fed-sb", **DP, **CHEAP_DP
    )
    assert outcome.ok, f"{outcome.message}\n{outcome.log_text[-4000:]}"
    check_dp_run(run_dir, outcome.log_text, delta=1e-5, releases_before_round_1=1)
    state = json.loads((run_dir / "checkpoint" / "round-000002" / "state.json").read_text())
    assert state["strategy"]["dp"]["compositions"] == [[1.0, 1.0, 3]]


def check_dp_run(
    run_dir: Path, log_text: str, delta: float, releases_before_round_1: int = 0
) -> None:
    """Rows 0..2, each with a finite dp-epsilon: the accountant's epsilon after the releases
    so far at z = 1, q = 1, which are ``releases_before_round_1`` (Fed-SB's round 0: one;
    without any, row 0 has 0) and then one a round; every node sampled and noise added in
    each release, the summary's epsilon."""
    history = rows(run_dir)
    assert [r["round"] for r in history] == [0, 1, 2]
    epsilons = [r["dp-epsilon"] for r in history]
    assert np.all(np.isfinite(epsilons)) and epsilons[0] < epsilons[1] < epsilons[2]
    if not releases_before_round_1:
        assert epsilons[0] == 0.0
    for t in range(0 if releases_before_round_1 else 1, 3):  # the rows after a release
        releases = releases_before_round_1 + t
        assert epsilons[t] == pytest.approx(epsilon_for(1.0, 1.0, releases, delta), rel=1e-9)
        assert history[t]["dp-sampled"] == NUM_NODES and history[t]["clients"] == NUM_NODES
        assert history[t]["dp-noise-std"] > 0
    for t in (1, 2):
        assert history[t]["screened"] == 0 and np.isfinite(history[t]["loss"])
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["dp-epsilon"] == epsilons[2] and summary["dp-delta"] == delta
    assert not (run_dir / "updates").exists()
    assert f"dp epsilon {epsilons[2]:.4g}" in log_text


def check_personalised_scores(history: list[dict], summary: dict) -> None:
    """FedSA-LoRA is reported by its clients' personalised models on the common test split
    (its global model has B = 0), and tuned on them on the common validation split."""
    assert 0.0 <= history[2]["personalized-accuracy"] <= 1.0  # each client's own share
    assert summary["test-score-key"] == "personalized-test-score"
    assert summary["val-score-key"] == "personalized-val-score"
    assert summary["final-test-score"] == history[2]["personalized-test-score"]
    assert summary["global-final-test-score"] == history[2]["test-score"]
    # round 0: every personalised model is the global one; later they differ from it
    assert history[0]["personalized-test-loss"] == history[0]["test-loss"]
    for row in history[1:]:
        assert row["personalized-test-loss"] != row["test-loss"]
        assert 0.0 <= row["personalized-val-score"] <= 1.0


def check_florg_round(path: Path, method: str) -> None:
    """The global A after round 2 equals the core function applied to the clients' replies
    (florg-signed's: FLoRG's step per sign block)."""
    procrustes = method != "florg-no-procrustes"
    aggregate = aggregate_florg_signed if method == "florg-signed" else aggregate_florg
    saved = np.load(path)
    weights = saved["weights"]
    assert sorted(saved["partitions"].tolist()) == list(range(NUM_NODES))
    layers = [
        k[len("new/") : -len(".A")]
        for k in saved.files
        if k.startswith("new/") and k.endswith(".A")
    ]
    assert layers
    for layer in layers:
        key = f"{layer}.A"
        clients = [saved[f"client{i}/{key}"] for i in range(NUM_NODES)]
        expected, _ = aggregate(clients, weights, saved[f"prev/{key}"], procrustes=procrustes)
        np.testing.assert_allclose(saved[f"new/{key}"], expected, rtol=1e-12, atol=1e-14)


def test_clients_of_different_rank_end_at_their_own_rank(tiny_superlink, tiny_assets):
    """Issue 30: `client-ranks=2,4` (cycled over the 3 partitions: 2, 4, 2) with FLoRG; the
    global state and the server's model are at r_max = 4; each client trains and sends its
    adapter at its own rank; round 2 is the mixed-rank step of the clients' replies, and
    the communication per rank is what travelled."""
    outcome, run_dir = run(
        tiny_superlink,
        tiny_assets,
        "e2e-client-ranks",
        **{"client-ranks": "2,4", "rank-mismatch": "truncate"},
    )
    assert outcome.ok, f"{outcome.message}\n{outcome.log_text[-4000:]}"
    history = rows(run_dir)
    assert [r["round"] for r in history] == [0, 1, 2] and history[2]["clients"] == NUM_NODES
    saved = np.load(run_dir / "updates" / "round-2.npz")
    keys = [k[len("new/") :] for k in saved.files if k.startswith("new/") and k.endswith(".A")]
    assert keys
    ranks = [(2, 4)[int(p) % 2] for p in saved["partitions"]]
    assert sorted(ranks) == [2, 2, 4]
    for key in keys:
        clients = [saved[f"client{i}/{key}"].astype(np.float64) for i in range(NUM_NODES)]
        assert [c.shape[0] for c in clients] == ranks, key  # each adapter at its own rank
        new = saved[f"new/{key}"]
        assert new.shape[0] == 4
        # 'truncate': the global A is the best rank-4 factor of Q = sum_n w_n A_n^T A_n
        # (Eckart-Young; the step itself is held to the reference in test_client_ranks.py)
        gram = sum(w * c.T @ c for w, c in zip(saved["weights"], clients, strict=True))
        lam = np.linalg.eigvalsh(gram)[::-1]
        tail = float(np.sqrt(np.sum(lam[4:] ** 2)))
        err = float(np.linalg.norm(new.T @ new - gram))
        assert abs(err - tail) <= 1e-9 * float(np.linalg.norm(gram)), key
    row = history[2]
    assert (
        row["up-params-r2"] < row["up-params-r4"] and row["down-params-r2"] < row["down-params-r4"]
    )
    assert row["up-params"] == 2 * row["up-params-r2"] + row["up-params-r4"]
    assert row["clients_r2"] == 2 and row["clients_r4"] == 1


# One faulty partition, a fault a round (fault-kind's comma list, flower_app/client/faults.py):
# round t's kind, and what the server's row must count for it (docs/faults.md).
FAULT_ROUNDS = {
    1: ("raise", {"failures": 1}),
    2: ("nan", {"rejected": 1}),
    3: ("shape", {"rejected": 1}),
    4: ("scale", {"screened": 1}),  # its A x 10^9
    5: ("claim", {"clipped": 1}),  # 10^9 examples claimed
}


def test_bad_clients_are_dropped_screened_or_clipped_and_the_rounds_go_on(
    tiny_superlink, tiny_assets
):
    """Partition 1 misbehaves in every round, differently each time: it raises (an error
    reply, counted in failures), sends NaN or a wrong shape (rejected), A x 10^9 (screened
    out) and claims 10^9 examples (its weight clipped to 10 x the median, 800): each round
    goes on with the others, and only the claim's update is aggregated."""
    kinds = ",".join(kind for kind, _ in FAULT_ROUNDS.values())
    outcome, run_dir = run(
        tiny_superlink,
        tiny_assets,
        "faults",
        **{"fault-partition": 1, "fault-kind": kinds, "fault-scale": 1e9,
           "num-server-rounds": len(FAULT_ROUNDS), "aggregation-weights": "num-examples"},
    )  # fmt: skip
    assert outcome.ok, f"{outcome.message}\n{outcome.log_text[-4000:]}"
    history = rows(run_dir)
    assert [r["round"] for r in history] == [0, *FAULT_ROUNDS]
    for t, (kind, counts) in FAULT_ROUNDS.items():
        row = history[t]
        for key in ("failures", "rejected", "screened", "clipped"):
            assert row[key] == counts.get(key, 0), (kind, key, row[key])
        dropped = kind != "claim"
        assert row["clients"] == NUM_NODES - dropped, kind
        partitions = np.load(run_dir / "updates" / f"round-{t}.npz")["partitions"].tolist()
        assert (1 in partitions) != dropped, kind
    assert outcome.log_text.count("rejected update from partition 1") == 2  # nan, shape
    assert "screened out update from partition 1" in outcome.log_text
    assert "claims 1e+09 examples, clipped to 800" in outcome.log_text  # 10 x 80 examples
    weights = np.load(run_dir / "updates" / f"round-{len(FAULT_ROUNDS)}.npz")["weights"]
    assert weights.max() == pytest.approx(800 / 960)


def test_bad_config_fails_the_run_naming_the_key(tiny_superlink, tiny_assets):
    outcome, run_dir = run(tiny_superlink, tiny_assets, "bad-config", **{"dirichlet-alpha": -1.0})
    assert not outcome.ok
    assert "dirichlet-alpha" in outcome.log_text + (outcome.status_details or "")
    assert not (run_dir / "metrics.jsonl").exists()


def test_launcher_refuses_bad_config_before_launching(tmp_path, capsys):
    from florg_tools.launch import EXIT_USAGE, main

    common = ["--app", str(ROOT), "--flwr-home", str(tmp_path / "home"), "--quiet"]
    assert main([*common, "--set", "method=fedavg"]) == EXIT_USAGE
    assert "method" in capsys.readouterr().err
    assert main([*common, "--set", "fraction-train=0"]) == EXIT_USAGE
    assert "fraction-train" in capsys.readouterr().err
    assert main([*common, "--preset", "paper", "--set", "no-such-key=1"]) == EXIT_USAGE
    assert "no-such-key" in capsys.readouterr().err


# ---------------------------------------------------------------- resumption (issue 15)


# Through the simulation, the methods whose resumption carries state beyond the strategy's
# own: FedSA-LoRA's per-node B, read back from the nodes' disks, and Fed-SB's round 0 (its B
# and A come from the checkpoint, round 0 is not run again, and every node is sent them
# again). Every other server's state is restored exactly and continued in a unit test
# (tests/runtime/test_checkpoint.py: FLoRG, FedEx-LoRA, FedIT, FLoRA, Fed-SB, RoLoRA, FedSVD); a
# folding method's resumed node, which is sent the base and the last round's folds, in
# tests/runtime/test_fold_base.py. FLoRG's end-to-end resumption runs in
# tests/deployment/test_deploy_faults.py
# (ServerApp killed, SuperLink restarted; final adapter equal to the clean run's), a DP run's
# below. Each resumed method here costs CI two runs (about 70 s), hence the two.
@pytest.mark.parametrize("method", ["fedsa-lora", "fed-sb"])
def test_a_server_that_dies_after_round_1_resumes_to_the_clean_result(
    tiny_superlink, tiny_assets, clean_run, method
):
    clean, clean_dir = clean_run(method)
    assert clean.ok, f"{clean.message}\n{clean.log_text[-3000:]}"
    crashed, crash_dir = run(
        tiny_superlink, tiny_assets, f"crash-{method}", method=method, **{"fault-server-round": 1}
    )
    assert not crashed.ok and "fault-server-round" in crashed.log_text
    assert [r["round"] for r in rows(crash_dir)] == [0, 1]
    assert (crash_dir / "checkpoint" / "round-000001" / "state.json").is_file()
    assert not (crash_dir / "adapter.safetensors").exists()
    before = rows(crash_dir)

    resumed = resume(tiny_superlink, crash_dir)
    assert "resuming" in resumed.log_text and "after round 1" in resumed.log_text
    history = rows(crash_dir)
    assert [r["round"] for r in history] == [0, 1, 2]  # none twice, none skipped
    assert history[:2] == before  # the rows of the first process are kept as they were
    reference = rows(clean_dir)
    for ours, theirs in zip(history, reference, strict=True):
        assert ours["accuracy"] == pytest.approx(theirs["accuracy"], abs=1e-9), ours["round"]
        assert ours["loss"] == pytest.approx(theirs["loss"], rel=1e-5), ours["round"]
        assert ours["up-params"] == theirs["up-params"]
        if method == "fedsa-lora" and ours["round"] > 0:  # the nodes' B came back from disk
            assert ours["personalized-loss"] == pytest.approx(theirs["personalized-loss"], rel=1e-5)
    assert history[-1]["cum-up-params"] == reference[-1]["cum-up-params"]
    final = load_file(str(crash_dir / "adapter.safetensors"))
    expected = load_file(str(clean_dir / "adapter.safetensors"))
    assert final.keys() == expected.keys()
    for key, value in expected.items():
        np.testing.assert_allclose(final[key], value, rtol=1e-5, atol=1e-7, err_msg=key)
    summary = json.loads((crash_dir / "summary.json").read_text())
    assert (
        summary["resumed-after-round"] == 1 and summary["final-accuracy"] == history[-1]["accuracy"]
    )


def test_a_dp_run_resumed_after_round_1_continues_the_privacy_count(tiny_superlink, tiny_assets):
    """FedIT with dp=central (its mechanism's run through the simulation, see DP_RESUMED):
    the accountant's ledger is in the checkpoint, so the resumed run's epsilon after round 2
    is that of 2 rounds, not of 1 (issue 29)."""
    cheap = {"save-client-updates": False, "max-test-examples": 0, "client-eval": "off"}
    crashed, crash_dir = run(
        tiny_superlink, tiny_assets, f"dp-{DP_RESUMED}-resumed", method=DP_RESUMED,
        **DP, **cheap, **{"fault-server-round": 1},
    )  # fmt: skip
    assert not crashed.ok and "fault-server-round" in crashed.log_text
    state = json.loads((crash_dir / "checkpoint" / "round-000001" / "state.json").read_text())
    assert state["strategy"]["dp"] == {"delta": 1e-5, "compositions": [[1.0, 1.0, 1]]}

    resumed = resume(tiny_superlink, crash_dir)
    check_dp_run(crash_dir, resumed.log_text, delta=1e-5)
    summary = json.loads((crash_dir / "summary.json").read_text())
    assert summary["resumed-after-round"] == 1


def resume(tiny_superlink, run_dir: Path) -> RunOutcome:
    """Resume the run in ``run_dir`` with the launcher's settings; it must complete."""
    home, connection = tiny_superlink
    outcome = run_flower_app(
        ROOT, connection, resume_run_config(run_dir), home, timeout=600, stream=None
    )
    assert outcome.ok, f"{outcome.message}\n{outcome.log_text[-3000:]}"
    return outcome


@pytest.mark.parametrize(
    ("method", "up", "down"), [("florg", "int8", "int8"), ("fedit", "int8", "bf16")]
)
def test_encoded_messages_cut_the_bytes_and_the_run_still_learns(
    tiny_superlink, tiny_assets, clean_run, method, up, down
):
    """uplink-encoding / downlink-encoding through the simulation: the clients decode what
    the server sent, the server decodes the replies before its checks and rule, and the
    bytes that travelled fall to what the encodings promise, against the fp32 run."""
    outcome, run_dir = run(
        tiny_superlink, tiny_assets, f"encoded-{method}", method=method,
        **{"uplink-encoding": up, "downlink-encoding": down},
    )  # fmt: skip
    assert outcome.ok, f"{outcome.message}\n{outcome.log_text[-4000:]}"
    encoded, plain = rows(run_dir), rows(clean_run(method)[1])
    for mine, fp32 in zip(encoded[1:], plain[1:], strict=True):
        assert mine["clients"] == NUM_NODES and mine["rejected"] == 0, outcome.log_text[-3000:]
        # the same parameters travel, encoded: bf16 in half the payload; int8 in a quarter
        # plus a scale a row (at the tiny model's sizes the framing of the scales' arrays
        # outweighs the saving; tests/runtime/test_encoding.py measures it at real sizes);
        # an array met twice in a message travels once, whatever its encoding
        assert (mine["up-params"], mine["down-params"]) == (fp32["up-params"], fp32["down-params"])
        for direction, encoding in (("uplink", up), ("downlink", down)):
            assert mine[f"{direction}-bytes"] != fp32[f"{direction}-bytes"], direction
            if encoding == "bf16":
                saved = fp32[f"{direction}-bytes"] - mine[f"{direction}-bytes"]
                params = mine["up-params" if direction == "uplink" else "down-params"]
                if direction == "downlink" and mine["round"] == 1:
                    # round 1 sends LoRA's initial B = 0 of every layer: identical arrays,
                    # each sent once (flower_app/wire/deployment_bytes.py), so it saves less
                    assert 0 < saved < 2 * params, direction
                else:
                    assert saved == pytest.approx(2 * params, rel=0.05), direction
    assert np.isfinite(encoded[-1]["loss"])
    # a rounding, not a different run: the encoded run's model stays near the fp32 run's
    assert abs(encoded[-1]["accuracy"] - plain[-1]["accuracy"]) <= 0.25
    assert json.loads((run_dir / "config.json").read_text())["uplink-encoding"] == up
