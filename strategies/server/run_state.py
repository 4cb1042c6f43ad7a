"""The common strategy's state for checkpoints, and Flower's round loop resumed from one.

``state_arrays`` / ``state_json`` carry what a run needs to continue
(flower_app/run_output/checkpoint.py writes them each round) and ``restore`` reads them back.
``resume_rounds`` is the one place the strategy's loop differs from Flower's: Flower 1.42's
``Strategy.start`` always begins at round 1 (with the round-0 evaluation), so a resumed run
runs each round exactly as Flower's loop does, from ``first_round`` and the checkpoint's
arrays, without the round-0 evaluation.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord
from flwr.common.logger import log as flwr_log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result

INFO = logging.INFO


def state_arrays(strategy: Any) -> dict[str, np.ndarray]:
    """Arrays needed to continue: the float64 global state (the previous state of the
    next FLoRG Procrustes step, eq. opt_problem, is this one, not its float32 copy)."""
    return {f"global/{k}": v for k, v in strategy.global_state.items()}


def state_json(strategy: Any) -> dict[str, Any]:
    """JSON state needed to continue: the node -> partition map learnt so far, the
    nodes' ranks, the privacy ledgers (dp=central, dp=example), under round-mode=async or
    sync-overselect what was in flight and, under virtual-clock, the clock."""
    state: dict[str, Any] = {
        "method": strategy.method.name,
        "partitions": {str(k): v for k, v in strategy.ledger.partitions.items()},
    }
    if strategy.router.node_ranks:
        state["node-ranks"] = strategy.router.state_json()
    if strategy.dp is not None:
        state["dp"] = strategy.dp.state_dict()
    if strategy.example_dp is not None:
        state["example-dp"] = strategy.example_dp.state_json()
    if strategy.round_loop is not None:  # the mode's loop: what was in flight
        state["async"] = strategy.round_loop.state_json()
    if getattr(strategy, "clock", None) is not None:  # virtual-clock: now, busy-until
        state["virtual-clock"] = strategy.clock.state_json()
    return state


def restore(strategy: Any, arrays: Mapping[str, np.ndarray], state: Mapping[str, Any]) -> None:
    """``strategy`` continued from ``state_arrays`` / ``state_json`` of a checkpoint."""
    if state.get("method") != strategy.method.name:
        raise ValueError(
            f"checkpoint of a {state.get('method')} strategy, not {strategy.method.name}"
        )
    saved = {k[len("global/") :]: v for k, v in arrays.items() if k.startswith("global/")}
    if set(saved) != set(strategy.global_state) or any(
        saved[k].shape != strategy.global_state[k].shape for k in saved
    ):
        raise ValueError("checkpoint arrays do not match this model's adapter")
    strategy.global_state = {k: np.asarray(v, np.float64) for k, v in saved.items()}
    strategy.ledger.partitions = {int(k): int(v) for k, v in state.get("partitions", {}).items()}
    strategy.router.load_state_json(state.get("node-ranks", {}))
    if (strategy.dp is None) != ("dp" not in state):
        raise ValueError("checkpoint and run differ in dp (off / central)")
    if strategy.dp is not None:
        strategy.dp.load_state_dict(state["dp"])
    if (strategy.example_dp is None) != ("example-dp" not in state):
        raise ValueError("checkpoint and run differ in dp (example or not)")
    if strategy.example_dp is not None:
        strategy.example_dp.load_state_json(state["example-dp"])
    if strategy.round_loop is not None:
        strategy.round_loop.load_state_json(state.get("async", {}))
    if getattr(strategy, "clock", None) is not None:
        strategy.clock.load_state_json(state.get("virtual-clock", {}))


def resume_rounds(
    strategy: Any,
    grid: Grid,
    initial_arrays: ArrayRecord,
    num_rounds: int,
    timeout: float,
    train_config: ConfigRecord | None,
    evaluate_config: ConfigRecord | None,
    evaluate_fn: Any,
    first_round: int,
) -> Result:
    """Rounds ``first_round`` .. ``num_rounds`` of ``strategy`` (a Flower strategy) from
    ``initial_arrays``, as ``Strategy.start`` runs each round."""
    train_config = ConfigRecord() if train_config is None else train_config
    evaluate_config = ConfigRecord() if evaluate_config is None else evaluate_config
    result = Result()
    arrays = initial_arrays
    flwr_log(
        INFO, "Resuming %s at round %d of %d", type(strategy).__name__, first_round, num_rounds
    )
    for current_round in range(first_round, num_rounds + 1):
        flwr_log(INFO, "[ROUND %s/%s]", current_round, num_rounds)
        replies = grid.send_and_receive(
            messages=strategy.configure_train(current_round, arrays, train_config, grid),
            timeout=timeout,
        )
        agg_arrays, agg_metrics = strategy.aggregate_train(current_round, replies)
        if agg_arrays is not None:
            result.arrays = agg_arrays
            arrays = agg_arrays
        if agg_metrics is not None:
            result.train_metrics_clientapp[current_round] = agg_metrics
        replies = grid.send_and_receive(
            messages=strategy.configure_evaluate(current_round, arrays, evaluate_config, grid),
            timeout=timeout,
        )
        evaluated = strategy.aggregate_evaluate(current_round, replies)
        if evaluated is not None:
            result.evaluate_metrics_clientapp[current_round] = evaluated
        if evaluate_fn:
            res = evaluate_fn(current_round, arrays)
            if res is not None:
                result.evaluate_metrics_serverapp[current_round] = res
    return result
