"""AdapterStrategy: the Flower Message-API strategy shared by FLoRG and the five baselines.

It samples nodes like FedAvg, then in ``aggregate_train``
  1. drops error replies (a client that died) and logs them,
  2. rejects, with a logged reason, replies whose arrays have the wrong keys or
     shapes or hold NaN/Inf, so they are never aggregated,
  3. weights the rest uniformly (the paper) or by ``num-examples``,
  4. calls the method's rule (``aggregate_adapter``) and FedAvgs the task head,
  5. returns the new global arrays with metrics: server aggregation seconds,
     parameters and bytes actually sent and received this round, train loss and
     the rule's diagnostics.
Subclasses only implement ``aggregate_adapter``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg

from strategies.averaging import weighted_average
from strategies.flower.participation import NodeLedger
from strategies.validation import normalize_weights

log = logging.getLogger("flwr.florg")  # propagates to Flower's console handler

ADAPTER_SUFFIXES: tuple[str, ...] = (".A", ".lora_A", ".lora_B")
_NOT_AVERAGED = frozenset({"num-examples", "partition-id"})  # of clients' evaluation metrics


class ReplyRejected(ValueError):
    """A client reply that must not be aggregated."""


def to_array_record(state: Mapping[str, np.ndarray]) -> ArrayRecord:
    """float32 ArrayRecord of named arrays (ArrayRecord cannot carry bfloat16)."""
    return ArrayRecord(
        array_dict={k: Array(np.ascontiguousarray(v, dtype=np.float32)) for k, v in state.items()}
    )


def from_array_record(record: ArrayRecord) -> dict[str, np.ndarray]:
    return {k: v.numpy() for k, v in record.items()}


def record_params(message_content: Any) -> int:
    """Number of array entries carried by all ArrayRecords of a message's content."""
    return int(
        sum(
            arr.numpy().size
            for rec in message_content.array_records.values()
            for arr in rec.values()
        )
    )


def split_state(state: Mapping[str, np.ndarray]) -> tuple[dict[str, dict[str, np.ndarray]], dict]:
    """({layer: {'A' | 'lora_A' | 'lora_B': array}}, {head key: array})."""
    layers: dict[str, dict[str, np.ndarray]] = {}
    head: dict[str, np.ndarray] = {}
    for key, value in state.items():
        suffix = next((s for s in ADAPTER_SUFFIXES if key.endswith(s)), None)
        if suffix is None:
            head[key] = value
        else:
            layers.setdefault(key[: -len(suffix)], {})[suffix[1:]] = value
    return layers, head


class AdapterStrategy(FedAvg):
    """FedAvg's sampling plus validated, method-specific aggregation of adapter arrays."""

    method = "adapter"

    def __init__(
        self,
        initial_state: Mapping[str, np.ndarray],
        *,
        fraction_train: float = 1.0,
        min_train_nodes: int = 2,
        min_available_nodes: int = 2,
        weighting: str = "uniform",
        clients_evaluate: bool = False,
        updates_dir: str | Path | None = None,
    ) -> None:
        super().__init__(
            fraction_train=fraction_train,
            fraction_evaluate=1.0 if clients_evaluate else 0.0,
            min_train_nodes=min_train_nodes,
            min_evaluate_nodes=min_train_nodes if clients_evaluate else 0,
            min_available_nodes=min_available_nodes,
        )
        if weighting not in ("uniform", "num-examples"):
            raise ValueError(f"weighting must be 'uniform' or 'num-examples', got {weighting!r}")
        self.weighting = weighting
        self.global_state: dict[str, np.ndarray] = {
            k: np.asarray(v, np.float64) for k, v in initial_state.items()
        }
        self.updates_dir = Path(updates_dir) if updates_dir else None
        self.round_metrics: dict[int, dict[str, float]] = {}
        self._down_params: dict[int, int] = {}
        self.ledger = NodeLedger()  # node id -> partition id; lost nodes per round

    # -- sending ------------------------------------------------------------------------
    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        messages = [
            self.extend_train_message(server_round, m)
            for m in super().configure_train(server_round, arrays, config, grid)
        ]
        self._down_params[server_round] = sum(record_params(m.content) for m in messages)
        self.ledger.sent(server_round, messages)
        return messages

    def extend_train_message(self, server_round: int, message: Message) -> Message:
        """Hook for methods that send more than the global arrays (FedEx-LoRA)."""
        return message

    # -- receiving ----------------------------------------------------------------------
    def check_reply(self, message: Message) -> tuple[dict[str, np.ndarray], float]:
        """The reply's arrays and its ``num-examples``, or ReplyRejected with the reason."""
        content = message.content
        if "arrays" not in content.array_records or "metrics" not in content.metric_records:
            raise ReplyRejected("reply lacks the 'arrays' ArrayRecord or the 'metrics' record")
        arrays = from_array_record(content["arrays"])
        missing = sorted(set(self.global_state) - set(arrays))
        unexpected = sorted(set(arrays) - set(self.global_state))
        if missing or unexpected:
            raise ReplyRejected(f"keys differ: missing {missing[:3]}, unexpected {unexpected[:3]}")
        for key, value in arrays.items():
            if value.shape != self.global_state[key].shape:
                raise ReplyRejected(
                    f"{key}: shape {value.shape} != expected {self.global_state[key].shape}"
                )
            if not np.all(np.isfinite(value)):
                raise ReplyRejected(f"{key}: contains NaN/Inf")
        num_examples = float(content["metrics"].get("num-examples", 0))
        if not num_examples > 0:
            raise ReplyRejected(f"num-examples must be > 0, got {num_examples}")
        return arrays, num_examples

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        replies = list(replies)
        nodes = self.ledger.settle(server_round, replies)
        payloads: list[dict[str, np.ndarray]] = []
        sizes: list[float] = []
        losses: list[float] = []
        partitions: list[int] = []
        failures = rejected = 0
        up_params = 0
        for msg in replies:
            node = msg.metadata.src_node_id
            if msg.has_error():
                failures += 1
                log.warning(
                    "round %d: node %s (partition %s) failed, reply dropped: %s",
                    server_round,
                    node,
                    self.ledger.partition_of(node),
                    msg.error.reason,
                )
                continue
            up_params += record_params(msg.content)
            pid = (
                msg.content["metrics"].get("partition-id", -1)
                if ("metrics" in msg.content.metric_records)
                else -1
            )
            try:
                arrays, n = self.check_reply(msg)
            except ReplyRejected as err:
                rejected += 1
                log.warning(
                    "round %d: rejected update from partition %s (node %s): %s",
                    server_round,
                    pid,
                    node,
                    err,
                )
                continue
            payloads.append(arrays)
            sizes.append(n)
            losses.append(float(msg.content["metrics"].get("train-loss", np.nan)))
            partitions.append(int(pid))

        metrics: dict[str, float] = {
            "clients": len(payloads),
            "failures": failures,
            "rejected": rejected,
            "up-params": up_params,
            "down-params": self._down_params.get(server_round, 0),
            **nodes.metrics(),
        }
        if not payloads:
            log.warning(
                "round %d: no valid client update; the global model is unchanged", server_round
            )
            self.round_metrics[server_round] = metrics
            return None, MetricRecord(metrics)

        weights = normalize_weights(None if self.weighting == "uniform" else sizes, len(payloads))
        prev_state = self.global_state
        t0 = time.perf_counter()
        new_state, info = self.aggregate_adapter(server_round, payloads, weights)
        for key in split_state(prev_state)[1]:
            new_state[key] = weighted_average([p[key] for p in payloads], weights, key)
        metrics["agg-seconds"] = time.perf_counter() - t0
        self.global_state = new_state
        metrics["train-loss"] = float(np.dot(np.asarray(sizes) / np.sum(sizes), losses))
        metrics["examples"] = float(np.sum(sizes))
        metrics.update(info)
        self.round_metrics[server_round] = metrics
        if self.updates_dir is not None:
            self._save_updates(server_round, prev_state, payloads, weights, partitions)
        return to_array_record(new_state), MetricRecord(metrics)

    def aggregate_adapter(
        self, server_round: int, payloads: list[dict[str, np.ndarray]], weights: np.ndarray
    ) -> tuple[dict[str, np.ndarray], dict[str, float]]:
        """The method's rule over the adapter arrays (head handled by the base class)."""
        raise NotImplementedError

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        """Clients' own (personalised) evaluation, weighted by their example counts: every
        metric a client reports (accuracy or exact-match / f1, loss, score) becomes
        ``personalized-<metric>``."""
        rows = []
        for msg in replies:
            if msg.has_error():
                log.warning(
                    "round %d: evaluation failed on node %s: %s",
                    server_round,
                    msg.metadata.src_node_id,
                    msg.error.reason,
                )
                continue
            m = msg.content["metrics"]
            if float(m.get("num-examples", 0)) > 0:
                rows.append(
                    (
                        float(m["num-examples"]),
                        {
                            k: float(v)
                            for k, v in m.items()
                            if k not in _NOT_AVERAGED and isinstance(v, int | float)
                        },
                    )
                )
        if not rows:
            return None
        n = np.array([r[0] for r in rows])
        keys = sorted(set.intersection(*(set(r[1]) for r in rows)))
        result: dict[str, float] = {
            f"personalized-{k}": float(np.dot(n, [r[1][k] for r in rows]) / n.sum()) for k in keys
        }
        result["personalized-clients"] = len(rows)
        self.round_metrics.setdefault(server_round, {}).update(result)
        return MetricRecord(result)

    # -- helpers for subclasses -----------------------------------------------------------
    def stacked(self, payloads: list[dict[str, np.ndarray]], key: str) -> list[np.ndarray]:
        return [np.asarray(p[key], np.float64) for p in payloads]

    def layers(self) -> dict[str, dict[str, np.ndarray]]:
        return split_state(self.global_state)[0]

    def _save_updates(self, server_round, prev_state, payloads, weights, partitions) -> None:
        self.updates_dir.mkdir(parents=True, exist_ok=True)
        arrays = {f"prev/{k}": v for k, v in prev_state.items()}
        arrays.update({f"new/{k}": v for k, v in self.global_state.items()})
        for i, p in enumerate(payloads):
            arrays.update({f"client{i}/{k}": v for k, v in p.items()})
        np.savez(
            self.updates_dir / f"round-{server_round}.npz",
            weights=weights,
            partitions=np.asarray(partitions),
            **arrays,
        )
