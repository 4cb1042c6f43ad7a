"""The ServerApp: build the method's strategy, run the rounds, evaluate, write the run folder.

After every round it checkpoints everything needed to continue
(flower_app/run_output/checkpoint.py);
with ``resume=<run folder>`` it continues from the last complete round.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Context, MetricRecord
from flwr.common.logger import log as flwr_log
from flwr.serverapp import Grid, ServerApp

import strategies.registry  # noqa: F401  (every method registers with the core's registry)
from flower_app.cache.per_process import cached_adapted_model
from flower_app.modeling import pick_device, resolve_model_source
from flower_app.preflight.references import check_names
from flower_app.run_output.checkpoint import (
    check_resumable,
    load_checkpoint,
    new_lineage,
    random_state_json,
    restore_random_state,
    save_checkpoint,
)
from flower_app.run_output.console import install_console
from flower_app.run_output.recorder import INFO, RunRecorder, make_run_dir
from flower_app.run_output.submission import write_submission
from flower_app.settings.client_ranks import server_model_config
from flower_app.settings.config import ConfigError, RunConfig, resolve_config
from flower_app.task_data import load_task_data, load_test_data
from flower_app.task_eval import evaluate_task
from flower_app.wire.records import from_array_record, to_array_record
from strategies.server.strategy import AdapterStrategy

app = ServerApp()


class GlobalEvaluator:
    """``evaluate_fn`` for Strategy.start: load the global arrays, evaluate, record the row.

    Classification rows hold ``accuracy``; extractive-QA rows ``exact-match`` and ``f1``;
    every row ``loss`` and ``score`` (the headline metric in [0, 1], see RunRecorder)."""

    def __init__(
        self,
        config: RunConfig,
        strategy: AdapterStrategy,
        recorder: RunRecorder,
        run_dir: Path | None = None,
        lineage: str = "",
    ):
        """With ``run_dir``, every evaluated round is also checkpointed there."""
        data = load_task_data(config)
        self.config = config
        self.strategy = strategy
        self.recorder = recorder
        self.run_dir = run_dir
        self.lineage = lineage
        # at the run's largest rank (flower_app/settings/client_ranks.py;
        # strategies/florg/strategy.py)
        model_config = server_model_config(config)
        self.adapted = cached_adapted_model(model_config, data.num_labels, data.spec.kind)
        self.device = pick_device(config.device)

    def load(self, arrays: ArrayRecord) -> None:
        self.adapted.load_shared_state(from_array_record(arrays))
        self.adapted.load_local_state(None)  # personal parts: the global model holds them at zero
        self.adapted.method.receive_on_server(self.adapted, self.strategy)  # the method's hook

    def __call__(self, server_round: int, arrays: ArrayRecord) -> MetricRecord:
        self.load(arrays)
        metrics: dict[str, float] = {}
        if self.config.validates_round(server_round):  # what tuning and the curves read
            t0 = time.perf_counter()
            metrics = evaluate_task(self.config, self.adapted.model, self.device)
            metrics["eval-seconds"] = time.perf_counter() - t0
        if self.config.tests_round(server_round):  # the held-out test split: reported scores
            t0 = time.perf_counter()
            test = evaluate_task(self.config, self.adapted.model, self.device, split="test")
            metrics |= {f"test-{key}": value for key, value in test.items()}
            metrics["test-seconds"] = time.perf_counter() - t0
        self.adapted.model.to("cpu")
        self.recorder.record(
            server_round, metrics, self.strategy.round_metrics.get(server_round, {})
        )
        self.checkpoint(server_round, arrays)
        if server_round == self.config.fault_server_round > 0:
            raise RuntimeError(
                f"fault injected (run config 'fault-server-round'): the ServerApp dies after "
                f"checkpointing round {server_round}"
            )
        return MetricRecord(metrics)

    def checkpoint(self, server_round: int, arrays: ArrayRecord) -> None:
        if self.run_dir is None:
            return
        save_checkpoint(
            self.run_dir,
            server_round,
            from_array_record(arrays),
            self.strategy.state_arrays(),
            {
                "config": self.config.as_dict(),
                "strategy": self.strategy.state_json(),
                "random": random_state_json(),
                "recorder": self.recorder.state(),
                "lineage": self.lineage,
            },
        )


def save_final(config: RunConfig, evaluator: GlobalEvaluator, arrays: ArrayRecord, run_dir) -> dict:
    """The final global adapter (safetensors) and, for FLoRG, its PEFT LoRA export; for a
    method that folds updates into W0, the merged model (``AdaptedModel.save_merged``)."""
    from safetensors.numpy import save_file

    state = from_array_record(arrays)
    save_file(
        {k: np.ascontiguousarray(v) for k, v in state.items()}, str(run_dir / "adapter.safetensors")
    )
    outputs = {"adapter": "adapter.safetensors"}
    evaluator.load(arrays)
    if evaluator.adapted.export_peft(run_dir / "peft_lora", resolve_model_source(config.model)):
        outputs["peft-lora"] = "peft_lora"
    if evaluator.adapted.method.writes_base_weights:  # its folds live in W0: the whole model
        evaluator.adapted.save_merged(run_dir / "merged_model")
        outputs["merged-model"] = "merged_model"
    return outputs


@app.main()
def main(grid: Grid, context: Context) -> None:
    config = resolve_config(context.run_config)  # unknown keys / bad values fail here
    install_console(config.log_level)  # Flower's per-round record dumps at DEBUG
    check_names(config)  # a task, model, data or module that does not exist: no run folder
    run_dir = make_run_dir(config)  # inside the operator's output root (flower_app/paths.py)
    checkpoint = None
    if config.resume:
        checkpoint = load_checkpoint(run_dir)
        if checkpoint is None:
            raise ConfigError(f"resume: no complete checkpoint in {run_dir / 'checkpoint'}")
        check_resumable(config, checkpoint)
        flwr_log(
            INFO,
            "[florg] resuming %s after round %d (checkpoint %s)",
            run_dir,
            checkpoint.round,
            checkpoint.path.name,
        )
    flwr_log(INFO, "[florg] run folder: %s", run_dir)
    data = load_task_data(config)
    if config.max_test_examples > 0:
        load_test_data(config)  # a task without a test split fails here, before training
    # rank > k etc.; at the largest client rank (flower_app/settings/client_ranks.py)
    adapted = cached_adapted_model(server_model_config(config), data.num_labels, data.spec.kind)
    initial_state = adapted.shared_state()
    strategy = adapted.method.build_strategy(
        config, initial_state, fingerprint=adapted.fingerprint(), run_dir=run_dir
    )
    # a strategy that reads the server's model before the run (a secure round 0's shapes)
    if (observe_model := getattr(strategy, "observe_server_model", None)) is not None:
        observe_model(adapted)
    lineage = checkpoint.lineage if checkpoint else new_lineage()
    start_arrays = to_array_record(checkpoint.arrays if checkpoint else initial_state)
    if checkpoint:
        strategy.restore(checkpoint.strategy_arrays, checkpoint.state["strategy"])
        restore_random_state(checkpoint.state["random"])  # Flower samples nodes with it
    recorder = RunRecorder(
        run_dir,
        config,
        kind=data.kind,
        resumed=checkpoint.state["recorder"] if checkpoint else None,
    )
    evaluator = GlobalEvaluator(config, strategy, recorder, run_dir=run_dir, lineage=lineage)
    t0 = time.perf_counter()
    result = strategy.start(
        grid=grid,
        initial_arrays=start_arrays,
        num_rounds=config.num_server_rounds,
        train_config=ConfigRecord({"method": config.method, "lineage": lineage}),
        evaluate_config=ConfigRecord({"lineage": lineage}),
        evaluate_fn=evaluator,
        first_round=checkpoint.round + 1 if checkpoint else 1,
    )
    outputs = save_final(config, evaluator, result.arrays or start_arrays, run_dir)
    submission = write_submission(
        run_dir, config, evaluator.adapted, resolve_model_source(config.model), recorder.rows
    )  # a FlowerTune leaderboard run's folder (flower_app/run_output/submission.py)
    if submission is not None:
        outputs["submission"] = submission.name
        flwr_log(INFO, "[%s] FlowerTune submission: %s", config.method, submission)
    summary = recorder.write_summary(
        {
            "outputs": outputs,
            "strategy-seconds": time.perf_counter() - t0,
            "resumed-after-round": checkpoint.round if checkpoint else None,
        }
    )
    flwr_log(
        INFO,
        "[%s] final %s %.4f; summary: %s",
        config.method,
        data.score_metric,
        _or_nan(summary.get(f"final-{data.score_metric}")),  # none: instructions, no generation
        json.dumps({k: summary[k] for k in ("total-params", "wall-seconds")}),
    )


def _or_nan(value: float | None) -> float:
    """A score for the console, NaN when there is none (0.0 stays 0.0)."""
    return float("nan") if value is None else float(value)
