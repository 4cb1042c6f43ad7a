"""The server's record of the clients' example-level epsilon (``dp=example``).

Each client trains with DP-SGD and keeps its own accountant (flower_app/privacy/dp_sgd.py); its
reply carries ``dp-sgd-epsilon``, its epsilon after the round at its own delta. The server
keeps the latest value per partition (a client's epsilon only grows) and writes into every
round's row, round 0 included:

- ``dp-sgd-epsilon-max``: the largest epsilon over the clients that have trained so far;
- ``dp-sgd-over-target``: how many of them are above the target, ``dp-sgd-target-epsilon``
  (or ``dp-max-epsilon`` where no target is set; 0 with neither);
- ``dp-sgd-clients``: how many clients have reported an epsilon.

In a training round it also writes what the clients' DP-SGD did (their replies' metrics,
flower_app/privacy/dp_sgd_mechanism.py), over the round's successful replies that carry them:

- ``dp-sgd-clipped-fraction``: the mean over clients of the fraction of per-example
  gradients clipped;
- ``dp-sgd-grad-norm-median``: the median over clients of their median per-example
  gradient norm before clipping;
- ``dp-sgd-clipped-mean-norm``: the median over clients of the clipped mean gradient's norm
  (each client's median over its steps), the signal the noise is set against;
- ``dp-sgd-noise-std``: the median over clients of the noise std on the mean gradient,
  z C / B (B the expected batch size), and ``dp-sgd-noise-norm``, that std times sqrt(d)
  (d the trained coordinates): about the norm of the noise vector added to the mean.

A round whose replies carry none of these (a method's round 0 release, runs of a client without
them) has none of these keys.

A client past ``dp-max-epsilon`` refuses to train: its reply is an error, counted in
``failures`` and logged with its reason, and its last epsilon stays in the record.

A count that goes down means the node lost its ledger (a resumed run whose node keeps no
state on disk, flower_app/client/dp_state.py): the record then adds the new count to the
old one, an upper bound on the composition by basic composition (epsilons of two mechanisms
on the same data add up), and logs it. The record is checkpointed (``state_json``).
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
