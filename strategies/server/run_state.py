"""A run's strategy state for checkpoints, and Flower's round loop resumed from one.

``state_arrays`` / ``state_json`` carry everything a strategy needs to continue a run
(flower_app/run_output/checkpoint.py writes them each round); ``restore`` reads them back; ``start``
with ``first_round`` > 1 continues the loop there. A method whose strategy keeps more
(per-rank factors, residuals) extends these in its own folder.
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


class CheckpointedRounds:
    """Mixed into the common strategy (before Flower's FedAvg): its state for checkpoints
    and the resumable round loop. Reads the strategy's ``global_state``, ``method``,
    ``ledger`` (node -> partition), ``router`` (node ranks), ``dp``, ``example_dp`` and,
    in round-mode=async, the buffered loop (``buffered_rounds.py``)."""

    def state_arrays(self) -> dict[str, np.ndarray]:
        """Arrays needed to continue: the float64 global state (the previous state of the
        next FLoRG Procrustes step, eq. opt_problem, is this one, not its float32 copy)."""
        return {f"global/{k}": v for k, v in self.global_state.items()}

    def state_json(self) -> dict[str, Any]:
        """JSON state needed to continue: the node -> partition map learnt so far, the
        nodes' ranks; under dp=central the privacy ledger (``dp``), so a resumed run
        continues the count."""
        state: dict[str, Any] = {
            "method": self.method.name,
            "partitions": {str(k): v for k, v in self.ledger.partitions.items()},
        }
        if self.router.node_ranks:
            state["node-ranks"] = self.router.state_json()
        if self.dp is not None:
            state["dp"] = self.dp.state_dict()
        if self.example_dp is not None:  # dp=example: the clients' epsilons (example_dp.py)
            state["example-dp"] = self.example_dp.state_json()
        if self.async_settings is not None:  # round-mode=async: what was in flight
            state["async"] = self.async_state_json()
        return state

    def restore(self, arrays: Mapping[str, np.ndarray], state: Mapping[str, Any]) -> None:
        """Continue from ``state_arrays`` / ``state_json`` of a checkpoint."""
        if state.get("method") != self.method.name:
            raise ValueError(
                f"checkpoint of a {state.get('method')} strategy, not {self.method.name}"
            )
        saved = {k[len("global/") :]: v for k, v in arrays.items() if k.startswith("global/")}
        if set(saved) != set(self.global_state) or any(
            saved[k].shape != self.global_state[k].shape for k in saved
        ):
            raise ValueError("checkpoint arrays do not match this model's adapter")
        self.global_state = {k: np.asarray(v, np.float64) for k, v in saved.items()}
        self.ledger.partitions = {int(k): int(v) for k, v in state.get("partitions", {}).items()}
        self.router.load_state_json(state.get("node-ranks", {}))
        if (self.dp is None) != ("dp" not in state):
            raise ValueError("checkpoint and run differ in dp (off / central)")
        if self.dp is not None:
            self.dp.load_state_dict(state["dp"])
        if (self.example_dp is None) != ("example-dp" not in state):
            raise ValueError("checkpoint and run differ in dp (example or not)")
        if self.example_dp is not None:
            self.example_dp.load_state_json(state["example-dp"])
        if self.async_settings is not None:
            self.load_async_state_json(state.get("async", {}))

    def start(  # type: ignore[override]
        self,
        grid: Grid,
        initial_arrays: ArrayRecord,
        num_rounds: int = 3,
        timeout: float = 3600,
        train_config: ConfigRecord | None = None,
        evaluate_config: ConfigRecord | None = None,
        evaluate_fn: Any = None,
        first_round: int = 1,
    ) -> Result:
        """Flower's ``Strategy.start``; with ``first_round`` > 1 (a resumed run) the loop
        starts there from ``initial_arrays`` (the checkpoint's), without the round-0
        evaluation, and otherwise runs each round exactly as Flower's loop does."""
        if self.async_settings is not None:  # round-mode=async (buffered_rounds.py)
            return self.start_buffered(
                grid,
                initial_arrays,
                num_rounds,
                timeout,
                ConfigRecord() if train_config is None else train_config,
                evaluate_fn,
                max(first_round, 1),
            )
        if first_round <= 1:
            return super().start(
                grid=grid,
                initial_arrays=initial_arrays,
                num_rounds=num_rounds,
                timeout=timeout,
                train_config=train_config,
                evaluate_config=evaluate_config,
                evaluate_fn=evaluate_fn,
            )
        train_config = ConfigRecord() if train_config is None else train_config
        evaluate_config = ConfigRecord() if evaluate_config is None else evaluate_config
        result = Result()
        arrays = initial_arrays
        flwr_log(
            INFO, "Resuming %s at round %d of %d", type(self).__name__, first_round, num_rounds
        )
        for current_round in range(first_round, num_rounds + 1):
            flwr_log(INFO, "[ROUND %s/%s]", current_round, num_rounds)
            replies = grid.send_and_receive(
                messages=self.configure_train(current_round, arrays, train_config, grid),
                timeout=timeout,
            )
            agg_arrays, agg_metrics = self.aggregate_train(current_round, replies)
            if agg_arrays is not None:
                result.arrays = agg_arrays
                arrays = agg_arrays
            if agg_metrics is not None:
                result.train_metrics_clientapp[current_round] = agg_metrics
            replies = grid.send_and_receive(
                messages=self.configure_evaluate(current_round, arrays, evaluate_config, grid),
                timeout=timeout,
            )
            evaluated = self.aggregate_evaluate(current_round, replies)
            if evaluated is not None:
                result.evaluate_metrics_clientapp[current_round] = evaluated
            if evaluate_fn:
                res = evaluate_fn(current_round, arrays)
                if res is not None:
                    result.evaluate_metrics_serverapp[current_round] = res
        return result
