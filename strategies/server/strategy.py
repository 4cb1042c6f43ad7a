"""AdapterStrategy: the Flower Message-API strategy every method runs (or extends).

It samples nodes like FedAvg, then in ``aggregate_train``
  1. drops error replies (a client that died) and logs them,
  2. checks every reply (the reply gate, ``reply_gate.py``: a malformed reply, or one at a
     rank the run cannot aggregate, is rejected with a logged reason, never aggregated),
  3. screens the rest (``screen-updates``; docs/faults.md): an outlying update is
     rejected, an outlying ``num-examples`` claim clipped,
  4. weights the rest uniformly (the paper) or by ``num-examples``, in partition order
     (so the result does not depend on the order replies arrive in),
  5. runs the method's rule (``Method.aggregate``) and FedAvgs the task head,
  6. returns the new global arrays with the round's metrics: aggregation seconds,
     parameters and bytes actually sent and received (``ledger.py``), train loss, counts
     of failed / rejected / screened / clipped replies and the rule's diagnostics.

Its other parts, each in its own module: the rank router (``rank_router.py``: each node's
rank, learnt from its replies, and the state of its rank it is sent), the node -> partition
ledger (``participation.py``), the clients' own evaluation (``client_evaluation.py``), the
run state for checkpoints and resume (``run_state.py``), the sampling (``client_sampling.py``).

Central differential privacy (``dp=central``, docs/privacy.md): with ``dp``, a ``CentralDP``,
steps 4 and 5 become the method's mechanism (``Method.aggregate_private``): each kept
client's contribution (adapter and head jointly) is clipped to C and the sum gets Gaussian
noise, divided by m = the number of clients sampled in the round (a client that failed or
was rejected counts as one that did not move; with Poisson sampling q N), then
post-processed by the method's rule; no screening (``ReplyGate.turn_off_screening_for_dp``).
Each row has ``dp-epsilon``; the ledger goes into the checkpoint. ``dp=example``: the
clients' epsilons, example_dp.py.

The strategy never names a method: it reads the rule, the mechanism and the flags from the
method it is built with (``MethodRules``). A method whose round needs more (FLoRG's
batched step and per-rank factors, a residual sent with each message) subclasses it in its
own folder.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Protocol

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg

from flower_app.wire.ranks import truncate_to_rank
from flower_app.wire.records import declared_params, split_state, to_array_record
from strategies.server.buffered_rounds import BufferedRounds
from strategies.server.buffered_update import AsyncSettings
from strategies.server.central_dp import CentralDP, check_strategy_dp
from strategies.server.client_evaluation import personalised_metrics
from strategies.server.client_sampling import SampledRounds
from strategies.server.encoded_messages import EncodedMessages
from strategies.server.example_dp import ExampleDpRecord
from strategies.server.ledger import CommunicationLedger
from strategies.server.participation import NodeLedger
from strategies.server.rank_router import RankRouter
from strategies.server.replies import Reply, ReplyRejected, train_time_metrics
from strategies.server.reply_gate import ReplyGate
from strategies.server.run_state import CheckpointedRounds
from strategies.server.saved_updates import save_round_updates
from strategies.server.screening import DEFAULT_KAPPA
from strategies.shared.averaging import weighted_average
from strategies.shared.validation import normalize_weights


class MethodRules(Protocol):
    """What the strategy reads from the method that builds it (a
    ``strategies.shared.base_method.BaseMethod``; the strategy never imports it, so the
    dependency runs method -> strategy)."""

    name: str
    heterogeneous_ranks: bool

    def check_dp_supported(self) -> str: ...

    def uplink(
        self, state: Mapping[str, np.ndarray], server_round: int
    ) -> Mapping[str, np.ndarray]: ...

    def aggregate(
        self,
        sent: Mapping[str, np.ndarray],
        payloads: list[dict[str, np.ndarray]],
        weights: np.ndarray,
    ) -> tuple[dict[str, np.ndarray], dict[str, float]]: ...

    def aggregate_private(
        self,
        dp: CentralDP,
        sent: Mapping[str, np.ndarray],
        payloads: list[dict[str, np.ndarray]],
        num_sampled: float,
    ) -> tuple[dict[str, np.ndarray], dict[str, float]]: ...


log = logging.getLogger("flwr.florg")  # propagates to Flower's console handler


class AdapterStrategy(BufferedRounds, CheckpointedRounds, EncodedMessages, SampledRounds, FedAvg):
    """FedAvg's sampling plus validated, method-specific aggregation of adapter arrays."""

    def __init__(
        self,
        initial_state: Mapping[str, np.ndarray],
        *,
        method: MethodRules,
        fraction_train: float = 1.0,
        min_train_nodes: int = 2,
        min_available_nodes: int = 2,
        weighting: str = "uniform",
        clients_evaluate: bool = False,
        updates_dir: str | Path | None = None,
        screen_updates: bool = True,
        screen_kappa: float = DEFAULT_KAPPA,
        dp: CentralDP | None = None,
        example_dp: ExampleDpRecord | None = None,
        client_sampling: str = "fixed",
        sampling_seed: int | None = None,
        uplink_encoding: str = "fp32",
        downlink_encoding: str = "fp32",
        encoding_seed: int = 0,
        async_rounds: AsyncSettings | None = None,
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
        # the method's rule, DP mechanism and flags (heterogeneous ranks, DP): never its name
        self.method = method
        self.weighting = weighting
        self.gate = ReplyGate(screen_updates=screen_updates, screen_kappa=screen_kappa)
        self.dp, self.example_dp = dp, example_dp  # example_dp: dp=example's record
        self.use_sampling(client_sampling, fraction_train, sampling_seed, dp)
        if dp is not None:
            check_strategy_dp(self.method, dp, weighting, updates_dir)
            self.gate.turn_off_screening_for_dp()
        self.global_state: dict[str, np.ndarray] = {
            k: np.asarray(v, np.float64) for k, v in initial_state.items()
        }
        self.updates_dir = Path(updates_dir) if updates_dir else None
        self.use_encodings(uplink_encoding, downlink_encoding, encoding_seed)
        self.round_metrics: dict[int, dict[str, float]] = {}
        if dp is not None or example_dp is not None:  # the initial state is public
            self.round_metrics[0] = example_dp.metrics() if example_dp else {"dp-epsilon": 0.0}
        self.communication = CommunicationLedger()  # parameters sent and received
        self.ledger = NodeLedger()  # node id -> partition id; lost nodes per round
        self.router = RankRouter(self.global_state)  # each node's rank; r_max
        self.use_async_rounds(async_rounds)  # round-mode=async (buffered_rounds.py)

    @property
    def largest_rank(self) -> int:
        """r_max: the global state's rank."""
        return self.router.largest_rank

    # -- sending ------------------------------------------------------------------------
    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        messages = [
            self.extend_train_message(server_round, self.at_node_rank(server_round, m))
            for m in super().configure_train(server_round, arrays, config, grid)
        ]
        self.communication.record_sent(server_round, messages)  # parameters and fp32 bytes
        if self.encode_for(messages, server_round):
            self.communication.record_wire(server_round, messages)  # the bytes, encoded
        self.ledger.sent(server_round, messages)
        return messages

    def extend_train_message(self, server_round: int, message: Message) -> Message:
        """Hook for methods that send more than the global arrays."""
        return message

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """FedAvg's, each node sent the state of its own rank."""
        return [
            self.at_node_rank(None, m)
            for m in super().configure_evaluate(server_round, arrays, config, grid)
        ]

    # -- clients of different rank (rank_router.py) ----------------------------------------
    def sent_state(self, rank: int) -> dict[str, np.ndarray]:
        """The state a node of ``rank`` is sent: the global state's top ``rank`` rows of
        every A and columns of every B (FLoRG overrides it: a factor of its own)."""
        return truncate_to_rank(self.global_state, rank)

    def at_node_rank(self, server_round: int | None, message: Message) -> Message:
        """``message`` with the state of its node's rank (``RankRouter.route``)."""
        return self.router.route(server_round, message, self.sent_state)

    # -- receiving ----------------------------------------------------------------------
    def uplink_state(self, server_round: int | None) -> Mapping[str, np.ndarray]:
        """What the clients send back in ``server_round``: the global state's head and the
        adapter parts the method trains that round (``Method.trained_parts``; every part
        for most methods, then the global state itself)."""
        if server_round is None:
            return self.global_state
        return self.method.uplink(self.global_state, server_round)

    def check_reply(self, message: Message, server_round: int | None = None) -> Reply:
        """The checked reply to round ``server_round``, or ReplyRejected with the reason
        (``ReplyGate.check``)."""
        return self.gate.check(
            message,
            self.uplink_state(server_round),
            self.router,
            method_name=self.method.name,
            heterogeneous=self.method.heterogeneous_ranks,
            private=self.dp is not None,
        )

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        replies = list(replies)
        traffic = self.communication.bytes_metrics(server_round, replies)  # as they travelled
        for msg in replies:  # uplink-encoding: decoded before anything reads the arrays
            self.decode(msg)
        nodes = self.ledger.settle(server_round, replies)
        checked: list[Reply] = []
        failures = rejected = up_params = 0
        for msg in replies:
            node = msg.metadata.src_node_id
            if msg.has_error():
                failures += 1
                log.warning(
                    "round %d: node %s (partition %s) failed, reply dropped: %s",
                    server_round, node, self.ledger.partition_of(node), msg.error.reason,
                )  # fmt: skip
                continue
            up_params += declared_params(msg.content)
            try:
                reply = self.check_reply(msg, server_round)
                checked.append(reply)
                self.router.learn(reply)
            except ReplyRejected as err:
                rejected += 1
                log.warning(
                    "round %d: rejected update from partition %s (node %s): %s",
                    server_round, self.ledger.partition_of(node), node, err,
                )  # fmt: skip
        example_dp = self.example_dp.observe(server_round, replies) if self.example_dp else {}
        node_metrics = {**nodes.metrics(), **example_dp, **train_time_metrics(replies)}
        return self.aggregate_replies(
            server_round,
            checked,
            failures=failures,
            rejected=rejected,
            up_params=up_params,
            node_metrics={**node_metrics, **traffic},
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
        mixed = self.router.is_mixed(server_round, checked)
        stale = any(r.staleness for r in checked)  # round-mode=async: from older models
        starts = (
            [self.router.start_state(server_round, r, self.sent_state) for r in checked]
            if mixed
            else [dict(r.start) for r in checked] if stale else None
        )  # fmt: skip
        uplink = self.uplink_state(server_round)
        kept, sizes, screening = self.gate.screen(server_round, checked, uplink, starts)
        metrics: dict[str, float] = {
            "clients": len(kept),
            "failures": failures,
            "rejected": rejected,
            **screening,
            "up-params": up_params,
            "down-params": self.communication.down(server_round),
            **(node_metrics or {}),
        }
        if mixed:
            metrics.update(self.communication.per_rank(checked))
        metrics.update(self.sampling_metrics(server_round))
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
            if any(r.staleness for r in kept):  # buffered_rounds.py: deltas from their starts
                new_state, info = self.aggregate_buffered(server_round, kept, weights)
            else:
                new_state, info = self.aggregate_adapter(server_round, payloads, weights)
                for key in self.head_keys():
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
            save_round_updates(self.updates_dir, server_round, prev_state, new_state,
                               payloads, weights, partitions)  # fmt: skip
        return to_array_record(new_state), MetricRecord(metrics)

    def aggregate_adapter(
        self, server_round: int, payloads: list[dict[str, np.ndarray]], weights: np.ndarray
    ) -> tuple[dict[str, np.ndarray], dict[str, float]]:
        """The method's rule over the adapter arrays (the head is FedAvg'd by the caller)."""
        return self.method.aggregate(self.global_state, payloads, weights)

    # -- central differential privacy (docs/privacy.md) -----------------------------------
    # Why not Flower's DifferentialPrivacyServerSideFixedClipping: it wraps a strategy's
    # aggregate_train and noises its OUTPUT, which for the SVD and Gram rules is a non-linear
    # function of the replies (an SVD, an eigendecomposition and Procrustes), so the noise
    # would not be the Gaussian mechanism on a statistic of bounded sensitivity; it would
    # also clip before this strategy's reply checks, and its accounted mode accepts only
    # FedAvg.aggregate_train. For the mean methods our mechanism equals it in distribution
    # (tests/runtime/test_dp.py); strategies/server/central_dp.py's docstring lists why its helpers
    # are not called.
    def release_private(
        self, server_round: int, payloads: list[dict[str, np.ndarray]]
    ) -> tuple[dict[str, np.ndarray], dict[str, float]]:
        """One round under dp=central: the method's mechanism over the kept replies, the
        round recorded by the accountant. With no reply kept the mechanism still releases
        (the sent state plus noise: as if one client had not moved), so that whether a round
        is released never depends on the clients' data."""
        assert self.dp is not None
        m, sampled = self.private_divisor(server_round, len(payloads))  # q N: Poisson sampling
        if not payloads:
            log.warning("round %d: no valid client update; dp=central releases noise only",
                        server_round)  # fmt: skip
        new_state, info = self.aggregate_private(
            server_round, payloads or [dict(self.uplink_state(server_round))], m
        )
        info = {**info, **sampled, **self.dp.release()}
        return new_state, info

    def aggregate_private(
        self, server_round: int, payloads: list[dict[str, np.ndarray]], num_sampled: float
    ) -> tuple[dict[str, np.ndarray], dict[str, float]]:
        """The method's central-DP mechanism (``Method.aggregate_private``) over the kept
        replies, m = ``num_sampled`` (or q N); returns the whole new state."""
        assert self.dp is not None
        return self.method.aggregate_private(self.dp, self.global_state, payloads, num_sampled)

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        """The clients' own (personalised) evaluation (``client_evaluation.py``)."""
        result = personalised_metrics(server_round, replies)
        if result is None:
            return None
        self.round_metrics.setdefault(server_round, {}).update(result)
        return MetricRecord(result)

    # -- helpers for subclasses -----------------------------------------------------------
    def layers(self) -> dict[str, dict[str, np.ndarray]]:
        return split_state(self.global_state)[0]

    def head_keys(self) -> list[str]:
        """The task head's keys (every method FedAvgs them)."""
        return list(split_state(self.global_state)[1])
