"""Synchronous rounds under secure aggregation (``secure-aggregation=secaggplus``).

Each round sends the strategy's training messages (``configure_train``: sampling, ranks,
encodings, ledgers) inside SecAgg+'s collect stage (``secure_sum``): a client trains, adds what
its method sums (``Method.secure_contribution``) times its weight, masks it and sends it with
its metrics; the server learns the survivors' sum and applies the method's rule to their mean
(``Method.aggregate_secure``; under dp=central the clients clip and the server noises the sum:
``aggregate_secure_private``). No reply's arrays are ever read, so the per-reply checks and the
screening do not run (the client refuses a non-finite or out-of-range contribution, the server
checks each masked vector's names and shapes); their clear metrics are read (the row, a
folding strategy's ``observe_replies``). A round whose sum fails (too few survivors for the
threshold) leaves the model unchanged, counted (``secure-failed``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.common.logger import log as flwr_log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result

from flower_app.secure.settings import SecAggPlusSettings
from flower_app.wire.records import to_array_record
from strategies.server.ledger import traffic_metrics
from strategies.server.replies import train_time_metrics
from strategies.server.secure_outcome import SecureSumFailed, SecureSumTraffic
from strategies.server.secure_sum import secure_sum

log = logging.getLogger("flwr.florg")
MODE = "secure-aggregation=secaggplus"
# A masked value travels as an int64 (Flower's ndarray_to_bytes of the mod-M vector).
MASKED_BYTES_PER_VALUE = 8
# The aggregate_train overrides a secure round may stand in for (by name: the common strategy
# imports this module): the common strategy's, and those whose only reading of the replies is
# each one's clear metrics (the folding strategy's 'residual-round', the fixed-basis strategy's
# 'basis-held': ``observe_replies``), which the secure loop hands them from the collect stage.
# Any other override would be skipped with effect, so it is refused.
SECURE_AGGREGATE_TRAIN = (
    "AdapterStrategy.aggregate_train",
    "FoldingStrategy.aggregate_train",
    "FedSBStrategy.aggregate_train",
)


@dataclass(frozen=True)
class SecureRoundSettings:
    """SecAgg+'s settings and the largest contribution a client may send, in bytes."""

    secaggplus: SecAggPlusSettings
    uplink_limit_bytes: int
    # every reply is from the round's model: the strategy's synchronous step
    server_lr: ClassVar[float] = 1.0
    staleness_exponent: ClassVar[float] = 0.0


def contribution_bytes(shapes: Mapping[str, tuple[int, ...]]) -> int:
    """The bytes of one masked contribution of ``shapes`` (the weight entry included)."""
    return MASKED_BYTES_PER_VALUE * (1 + sum(int(np.prod(s)) for s in shapes.values()))


class SecureRounds:
    """The secure loop, held by the common strategy as ``round_loop`` (as the other modes'
    loops are). Refused for a strategy whose ``aggregate_train`` is its own (but those of
    ``SECURE_AGGREGATE_TRAIN``), and for a contribution above the uplink limit
    (``secure-uplink-limit-mb``), before any round."""

    def __init__(self, strategy: Any, settings: SecureRoundSettings) -> None:
        if type(strategy).aggregate_train.__qualname__ not in SECURE_AGGREGATE_TRAIN:
            raise ValueError(
                f"{MODE}: {type(strategy).__name__} reads each round's replies in an "
                "aggregate_train of its own, which secure aggregation never hands it"
            )
        self.strategy = strategy
        self.settings = settings
        shapes = strategy.method.secure_shapes(strategy.uplink_state(1))
        size = contribution_bytes(shapes)
        if size > settings.uplink_limit_bytes:
            raise ValueError(
                f"secure-uplink-limit-mb: method {strategy.method.name!r} would send "
                f"{size / 2**20:.1f} MB a client and round under secure aggregation, above "
                f"the limit of {settings.uplink_limit_bytes / 2**20:.1f} MB"
            )
        strategy.gate.screen_updates = False  # no single reply to screen
        log.info("%s: screening is off (the server sees only the sum)", MODE)

    def start(
        self,
        grid: Grid,
        initial_arrays: ArrayRecord,
        num_rounds: int,
        timeout: float,
        train_config: ConfigRecord,
        evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None,
        first_round: int,
    ) -> Result:
        """Run rounds ``first_round`` .. ``num_rounds`` (module docstring); the clients
        evaluate after each where the strategy asks them to (``fraction_evaluate``)."""
        result, arrays = Result(), initial_arrays
        first = evaluate_fn(0, arrays) if first_round <= 1 and evaluate_fn else None
        if first is not None:
            result.evaluate_metrics_serverapp[0] = first
        for server_round in range(first_round, num_rounds + 1):
            flwr_log(logging.INFO, "[ROUND %s/%s]", server_round, num_rounds)
            new_arrays, metrics = self.round(grid, server_round, arrays, train_config, timeout)
            if new_arrays is not None:
                arrays = result.arrays = new_arrays
            result.train_metrics_clientapp[server_round] = metrics
            if self.strategy.fraction_evaluate > 0:
                messages = self.strategy.configure_evaluate(
                    server_round, arrays, ConfigRecord(dict(train_config)), grid
                )
                replies = grid.send_and_receive(messages, timeout=timeout)
                if (res := self.strategy.aggregate_evaluate(server_round, replies)) is not None:
                    result.evaluate_metrics_clientapp[server_round] = res
            res = evaluate_fn(server_round, arrays) if evaluate_fn is not None else None
            if res is not None:
                result.evaluate_metrics_serverapp[server_round] = res
        return result

    def round(
        self,
        grid: Grid,
        server_round: int,
        arrays: ArrayRecord,
        train_config: ConfigRecord,
        timeout: float,
    ) -> tuple[ArrayRecord | None, MetricRecord]:
        """One round: the training messages in the collect stage, the sum, the rule."""
        strategy = self.strategy
        config = ConfigRecord(dict(train_config))
        messages: list[Message] = list(strategy.configure_train(server_round, arrays, config, grid))
        shapes = strategy.method.secure_shapes(strategy.uplink_state(server_round))
        traffic = SecureSumTraffic()
        settings = self.settings.secaggplus
        if settings.timeout is None:
            settings = replace(settings, timeout=timeout)
        try:
            summed = secure_sum(
                grid,
                [int(m.metadata.dst_node_id) for m in messages],
                shapes,
                settings,
                collect_content={int(m.metadata.dst_node_id): m.content for m in messages},
                traffic=traffic,
            )
        except SecureSumFailed as err:
            self._observe(traffic)  # the nodes that trained folded, whether or not it failed
            log.warning("round %d: secure sum failed, the model is unchanged: %s",
                        server_round, err.reason)  # fmt: skip
            metrics = self._metrics(server_round, traffic, survivors=0, failed=1)
            strategy.round_metrics[server_round] = metrics
            return None, MetricRecord(metrics)
        self._observe(traffic)
        report = summed.report
        t0 = time.perf_counter()
        if strategy.dp is None:
            new_state, info = strategy.method.aggregate_secure(
                strategy, server_round, summed.weighted_mean(), len(report.survivors)
            )
        else:  # dp=central: the clients clipped, the server noises the unmasked sum
            new_state, info = strategy.method.aggregate_secure_private(
                strategy, server_round, summed.weighted_sums, len(report.survivors)
            )
            strategy.dp.clipped = sum(
                int(m.content["metrics"].get("dp-clipped", 0))
                for m in traffic.collected.values()
                if not m.has_error() and "metrics" in m.content
            )  # as the clients report it (an unnoised count, docs/privacy.md)
            info = {**info, **strategy.dp.release()}
            # rounding onto the grid moves a contribution by up to 2c/Q per value: the
            # sensitivity the accountant uses (Δ) is exceeded by at most this share of it
            step = 2 * settings.clipping_range / settings.quantization_range
            values = sum(int(np.prod(shape)) for shape in shapes.values())
            sensitivity = info.get("dp-sensitivity", strategy.dp.clipping_norm)
            info["dp-quantisation-slack"] = step * float(np.sqrt(values)) / sensitivity
        metrics = self._metrics(server_round, traffic, survivors=len(report.survivors), failed=0)
        metrics["agg-seconds"] = time.perf_counter() - t0
        metrics["secure-dropped-after-keys"] = len(report.dropped_after_keys)
        metrics["secure-dropped-before-keys"] = len(report.dropped_before)
        metrics["up-params"] = len(report.survivors) * sum(int(np.prod(s)) for s in shapes.values())
        metrics.update(info)
        strategy.global_state = new_state
        strategy.round_metrics[server_round] = metrics
        return to_array_record(new_state), MetricRecord(metrics)

    def _observe(self, traffic: SecureSumTraffic) -> None:
        """Hand the strategy the collect stage's replies (their clear metrics, no arrays),
        where it reads them (``observe_replies``: a folding strategy's node_synced)."""
        observe = getattr(self.strategy, "observe_replies", None)
        if observe is not None:
            observe(list(traffic.collected.values()))

    def _metrics(
        self, server_round: int, traffic: SecureSumTraffic, *, survivors: int, failed: int
    ) -> dict[str, Any]:
        """The row of a secure round: who took part (the collect stage's replies carry the
        clients' metrics, as a training reply does), its traffic over the four stages, the
        clients' train loss weighted by their examples."""
        strategy = self.strategy
        replies = list(traffic.collected.values())
        nodes = strategy.ledger.settle(server_round, replies)
        trained = [m for m in replies if not m.has_error() and "metrics" in m.content]
        sizes = np.array([float(m.content["metrics"].get("num-examples", 0)) for m in trained])
        losses = np.array([float(m.content["metrics"].get("train-loss", np.nan)) for m in trained])
        metrics: dict[str, Any] = {
            "clients": survivors,
            "failures": sum(m.has_error() for m in replies),
            "rejected": 0,
            "secure-failed": failed,
            "down-params": strategy.communication.down(server_round),
            **nodes.metrics(),
            **train_time_metrics(replies),
            **traffic_metrics(list(traffic.down_bytes.values()), list(traffic.up_bytes.values())),
            **strategy.sampling.metrics(server_round),
        }
        if strategy.example_dp is not None:
            metrics.update(strategy.example_dp.observe(server_round, replies))
        known = np.isfinite(losses) & (sizes > 0)
        if known.any():
            metrics["train-loss"] = float(np.dot(sizes[known] / sizes[known].sum(), losses[known]))
        metrics["examples"] = float(sizes.sum())
        return metrics

    # -- checkpoints: nothing of its own in flight between rounds ------------------------
    def state_json(self) -> dict[str, Any]:
        return {}

    def load_state_json(self, state: dict[str, Any]) -> None:
        """Nothing to restore: every round starts and ends its own secure sum."""
