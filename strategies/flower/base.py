"""AdapterStrategy: the Flower Message-API strategy shared by FLoRG and the five baselines.

It samples nodes like FedAvg, then in ``aggregate_train``
  1. drops error replies (a client that died) and logs them,
  2. rejects, with a logged reason, every malformed reply (``check_reply``: other
     records, missing or extra keys, a dtype other than float32/float64, a 0-d or
     3-d or otherwise mis-shaped array, an array whose serialised size exceeds its
     expected size, NaN/Inf, a ``num-examples`` / ``partition-id`` / ``train-loss``
     that is not a finite number of the right kind), so it is never aggregated,
  3. screens the rest (``screen-updates``, on by default; docs/faults.md): an update
     whose distance from the global state it started from exceeds kappa times the
     round's median distance is rejected, and a claimed ``num-examples`` above kappa
     times the median claim is clipped to it,
  4. weights the rest uniformly (the paper) or by ``num-examples``, in partition order
     (so the result does not depend on the order replies arrive in),
  5. calls the method's rule (``aggregate_adapter``) and FedAvgs the task head,
  6. returns the new global arrays with metrics: server aggregation seconds,
     parameters and bytes actually sent and received this round, train loss, counts of
     failed / rejected / screened / clipped replies and the rule's diagnostics.
Subclasses only implement ``aggregate_adapter``. ``state_arrays`` / ``state_json`` and
``restore`` carry everything needed to continue a run from a checkpoint.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.common.logger import log as flwr_log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg, Result

from strategies.averaging import weighted_average
from strategies.flower.participation import NodeLedger
from strategies.validation import normalize_weights

log = logging.getLogger("flwr.florg")  # propagates to Flower's console handler
INFO = logging.INFO

ADAPTER_SUFFIXES: tuple[str, ...] = (".A", ".lora_A", ".lora_B")
_NOT_AVERAGED = frozenset({"num-examples", "partition-id"})  # of clients' evaluation metrics
ACCEPTED_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))
REPLY_RECORDS = frozenset({"arrays", "metrics"})
NPY_HEADER_SLACK = 4096  # bytes of .npy header allowed on top of the array's own data
DEFAULT_KAPPA = 10.0  # docs/faults.md: honest spreads measured up to ~6x the median


class ReplyRejected(ValueError):
    """A client reply that must not be aggregated."""


@dataclass(frozen=True)
class Reply:
    """A checked client reply."""

    node: int
    partition: int
    arrays: dict[str, np.ndarray]
    num_examples: float
    train_loss: float


def metric_number(metrics: Any, key: str, *, required: bool = True) -> float | None:
    """``metrics[key]`` as a finite float, None when absent and not ``required``;
    ReplyRejected when it is missing, a list, a bool, NaN or infinite."""
    if key not in metrics:
        if required:
            raise ReplyRejected(f"metric {key!r} is missing")
        return None
    value = metrics[key]
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ReplyRejected(f"metric {key!r} must be a number, got {type(value).__name__}")
    if not math.isfinite(float(value)):
        raise ReplyRejected(f"metric {key!r} must be finite, got {value}")
    return float(value)


def declared_params(message_content: Any) -> int:
    """Array entries a message's ArrayRecords declare (their shapes; nothing deserialised)."""
    total = 0
    for rec in message_content.array_records.values():
        for arr in rec.values():
            try:
                total += int(np.prod(arr.shape, dtype=np.int64))
            except (TypeError, ValueError):
                continue
    return total


def _low_median(values: np.ndarray) -> float:
    """The lower median: the median for an odd count, the smaller middle value otherwise
    (with two clients, the larger one is compared with the smaller)."""
    ordered = np.sort(np.asarray(values, np.float64))
    return float(ordered[(len(ordered) - 1) // 2])


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
        screen_updates: bool = True,
        screen_kappa: float = DEFAULT_KAPPA,
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
        if not screen_kappa >= 1:
            raise ValueError(f"screen_kappa must be >= 1, got {screen_kappa!r}")
        self.weighting = weighting
        self.screen_updates = bool(screen_updates)
        self.screen_kappa = float(screen_kappa)
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
    def check_array(self, key: str, array: Array) -> np.ndarray:
        """One reply array, deserialised only once its size is plausible; ReplyRejected
        unless it is a float32/float64 array of exactly the global array's shape."""
        expected = self.global_state[key].shape
        limit = int(np.prod(expected, dtype=np.int64)) * 8 + NPY_HEADER_SLACK
        if len(array.data) > limit:
            raise ReplyRejected(
                f"{key}: {len(array.data)} bytes, more than the {limit} an array of shape "
                f"{expected} can take"
            )
        try:
            value = array.numpy()
        except Exception as err:  # wrong stype, not .npy, object dtype (no pickles)
            raise ReplyRejected(f"{key}: cannot be read as a numeric array ({err})") from None
        if value.dtype not in ACCEPTED_DTYPES:
            raise ReplyRejected(f"{key}: dtype {value.dtype} (only float32/float64 accepted)")
        if value.ndim != len(expected):
            raise ReplyRejected(f"{key}: {value.ndim}-d array, expected {len(expected)}-d")
        if value.shape != expected:
            raise ReplyRejected(f"{key}: shape {value.shape} != expected {expected}")
        if not np.all(np.isfinite(value)):
            raise ReplyRejected(f"{key}: contains NaN/Inf")
        return value

    def check_reply(self, message: Message) -> Reply:
        """The checked reply, or ReplyRejected with the reason (never aggregated)."""
        content = message.content
        if "arrays" not in content.array_records or "metrics" not in content.metric_records:
            raise ReplyRejected("reply lacks the 'arrays' ArrayRecord or the 'metrics' record")
        extra = sorted(set(content.keys()) - REPLY_RECORDS)
        if extra:
            raise ReplyRejected(f"unexpected records {extra[:3]}")
        record = content["arrays"]
        missing = sorted(set(self.global_state) - set(record.keys()))
        unexpected = sorted(set(record.keys()) - set(self.global_state))
        if missing or unexpected:
            raise ReplyRejected(f"keys differ: missing {missing[:3]}, unexpected {unexpected[:3]}")
        metrics = content["metrics"]
        num_examples = metric_number(metrics, "num-examples")
        if not num_examples > 0:
            raise ReplyRejected(f"num-examples must be > 0, got {num_examples}")
        partition = metric_number(metrics, "partition-id", required=False)
        if partition is not None and (partition != int(partition) or partition < 0):
            raise ReplyRejected(f"partition-id must be an integer >= 0, got {partition}")
        train_loss = metric_number(metrics, "train-loss", required=False)
        arrays = {key: self.check_array(key, record[key]) for key in self.global_state}
        return Reply(
            node=int(message.metadata.src_node_id),
            partition=-1 if partition is None else int(partition),
            arrays=arrays,
            num_examples=float(num_examples),
            train_loss=math.nan if train_loss is None else train_loss,
        )

    def screen(
        self, server_round: int, replies: list[Reply]
    ) -> tuple[list[Reply], list[float], dict]:
        """Outlier screening (on unless ``screen-updates=false``; docs/faults.md).

        For each client n and each group of tensors it sends (the adapter: every layer's
        A, or lora_A / lora_B; the task head), d_n = ||x_n - x_prev||_F over the group,
        x_prev the global state the round started from. A client is rejected when
        d_n > kappa * median(d) in any group (the lower median, see ``_low_median``).
        FLoRG needs this most: its server step sums Q = sum_n w_n A_n^T A_n (paper,
        eq. Gram_agg), quadratic in A_n, so a client sending c * A weighs c^2 times its
        share; it is screened on ||A_n - A_prev||, linear in the attack. Claimed example
        counts above kappa times the median claim are clipped to it. Returns the kept
        replies, their (clipped) example counts and the metrics."""
        metrics: dict[str, float] = {"screened": 0, "clipped": 0}
        sizes = [r.num_examples for r in replies]
        if len(replies) < 2:
            return replies, sizes, metrics
        head = split_state(self.global_state)[1]
        adapter_keys = [k for k in self.global_state if k not in head]
        groups = {"adapter": adapter_keys, "head": list(head)}
        reasons: dict[int, str] = {}
        worst = 0.0
        for group, keys in groups.items():
            if not keys:
                continue
            prev = self.global_state
            d = np.array(
                [
                    math.sqrt(sum(float(np.sum((r.arrays[k] - prev[k]) ** 2)) for k in keys))
                    for r in replies
                ]
            )
            scale = math.sqrt(sum(float(np.sum(prev[k] ** 2)) for k in keys))
            median = max(_low_median(d), 1e-12 * (1.0 + scale))
            ratios = d / median
            worst = max(worst, float(ratios.max()))
            for i in np.flatnonzero(ratios > self.screen_kappa):
                reasons.setdefault(
                    int(i),
                    f"{group} update distance {d[i]:.4g} = {ratios[i]:.1f} x the round's "
                    f"median {median:.4g} (kappa {self.screen_kappa:g})",
                )
        metrics["screen-ratio-max"] = worst  # measured also with screening off
        if not self.screen_updates:
            return replies, sizes, metrics
        kept: list[Reply] = []
        for i, r in enumerate(replies):
            if i in reasons:
                log.warning(
                    "round %d: screened out update from partition %s (node %s): %s",
                    server_round,
                    r.partition,
                    r.node,
                    reasons[i],
                )
            else:
                kept.append(r)
        metrics["screened"] = len(reasons)
        claims = np.array([r.num_examples for r in kept])
        cap = self.screen_kappa * _low_median(claims)
        for r in kept:
            if r.num_examples > cap:
                log.warning(
                    "round %d: partition %s (node %s) claims %.6g examples, clipped to %.6g "
                    "(kappa %g x the round's median claim)",
                    server_round,
                    r.partition,
                    r.node,
                    r.num_examples,
                    cap,
                    self.screen_kappa,
                )
        metrics["clipped"] = int(np.sum(claims > cap))
        return kept, np.minimum(claims, cap).tolist(), metrics

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        replies = list(replies)
        nodes = self.ledger.settle(server_round, replies)
        checked: list[Reply] = []
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
            up_params += declared_params(msg.content)
            try:
                checked.append(self.check_reply(msg))
            except ReplyRejected as err:
                rejected += 1
                log.warning(
                    "round %d: rejected update from partition %s (node %s): %s",
                    server_round,
                    self.ledger.partition_of(node),
                    node,
                    err,
                )
        checked.sort(key=lambda r: (r.partition, r.node))  # arrival order never matters
        kept, sizes, screening = self.screen(server_round, checked)
        metrics: dict[str, float] = {
            "clients": len(kept),
            "failures": failures,
            "rejected": rejected,
            **screening,
            "up-params": up_params,
            "down-params": self._down_params.get(server_round, 0),
            **nodes.metrics(),
        }
        if not kept:
            log.warning(
                "round %d: no valid client update; the global model is unchanged", server_round
            )
            self.round_metrics[server_round] = metrics
            return None, MetricRecord(metrics)

        payloads = [r.arrays for r in kept]
        weights = normalize_weights(None if self.weighting == "uniform" else sizes, len(payloads))
        prev_state = self.global_state
        t0 = time.perf_counter()
        new_state, info = self.aggregate_adapter(server_round, payloads, weights)
        for key in split_state(prev_state)[1]:
            new_state[key] = weighted_average([p[key] for p in payloads], weights, key)
        metrics["agg-seconds"] = time.perf_counter() - t0
        self.global_state = new_state
        losses = np.array([r.train_loss for r in kept])
        known = np.isfinite(losses)
        if known.any():
            n = np.asarray(sizes)[known]
            metrics["train-loss"] = float(np.dot(n / n.sum(), losses[known]))
        metrics["examples"] = float(np.sum(sizes))
        metrics.update(info)
        self.round_metrics[server_round] = metrics
        if self.updates_dir is not None:
            partitions = [r.partition for r in kept]
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

    # -- checkpoint and resume (flower_app/checkpoint.py) ---------------------------------
    def state_arrays(self) -> dict[str, np.ndarray]:
        """Arrays needed to continue: the float64 global state (the previous state of the
        next FLoRG Procrustes step, eq. opt_problem, is this one, not its float32 copy)."""
        return {f"global/{k}": v for k, v in self.global_state.items()}

    def state_json(self) -> dict[str, Any]:
        """JSON state needed to continue: the node -> partition map learnt so far."""
        return {
            "method": self.method,
            "partitions": {str(k): v for k, v in self.ledger.partitions.items()},
        }

    def restore(self, arrays: Mapping[str, np.ndarray], state: Mapping[str, Any]) -> None:
        """Continue from ``state_arrays`` / ``state_json`` of a checkpoint."""
        if state.get("method") != self.method:
            raise ValueError(f"checkpoint of a {state.get('method')} strategy, not {self.method}")
        saved = {k[len("global/") :]: v for k, v in arrays.items() if k.startswith("global/")}
        if set(saved) != set(self.global_state) or any(
            saved[k].shape != self.global_state[k].shape for k in saved
        ):
            raise ValueError("checkpoint arrays do not match this model's adapter")
        self.global_state = {k: np.asarray(v, np.float64) for k, v in saved.items()}
        self.ledger.partitions = {int(k): int(v) for k, v in state.get("partitions", {}).items()}

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
