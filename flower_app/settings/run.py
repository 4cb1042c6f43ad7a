"""Settings: the run folder, resuming, the console and the product-gap diagnostic; the FlowerTune
LLM leaderboard track a run is entered in; the testing-only fault injection."""

from __future__ import annotations

from dataclasses import dataclass

from flower_app.settings import setting
from flower_app.settings.checks import (
    comma_list_of,
    folder_name_or_empty,
    non_negative,
    one_of,
    positive,
)


@dataclass(frozen=True)
class OutputSettings:
    """Settings: the run folder, resuming, the console and tracking; a server diagnostic."""

    output_dir: str = setting("outputs", "folder for run outputs", affects=())
    run_name: str = setting(
        "",
        "run folder name ('' = timestamp-method-task)",
        check=folder_name_or_empty,
        affects=(),
    )
    resume: str = setting("", "run folder to continue from its last checkpointed round", affects=())
    save_client_updates: bool = setting(
        False, "also save every round's client updates (.npz)", affects=()
    )
    # a server-side diagnostic only: no cached artefact depends on it (affects nothing)
    product_gap: bool = setting(
        False,
        "record product_rel_gap (mean over layers) and product_rel_gap_max each round: "
        "||sum w_n B_n A_n - B_new A_new||_F / ||sum w_n B_n A_n||_F per layer, for methods "
        "with adapter lora (others record none: FLoRG's gram_rel_error is its counterpart; "
        "refused with dp=central and secure aggregation; for a method that folds into W0 it "
        "measures the new factors, not the model); costly at 7B",
        affects=(),
    )
    progress_bar: bool = setting(False, "show a progress bar during local training", affects=())
    log_level: str = setting(
        "info",
        "debug: Flower's full records too",
        check=one_of("info", "debug"),
        affects=(),
    )
    tensorboard: str = setting(
        "auto", "<run>/tensorboard/ events", check=one_of("auto", "on", "off"), affects=()
    )
    app_commit: str = setting(
        "",
        "provenance, recorded in config.json: the git commit of the app's checkout, with "
        "'+modified' when its tree had changes (set by the florg tooling when it launches a "
        "run; '' when unknown, e.g. plain flwr run); changes nothing in the run",
        affects=(),
    )


@dataclass(frozen=True)
class LeaderboardSettings:
    """Settings: the FlowerTune LLM leaderboard track a run is entered in
    (flower_app/preflight/leaderboard.py, docs/flowertune.md)."""

    flowertune_track: str = setting(
        "",
        "FlowerTune LLM leaderboard track ('' = none): the run's communication is counted "
        "against the 200,000 MB budget every round and its submission folder written at the end",
        check=one_of("", "general-nlp", "finance", "medical", "code"),
        affects=(),
    )
    leaderboard: bool = setting(
        True,
        "with flowertune-track: refuse to launch a run that breaks the track's rules (static "
        "keys, SuperNodes, budget); false lifts the checks",
        affects=(),
    )


@dataclass(frozen=True)
class TestingSettings:
    """Settings for the tests only, never in a real run: fault injection
    (flower_app/client/faults.py)."""

    fault_partition: int = setting(
        -1, "testing: this partition id misbehaves (-1 = none)", affects=()
    )
    fault_kind: str = setting(
        "raise",
        "testing: how it misbehaves (scale: adapter x fault-scale; claim: fault-scale "
        "examples); a comma list: round t's is the t-th, cycled",
        check=comma_list_of("raise", "nan", "shape", "scale", "claim"),
        affects=(),
    )
    fault_scale: float = setting(
        10.0,
        "testing: factor of 'scale', count of 'claim'",
        check=positive,
        affects=(),
    )
    fault_server_round: int = setting(
        0, "testing: ServerApp dies after round N", check=non_negative, affects=()
    )
