"""AdapterStrategy: the Flower Message-API strategy every method runs (or extends in its folder).

FedAvg's sampling and round loop; ``aggregate_train`` drops failed replies, checks each reply
(``replies.py``), screens the rest, weights them in partition order, runs the method's rule
or, under ``dp=central``, its mechanism, FedAvgs the task head and returns the new arrays with
the round's metrics (docs/architecture.md); it never names a method: it reads ``MethodRules``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg, Result

from flower_app.wire.ranks import truncate_to_rank
from flower_app.wire.records import declared_params, split_state, to_array_record
from strategies.server.buffered_rounds import BufferedRounds
from strategies.server.buffered_update import AsyncSettings, mean_buffered_step
from strategies.server.central_dp import CentralDP, check_strategy_dp, release_private
from strategies.server.client_evaluation import personalised_metrics
from strategies.server.client_sampling import ClientSampling
from strategies.server.encoded_messages import MessageEncodings
from strategies.server.example_dp import ExampleDpRecord
from strategies.server.ledger import CommunicationLedger, NodeLedger
from strategies.server.method_rules import MethodRules
from strategies.server.overselected_rounds import OverselectedRounds, OverselectSettings
from strategies.server.product_gap import gap_metrics
from strategies.server.rank_router import RankRouter
from strategies.server.replies import (
    DEFAULT_KAPPA,
    Reply,
    ReplyGate,
    ReplyRejected,
    train_time_metrics,
)
from strategies.server.run_state import restore, resume_rounds, state_arrays, state_json
from strategies.server.saved_updates import save_round_updates
from strategies.server.secure_rounds import SecureRounds, SecureRoundSettings
from strategies.server.virtual_clock import ClockSettings, clock_for
from strategies.shared.averaging import weighted_average
from strategies.shared.validation import normalize_weights

log = logging.getLogger("flwr.florg")  # propagates to Flower's console handler


class AdapterStrategy(FedAvg):
    """FedAvg's sampling plus validated, method-specific aggregation of adapter arrays.

    Its parts are members it calls: ``encodings`` (``MessageEncodings``), ``sampling``
    (``ClientSampling``), ``gate`` (``ReplyGate``), ``router`` (``RankRouter``), ``ledger``
    (``NodeLedger``), ``communication`` (``CommunicationLedger``), ``dp`` / ``example_dp``,
    ``round_loop`` (async's ``BufferedRounds``, sync-overselect's ``OverselectedRounds``,
    secure aggregation's ``SecureRounds``)."""

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
        overselected_rounds: OverselectSettings | None = None,
        secure: SecureRoundSettings | None = None,
        virtual_clock: ClockSettings | None = None,
        product_gap: bool = False,
    ) -> None:
        super().__init__(
            fraction_train=fraction_train,
            fraction_evaluate=1.0,  # set below: FedAvg warns about a 0.0 given here
            min_train_nodes=min_train_nodes,
            min_evaluate_nodes=min_train_nodes if clients_evaluate else 0,
            min_available_nodes=min_available_nodes,
        )
        # 0.0: no client evaluates (the server evaluates centrally every round)
        self.fraction_evaluate = 1.0 if clients_evaluate else 0.0
        if weighting not in ("uniform", "num-examples"):
            raise ValueError(f"weighting must be 'uniform' or 'num-examples', got {weighting!r}")
        # the method's rule, DP mechanism and flags (heterogeneous ranks, DP): never its name
        self.method = method
        self.weighting, self.product_gap = weighting, product_gap  # product_gap.py's rows
        self.gate = ReplyGate(screen_updates=screen_updates, screen_kappa=screen_kappa)
        self.dp, self.example_dp = dp, example_dp  # example_dp: dp=example's record
        self.sampling = ClientSampling(client_sampling, fraction_train, sampling_seed, dp)
        if dp is not None:
            check_strategy_dp(self.method, dp, weighting, updates_dir)
            self.gate.turn_off_screening_for_dp()
        self.global_state: dict[str, np.ndarray] = {
            k: np.asarray(v, np.float64) for k, v in initial_state.items()
        }
        self.updates_dir = Path(updates_dir) if updates_dir else None
        self.encodings = MessageEncodings(uplink_encoding, downlink_encoding, encoding_seed)
        self.round_metrics: dict[int, dict[str, float]] = {}
        if dp is not None or example_dp is not None:  # the initial state is public
            self.round_metrics[0] = example_dp.metrics() if example_dp else {"dp-epsilon": 0.0}
        self.communication = CommunicationLedger()  # parameters sent and received
        self.ledger = NodeLedger()  # node id -> partition id; lost nodes per round
        self.router = RankRouter(self.global_state)  # each node's rank; r_max
        self.clock = clock_for(virtual_clock, self)  # virtual-clock (None: off); loops read it
        self.round_loop: BufferedRounds | OverselectedRounds | SecureRounds | None = None
        if async_rounds is not None:  # round-mode=async's loop (checkpointed: run_state.py)
            self.round_loop = BufferedRounds(self, async_rounds)
        elif overselected_rounds is not None:  # round-mode=sync-overselect's
            self.round_loop = OverselectedRounds(self, overselected_rounds)
        elif secure is not None:  # secure-aggregation=secaggplus's
            self.round_loop = SecureRounds(self, secure)

    # -- the loop -----------------------------------------------------------------------
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
        """Flower's ``Strategy.start``, resumed (``resume_rounds``) or the mode's own loop."""
        if self.round_loop is not None:
            train = ConfigRecord() if train_config is None else train_config
            return self.round_loop.start(
                grid, initial_arrays, num_rounds, timeout, train, evaluate_fn, max(first_round, 1)
            )
        if first_round <= 1:
            return super().start(grid=grid, initial_arrays=initial_arrays,
                                 num_rounds=num_rounds, timeout=timeout,
                                 train_config=train_config, evaluate_config=evaluate_config,
                                 evaluate_fn=evaluate_fn)  # fmt: skip
        return resume_rounds(self, grid, initial_arrays, num_rounds, timeout, train_config,
                             evaluate_config, evaluate_fn, first_round)  # fmt: skip

    # -- sending ------------------------------------------------------------------------
    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """The round's training messages to FedAvg's sample or the Poisson sample
        (``ClientSampling``), each at its node's rank with what the method adds, encoded by
        ``downlink-encoding``."""
        if self.sampling.sampler is None:
            sampled = super().configure_train(server_round, arrays, config, grid)
        else:
            sampled = self.sampling.poisson_messages(self, server_round, arrays, config, grid)
        messages = [
            self.extend_train_message(server_round, self.at_node_rank(server_round, m))
            for m in sampled
        ]
        self.communication.record_sent(server_round, messages)  # parameters and fp32 bytes
        if self.encodings.encode(messages, server_round):
            self.communication.record_wire(server_round, messages)  # the bytes, encoded
        if self.clock is not None:  # virtual-clock: each task's duration
            self.clock.sync_round(grid, server_round, messages)
        self.ledger.sent(server_round, messages)
        return messages

    def extend_train_message(self, server_round: int, message: Message) -> Message:
        """Hook for methods that send more than the global arrays."""
        return message

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """FedAvg's, each node sent the state of its own rank."""
        sent = super().configure_evaluate(server_round, arrays, config, grid)
        return [self.at_node_rank(None, m) for m in sent]

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
        return self.gate.check(message, self.uplink_state(server_round), self.router,
                               method_name=self.method.name, private=self.dp is not None,
                               heterogeneous=self.method.heterogeneous_ranks)  # fmt: skip

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        replies = list(replies)
        traffic = self.communication.bytes_metrics(server_round, replies)  # as they travelled
        for msg in replies:  # uplink-encoding: decoded before anything reads the arrays
            self.encodings.decode(msg)
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
        node_metrics |= self.clock.sync_close(server_round, replies) if self.clock else {}
        return self.aggregate_replies(
            server_round, checked, failures=failures, rejected=rejected, up_params=up_params,
            node_metrics={**node_metrics, **traffic},
        )  # fmt: skip

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
        metrics.update(self.sampling.metrics(server_round))
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
            # deltas from their starts (buffered_update.py), also when η_g != 1 steps them
            if any(r.staleness for r in kept) or self.server_lr != 1.0:
                new_state, info = self.aggregate_buffered(server_round, kept, weights)
            else:
                new_state, info = self.aggregate_adapter(server_round, payloads, weights)
                info |= gap_metrics(self, payloads, weights, new_state) if self.product_gap else {}
                for key in self.head_keys():
                    new_state[key] = weighted_average([p[key] for p in payloads], weights, key)
        else:
            new_state, info = release_private(self, server_round, payloads)
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

    @property
    def staleness_exponent(self) -> float:
        """a of the staleness factor (1 + τ)^-a (``async-staleness-exponent``; 0 in sync)."""
        return self.round_loop.settings.staleness_exponent if self.round_loop else 0.0

    @property
    def server_lr(self) -> float:
        """η_g, FedBuff's server rate (``async-server-lr``; 1 in a synchronous run)."""
        return self.round_loop.settings.server_lr if self.round_loop else 1.0

    def aggregate_buffered(
        self, server_round: int, kept: list[Reply], weights: np.ndarray
    ) -> tuple[dict[str, np.ndarray], dict[str, float]]:
        """FedBuff's x_t + η_g Σ wₙ cₙ (xₙ − x_vₙ) ('mean' methods: ``mean_buffered_step``)."""
        return mean_buffered_step(self, server_round, kept, weights)

    # -- central DP (docs/privacy.md: also why not Flower's server-side DP wrapper) --------
    def private_divisor(self, server_round: int, replies: int) -> tuple[float, dict[str, float]]:
        """m of dp=central's noised mean and its metrics: the nodes sent a message (at least
        the ``replies``), or q N under Poisson sampling (``ClientSampling.private_divisor``)."""
        sent = self.communication.num_sampled(server_round, replies)
        return self.sampling.private_divisor(server_round, sent)

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

    # -- checkpoints (flower_app/run_output/checkpoint.py; run_state.py) --------------------
    def state_arrays(self) -> dict[str, np.ndarray]:
        """Arrays needed to continue (``run_state.state_arrays``; a method extends it)."""
        return state_arrays(self)

    def state_json(self) -> dict[str, Any]:
        """JSON state needed to continue (``run_state.state_json``)."""
        return state_json(self)

    def restore(self, arrays: Mapping[str, np.ndarray], state: Mapping[str, Any]) -> None:
        """Continue from ``state_arrays`` / ``state_json`` of a checkpoint."""
        restore(self, arrays, state)

    # -- helpers for subclasses -----------------------------------------------------------
    def layers(self) -> dict[str, dict[str, np.ndarray]]:
        """The adapter's arrays by layer."""
        return split_state(self.global_state)[0]

    def head_keys(self) -> list[str]:
        """The task head's keys (every method FedAvgs them)."""
        return list(split_state(self.global_state)[1])
