"""The server's record of the clients' example-level epsilon (``dp=example``).

Each client trains with DP-SGD and keeps its own accountant (flower_app/privacy/dp_sgd.py;
docs/privacy.md, section 9); its reply carries ``dp-sgd-epsilon``. ``ExampleDpRecord`` keeps
the latest per partition (checkpointed: ``state_json``) and writes into every round's row
``dp-sgd-epsilon-max``, ``dp-sgd-over-target`` (above ``dp-sgd-target-epsilon``, else
``dp-max-epsilon``) and ``dp-sgd-clients``. A value that goes down (a node that lost its
ledger) is added to the old one, an upper bound by basic composition, and logged.
``mechanism_metrics``: what the clients' DP-SGD did in a training round, over the successful
replies that carry it (flower_app/privacy/dp_sgd_mechanism.py): the mean
``dp-sgd-clipped-fraction``; medians over clients of ``dp-sgd-grad-norm-median``,
``dp-sgd-clipped-mean-norm``, ``dp-sgd-noise-std`` = z C / B and ``dp-sgd-noise-norm``.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections.abc import Iterable, Mapping
from typing import Any

from flwr.app import Message

log = logging.getLogger("flwr.florg")

EPSILON_KEY = "dp-sgd-epsilon"  # a reply's metric (flower_app/client/round.py)


class ExampleDpRecord:
    """Per partition: (epsilon of earlier, lost ledgers, the latest reported epsilon)."""

    def __init__(self, target: float = 0.0) -> None:
        self.target = float(target)
        self.partitions: dict[int, tuple[float, float]] = {}

    def epsilon(self, partition: int) -> float:
        offset, last = self.partitions.get(partition, (0.0, 0.0))
        return offset + last

    def observe(self, server_round: int, replies: Iterable[Message]) -> dict[str, float]:
        """Take the epsilons of this round's successful replies; the round's metrics."""
        for msg in replies:
            if msg.has_error() or "metrics" not in msg.content.metric_records:
                continue
            metrics = msg.content["metrics"]
            value, partition = metrics.get(EPSILON_KEY), metrics.get("partition-id")
            if not isinstance(value, int | float) or not isinstance(partition, int | float):
                continue
            if not math.isfinite(float(value)) or value < 0:
                continue
            self._take(server_round, int(partition), float(value))
        return {**self.metrics(), **mechanism_metrics(replies)}

    def _take(self, server_round: int, partition: int, value: float) -> None:
        offset, last = self.partitions.get(partition, (0.0, 0.0))
        if value < last:
            log.warning(
                "round %d: partition %d reports epsilon %.4g below its last %.4g (its node "
                "lost its ledger; set $FLORG_NODE_STATE_DIR): counting %.4g + %.4g",
                server_round, partition, value, last, offset + last, value,
            )  # fmt: skip
            offset += last
        self.partitions[partition] = (offset, value)

    def metrics(self) -> dict[str, float]:
        values = [self.epsilon(p) for p in self.partitions]
        over = sum(v > self.target for v in values) if self.target > 0 else 0
        return {
            "dp-sgd-epsilon-max": max(values, default=0.0),
            "dp-sgd-over-target": over,
            "dp-sgd-clients": len(values),
        }

    def state_json(self) -> dict[str, Any]:
        return {str(p): list(v) for p, v in self.partitions.items()}

    def load_state_json(self, state: Mapping[str, Any]) -> None:
        self.partitions = {int(p): (float(v[0]), float(v[1])) for p, v in state.items()}


def _reply_metrics(replies: Iterable[Message]) -> list[Mapping[str, Any]]:
    """The metrics of the successful replies."""
    return [
        msg.content["metrics"]
        for msg in replies
        if not msg.has_error() and "metrics" in msg.content.metric_records
    ]


def _finite(metrics: Mapping[str, Any], key: str) -> float | None:
    value = metrics.get(key)
    if isinstance(value, int | float) and math.isfinite(float(value)):
        return float(value)
    return None


def mechanism_metrics(replies: Iterable[Message]) -> dict[str, float]:
    """The round's ``dp-sgd-*`` mechanism keys (module docstring) from its replies."""
    found: dict[str, float] = {}
    metrics = _reply_metrics(replies)
    fractions = [v for m in metrics if (v := _finite(m, "dp-sgd-clipped-fraction")) is not None]
    if fractions:
        found["dp-sgd-clipped-fraction"] = statistics.fmean(fractions)
    for key in ("dp-sgd-grad-norm-median", "dp-sgd-clipped-mean-norm"):
        values = [v for m in metrics if (v := _finite(m, key)) is not None]
        if values:
            found[key] = statistics.median(values)
    stds, noise_norms = [], []
    for m in metrics:
        sum_std, batch = _finite(m, "dp-sgd-sum-noise-std"), _finite(m, "dp-sgd-expected-batch")
        if sum_std is None or not batch:
            continue
        stds.append(sum_std / batch)  # Opacus divides the noised sum by B
        if (d := _finite(m, "dp-sgd-trained-params")) is not None:
            noise_norms.append(sum_std / batch * math.sqrt(d))
    if stds:
        found["dp-sgd-noise-std"] = statistics.median(stds)
    if noise_norms:
        found["dp-sgd-noise-norm"] = statistics.median(noise_norms)
    return found


def example_dp_record(config: Any) -> ExampleDpRecord | None:
    """The record of a ``dp=example`` run (None otherwise): its target is
    ``dp-sgd-target-epsilon``, else ``dp-max-epsilon``."""
    if config.dp != "example":
        return None
    return ExampleDpRecord(config.dp_sgd_target_epsilon or config.dp_max_epsilon)
