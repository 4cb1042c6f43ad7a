"""AdapterStrategy: the Flower Message-API strategy shared by FLoRG and the five baselines.

It samples nodes like FedAvg, then in ``aggregate_train``
  1. drops error replies (a client that died) and logs them,
  2. rejects, with a logged reason, every malformed reply (``check_reply``: other
     records, missing or extra keys, a dtype other than float32/float64, a 0-d or
     3-d or otherwise mis-shaped array, an array whose serialised size exceeds its
     expected size, NaN/Inf, a ``num-examples`` / ``partition-id`` / ``train-loss``
     that is not a finite number of the right kind; strategies/common/replies.py), so
     it is never aggregated,
  3. screens the rest (``screen-updates``, on by default; docs/faults.md,
     strategies/common/screening.py): an update whose distance from the global state
     it started from exceeds kappa times the round's median distance is rejected, and
     a claimed ``num-examples`` above kappa times the median claim is clipped to it,
  4. weights the rest uniformly (the paper) or by ``num-examples``, in partition order
     (so the result does not depend on the order replies arrive in),
  5. calls the method's rule (``aggregate_adapter``) and FedAvgs the task head,
  6. returns the new global arrays with metrics: server aggregation seconds,
     parameters and bytes actually sent and received this round, train loss, counts of
     failed / rejected / screened / clipped replies and the rule's diagnostics.
The rule of step 5 is the method's (``Method.aggregate``).

Clients of different rank (issue 30, docs/architecture.md): the global state has the run's
largest rank r_max; a reply declares its client's rank r_n (``rank`` metric), checked
against the arrays' shapes (every layer's A has r_n rows) and rejected when r_n exceeds k
or r_max or when the method aggregates one rank only (``heterogeneous_ranks`` false). The
strategy remembers each node's rank from its replies and from then on sends it the state
of its own rank (``sent_state``: by default the top r_n rows of A / columns of B of the
global state; FLoRG its own factor); a node whose rank it does not know yet gets the
r_max state and keeps the top r_n rows. Screening measures each client from the state it
was sent. With every rank equal to r_max nothing of this changes a message or a number.

``state_arrays`` / ``state_json`` and ``restore`` carry everything needed to continue a
run from a checkpoint. The arrays travel as Flower ArrayRecords (flower_app/records.py).

Central differential privacy (``dp=central``, docs/privacy.md): with ``dp`` (a
``strategies.common.central_dp.CentralDP``) steps 4 and 5 are replaced by the method's
mechanism (``Method.aggregate_private``): each kept client's contribution (adapter and head
jointly) is clipped to C and the sum gets Gaussian noise, divided by m = the number of
clients sampled in the round (a client that failed or was rejected counts as one that did
not move), then post-processed by the method's rule. The median-ratio screening is off
under dp=central: whether a client is kept would depend on the other clients, which the
privacy analysis does not cover, and clipping already bounds what one client moves. Every
round then records ``dp-epsilon``, and the ledger goes into the checkpoint (``state_json``
/ ``restore``).

The strategy never names a method: it reads the method's rule, mechanism and flags
(``heterogeneous_ranks``, ``dp_mechanism``) from the ``Method`` it is built with. A method
whose round needs more (FLoRG's batched step and per-rank factors, FedEx-LoRA's residual
messages) subclasses it in its own folder.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.common.logger import log as flwr_log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg, Result

from flower_app.records import (
    declared_params,
    record_params,
    split_state,
    to_array_record,
)
from strategies.common import replies as _replies
from strategies.common import screening as _screening
from strategies.common.averaging import weighted_average
from strategies.common.central_dp import CentralDP
from strategies.common.participation import NodeLedger
from strategies.common.ranks import adapter_k, rank_of, shapes_at_rank, truncate_to_rank
from strategies.common.replies import Reply, ReplyRejected, declared_rank
from strategies.common.screening import DEFAULT_KAPPA
from strategies.common.validation import normalize_weights

if TYPE_CHECKING:  # the method builds this strategy (Method.build_strategy)
    from strategies.method import Method

log = logging.getLogger("flwr.florg")  # propagates to Flower's console handler
INFO = logging.INFO

_NOT_AVERAGED = frozenset({"num-examples", "partition-id"})  # of clients' evaluation metrics
COMMON_SPLIT_PREFIXES = ("test-", "val-")  # metrics on a split every client scores whole


class AdapterStrategy(FedAvg):
    """FedAvg's sampling plus validated, method-specific aggregation of adapter arrays."""

    def __init__(
        self,
        initial_state: Mapping[str, np.ndarray],
        *,
        method: Method,
        fraction_train: float = 1.0,
        min_train_nodes: int = 2,
        min_available_nodes: int = 2,
        weighting: str = "uniform",
        clients_evaluate: bool = False,
        updates_dir: str | Path | None = None,
        screen_updates: bool = True,
        screen_kappa: float = DEFAULT_KAPPA,
        dp: CentralDP | None = None,
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
        # the method's rule, DP mechanism and flags (heterogeneous ranks, DP): never its name
        self.method = method
        self.weighting = weighting
        self.screen_updates = bool(screen_updates)
        self.screen_kappa = float(screen_kappa)
        self.dp = dp
        if dp is not None:
            self._check_dp(dp, weighting, updates_dir)
            if self.screen_updates:
                log.info("dp=central: the median-ratio screening is off (docs/privacy.md)")
            self.screen_updates = False
        self.global_state: dict[str, np.ndarray] = {
            k: np.asarray(v, np.float64) for k, v in initial_state.items()
        }
        self.updates_dir = Path(updates_dir) if updates_dir else None
        self.round_metrics: dict[int, dict[str, float]] = {}
        if dp is not None:
            self.round_metrics[0] = {"dp-epsilon": 0.0}  # the initial state is public
        self._down_params: dict[int, int] = {}
        self._sampled: dict[int, int] = {}  # round -> nodes sent a training message
        self.ledger = NodeLedger()  # node id -> partition id; lost nodes per round
        self.largest_rank = rank_of(self.global_state)  # r_max (issue 30)
        self.max_k = adapter_k(self.global_state)  # a rank above it fits no layer
        self._down_by_node: dict[int, int] = {}  # node -> parameters sent this round
        self.node_ranks: dict[int, int] = {}  # node id -> rank, learnt from its replies
        self._sent_ranks: dict[int, dict[int, int]] = {}  # round -> node -> rank sent

    def _check_dp(self, dp: CentralDP, weighting: str, updates_dir: Any) -> None:
        """What the run settings check (Method.check_settings), again where the strategy
        is built directly: the method's mechanism, uniform weights, no saved client
        updates."""
        mechanism = self.method.check_dp_supported()  # a refusal says why there is none
        if dp.mechanism != mechanism:
            raise ValueError(
                f"dp=central: method {self.method.name!r} implements the mechanism "
                f"{mechanism!r}, not {dp.mechanism!r}"
            )
        if weighting != "uniform":
            raise ValueError("dp=central needs aggregation-weights='uniform'")
        if updates_dir is not None:
            raise ValueError("dp=central: save-client-updates would store the raw updates")

    # -- sending ------------------------------------------------------------------------
    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        messages = [
            self.extend_train_message(server_round, self.at_node_rank(server_round, m))
            for m in super().configure_train(server_round, arrays, config, grid)
        ]
        self._down_params[server_round] = sum(record_params(m.content) for m in messages)
        self._down_by_node = {m.metadata.dst_node_id: record_params(m.content) for m in messages}
        self._sampled[server_round] = len(messages)
        self.ledger.sent(server_round, messages)
        return messages

    def extend_train_message(self, server_round: int, message: Message) -> Message:
        """Hook for methods that send more than the global arrays (FedEx-LoRA)."""
        return message

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """FedAvg's, each node sent the state of its own rank (issue 30)."""
        return [
            self.at_node_rank(None, m)
            for m in super().configure_evaluate(server_round, arrays, config, grid)
        ]

    # -- clients of different rank (issue 30) ---------------------------------------------
    def sent_state(self, rank: int) -> dict[str, np.ndarray]:
        """The state a node of ``rank`` is sent: the global state's top ``rank`` rows of
        every A and columns of every B (FLoRG overrides it: a factor of its own)."""
        return truncate_to_rank(self.global_state, rank)

    def at_node_rank(self, server_round: int | None, message: Message) -> Message:
        """``message`` carrying the state of its node's rank when the node has declared a
        rank other than r_max (else unchanged: a node of unknown rank gets r_max and keeps
        the top rows); ``server_round``: a training round, whose sent ranks are recorded."""
        node = message.metadata.dst_node_id
        rank = self.node_ranks.get(node, self.largest_rank)
        if server_round is not None:
            self._sent_ranks.setdefault(server_round, {})[node] = rank
        if rank == self.largest_rank:
            return message
        content = RecordDict(dict(message.content.items()))
        content["arrays"] = to_array_record(self.sent_state(rank))
        return Message(
            content=content, message_type=message.metadata.message_type, dst_node_id=node
        )

    def start_state(self, server_round: int, reply: Reply) -> dict[str, np.ndarray]:
        """The state ``reply``'s client started this round from: what it was sent, cut to
        its rank."""
        sent = self._sent_ranks.get(server_round, {}).get(reply.node, self.largest_rank)
        return truncate_to_rank(self.sent_state(sent), reply.rank)

    # -- receiving ----------------------------------------------------------------------
    def check_reply(self, message: Message) -> Reply:
        """The checked reply, or ReplyRejected with the reason (never aggregated):
        ``strategies.common.replies.check_reply`` against the global state's shapes at the
        rank the reply declares (``declared_rank``)."""
        metrics = message.content["metrics"] if "metrics" in message.content.metric_records else {}
        rank = declared_rank(
            metrics, default=self.largest_rank, k=self.max_k, largest=self.largest_rank
        )
        expected: Mapping[str, np.ndarray] = self.global_state
        if rank != self.largest_rank:
            if not self.method.heterogeneous_ranks:
                raise ReplyRejected(
                    f"declared rank {rank}, but {self.method.name} aggregates rank "
                    f"{self.largest_rank} only"
                )
            if self.dp is not None:
                raise ReplyRejected(f"declared rank {rank}: dp=central needs one rank")
            expected = {
                key: np.empty(shape, np.float32)
                for key, shape in shapes_at_rank(self.global_state, rank).items()
            }
        reply = _replies.check_reply(message, expected)
        return replace(reply, rank=rank)

    def screen(
        self,
        server_round: int,
        replies: list[Reply],
        starts: list[dict[str, np.ndarray]] | None = None,
    ) -> tuple[list[Reply], list[float], dict]:
        """Outlier screening (on unless ``screen-updates=false``; docs/faults.md and
        ``strategies.common.screening``): the kept replies, their (clipped) example
        counts and the metrics; ``starts``: each reply's ``start_state`` (mixed ranks)."""
        return _screening.screen(
            server_round,
            replies,
            self.global_state,
            kappa=self.screen_kappa,
            enabled=self.screen_updates,
            starts=starts,
        )

    def rank_communication(self, replies: list[Reply]) -> dict[str, float]:
        """Per-client communication of a round with mixed ranks, from the arrays that
        travelled: ``up-params-per-client`` / ``down-params-per-client`` (mean over the
        checked replies) and ``up-params-r<r>`` / ``down-params-r<r>`` (mean over the
        clients of rank r)."""
        down = self._down_by_node
        rows = [(r.rank, sum(int(a.size) for a in r.arrays.values()), down.get(r.node, 0))
                for r in replies]  # fmt: skip
        out: dict[str, float] = {}
        if not rows:
            return out
        out["up-params-per-client"] = float(np.mean([u for _, u, _ in rows]))
        out["down-params-per-client"] = float(np.mean([d for _, _, d in rows]))
        for rank in sorted({r for r, _, _ in rows}):
            mine = [(u, d) for r, u, d in rows if r == rank]
            out[f"up-params-r{rank}"] = float(np.mean([u for u, _ in mine]))
            out[f"down-params-r{rank}"] = float(np.mean([d for _, d in mine]))
        return out

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
                reply = self.check_reply(msg)
                checked.append(reply)
                self.node_ranks[reply.node] = reply.rank
            except ReplyRejected as err:
                rejected += 1
                log.warning(
                    "round %d: rejected update from partition %s (node %s): %s",
                    server_round,
                    self.ledger.partition_of(node),
                    node,
                    err,
                )
        return self.aggregate_replies(
            server_round,
            checked,
            failures=failures,
            rejected=rejected,
            up_params=up_params,
            node_metrics=nodes.metrics(),
        )

    def aggregate_replies(
        self,
        server_round: int,
        checked: list[Reply],
        *,
        failures: int = 0,
        rejected: int = 0,
        up_params: int = 0,
        node_metrics: Mapping[str, float] | None = None,
    ) -> tuple[ArrayRecord | None, MetricRecord]:
        """Steps 3 to 6 over the checked replies (``aggregate_train`` counted the failed
        and rejected ones and the parameters sent up): screen, weight, aggregate, record.
        A caller without Flower messages (benchmarks/overhead/loop.py) starts here."""
        # partition order: the order replies arrive in never matters
        checked = sorted(checked, key=lambda r: (r.partition, r.node))
        sent = self._sent_ranks.get(server_round, {})
        mixed = any(r.rank not in (0, self.largest_rank) for r in checked) or any(
            rank != self.largest_rank for rank in sent.values()
        )
        starts = [self.start_state(server_round, r) for r in checked] if mixed else None
        kept, sizes, screening = self.screen(server_round, checked, starts)
        metrics: dict[str, float] = {
            "clients": len(kept),
            "failures": failures,
            "rejected": rejected,
            **screening,
            "up-params": up_params,
            "down-params": self._down_params.get(server_round, 0),
            **(node_metrics or {}),
        }
        if mixed:
            metrics.update(self.rank_communication(checked))
        if not kept and self.dp is None:
            log.warning(
                "round %d: no valid client update; the global model is unchanged", server_round
            )
            self.round_metrics[server_round] = metrics
            return None, MetricRecord(metrics)

        payloads = [r.arrays for r in kept]
        prev_state = self.global_state
        t0 = time.perf_counter()
        if self.dp is None:
            weights = normalize_weights(
                None if self.weighting == "uniform" else sizes, len(payloads)
            )
            new_state, info = self.aggregate_adapter(server_round, payloads, weights)
            for key in split_state(prev_state)[1]:
                new_state[key] = weighted_average([p[key] for p in payloads], weights, key)
        else:
            new_state, info = self.release_private(server_round, payloads)
            weights = np.full(len(payloads), 1.0 / max(len(payloads), 1))
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
        """The method's rule over the adapter arrays (the head is FedAvg'd by the caller)."""
        return self.method.aggregate(self.global_state, payloads, weights)

    # -- central differential privacy (docs/privacy.md) -----------------------------------
    # Why not Flower's DifferentialPrivacyServerSideFixedClipping: it wraps a strategy's
    # aggregate_train and noises its OUTPUT, which for FeDeRA and FLoRG is a non-linear
    # function of the replies (an SVD, an eigendecomposition and Procrustes), so the noise
    # would not be the Gaussian mechanism on a statistic of bounded sensitivity; it would
    # also clip before this strategy's reply checks, and its accounted mode accepts only
    # FedAvg.aggregate_train. For the mean methods our mechanism equals it in distribution
    # (tests/test_dp.py); strategies/common/central_dp.py's docstring lists why its helpers are not called.
    def num_sampled(self, server_round: int, replies: int) -> int:
        """m: the nodes sent a training message this round (public), at least the replies
        (a caller without ``configure_train``, such as the overhead benchmark: the replies)."""
        return max(self._sampled.get(server_round, 0), replies, 1)

    def release_private(
        self, server_round: int, payloads: list[dict[str, np.ndarray]]
    ) -> tuple[dict[str, np.ndarray], dict[str, float]]:
        """One round under dp=central: the method's mechanism over the kept replies, the
        round recorded by the accountant. With no reply kept the mechanism still releases
        (the sent state plus noise: as if one client had not moved), so that whether a round
        is released never depends on the clients' data."""
        assert self.dp is not None
        m = self.num_sampled(server_round, len(payloads))
        if not payloads:
            log.warning("round %d: no valid client update; dp=central releases noise only",
                        server_round)  # fmt: skip
        new_state, info = self.aggregate_private(
            server_round, payloads or [dict(self.global_state)], m
        )
        info = {**info, "dp-sampled": m, **self.dp.release()}
        return new_state, info

    def aggregate_private(
        self, server_round: int, payloads: list[dict[str, np.ndarray]], num_sampled: int
    ) -> tuple[dict[str, np.ndarray], dict[str, float]]:
        """The method's central-DP mechanism (``Method.aggregate_private``) over the kept
        replies, m = ``num_sampled``; returns the whole new state."""
        assert self.dp is not None
        return self.method.aggregate_private(self.dp, self.global_state, payloads, num_sampled)

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        """Clients' own (personalised) evaluation: every metric a client reports (accuracy
        or exact-match / f1, loss, score) becomes ``personalized-<metric>``, weighted by the
        clients' example counts; metrics on a split every client scores whole (``test-*``,
        ``val-*``, see client_app.personalised_evaluate) are the plain mean over clients."""
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
        result: dict[str, float] = {}
        for k in keys:
            values = [r[1][k] for r in rows]
            # A node's own share: weighted by its examples. A split every node scores whole
            # (test-*, val-*): each node's model counts once.
            common = k.startswith(COMMON_SPLIT_PREFIXES)
            result[f"personalized-{k}"] = float(
                np.mean(values) if common else np.dot(n, values) / n.sum()
            )
        result["personalized-clients"] = len(rows)
        self.round_metrics.setdefault(server_round, {}).update(result)
        return MetricRecord(result)

    # -- checkpoint and resume (flower_app/checkpoint.py) ---------------------------------
    def state_arrays(self) -> dict[str, np.ndarray]:
        """Arrays needed to continue: the float64 global state (the previous state of the
        next FLoRG Procrustes step, eq. opt_problem, is this one, not its float32 copy)."""
        return {f"global/{k}": v for k, v in self.global_state.items()}

    def state_json(self) -> dict[str, Any]:
        """JSON state needed to continue: the node -> partition map learnt so far; under
        dp=central the privacy ledger (``dp``), so a resumed run continues the count."""
        state: dict[str, Any] = {
            "method": self.method.name,
            "partitions": {str(k): v for k, v in self.ledger.partitions.items()},
        }
        if self.node_ranks:
            state["node-ranks"] = {str(k): v for k, v in self.node_ranks.items()}
        if self.dp is not None:
            state["dp"] = self.dp.state_dict()
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
        self.node_ranks = {int(k): int(v) for k, v in state.get("node-ranks", {}).items()}
        if (self.dp is None) != ("dp" not in state):
            raise ValueError("checkpoint and run differ in dp (off / central)")
        if self.dp is not None:
            self.dp.load_state_dict(state["dp"])

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
