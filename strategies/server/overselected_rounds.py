"""Synchronous rounds with over-selection and a deadline (``round-mode=sync-overselect``).

Production cross-device rounds (Bonawitz et al., "Towards Federated Learning at Scale",
MLSys 2019) on Flower's Message API: a round sends the current model to ceil(K (1 + f))
idle nodes (K: FedAvg's sample size, f: ``overselect-fraction``), closes at its first K
replies that pass the checks or at ``round-deadline``, and applies the synchronous step over
those it kept (``aggregate_replies``: each trained from the round's model). Replies pulled
in one poll are taken in partition order, so which K are kept is never a race. A reply
that comes after its round closed is discarded and counted; its node is sent no task while
it still trains one. ``OverselectedRounds`` runs the loop and checkpoints it; settings and
rows: docs/async.md.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, ClassVar

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.common.logger import log as flwr_log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result
from flwr.serverapp.strategy.strategy_utils import sample_nodes

from flower_app.wire.deployment_bytes import wire_bytes
from flower_app.wire.records import declared_params, to_array_record
from strategies.server.ledger import traffic_metrics
from strategies.server.replies import Reply, ReplyRejected, train_time_metrics
from strategies.server.virtual_clock import VirtualClock, clocked_idle, clocked_round

log = logging.getLogger("flwr.florg")
POLL_SECONDS = 0.2  # how often the server asks the SuperLink for replies
MODE = "round-mode=sync-overselect"


@dataclass(frozen=True)
class OverselectSettings:
    """``round-mode=sync-overselect``'s settings (flower_app/settings/rounds.py), resolved."""

    fraction: float = 0.3  # f: a round sends ceil(K (1 + f)) tasks
    deadline: float = 0.0  # seconds after the round's tasks are sent; 0: none
    seed: int = 0  # which idle nodes a round's tasks go to
    # every kept reply trained from the round's model: the strategy's synchronous step, as
    # ``AdapterStrategy.server_lr`` / ``staleness_exponent`` read them off the loop it holds
    server_lr: ClassVar[float] = 1.0
    staleness_exponent: ClassVar[float] = 0.0


def round_sizes(
    connected: int, fraction_train: float, min_train_nodes: int, fraction: float
) -> tuple[int, int]:
    """(K, the tasks a round sends): K = FedAvg's sample size max(int(N fraction-train),
    min-train-nodes) and ceil(K (1 + f)), each at most the N ``connected`` nodes; f is read
    as the decimal it was written as (10 × (1 + 0.3) is 13, not the float's 13.000…02)."""
    k = min(max(int(connected * fraction_train), min_train_nodes), connected)
    return k, min(math.ceil(k * (1 + Fraction(repr(float(fraction))))), connected)


@dataclass
class _Task:
    """A training message in flight."""

    node: int
    server_round: int
    sent_at: float


@dataclass
class _Row:
    """What happened since the last row was written: it goes into the next one."""

    sent: int = 0
    taken: list[Message] = field(default_factory=list)  # this round's replies it looked at
    received: list[Message] = field(default_factory=list)  # every reply pulled
    up_bytes: list[int] = field(default_factory=list)  # each pulled reply's, as it travelled
    partitions: list[int] = field(default_factory=list)  # of the nodes in ``taken``
    lost: list[int] = field(default_factory=list)  # partitions of the nodes timed out
    failures: int = 0
    rejected: int = 0
    up_params: int = 0
    late: int = 0
    deadline_hit: int = 0
    lost_in_flight: int = 0


class OverselectedRounds:
    """The over-selected synchronous loop, held by the common strategy (``strategy``, as
    ``round_loop``: run_state checkpoints it) as ``BufferedRounds`` is: it sends through
    the strategy's hooks (``extend_train_message``, ``at_node_rank``, its encodings and
    ledgers), checks replies with ``check_reply`` and applies each round's with
    ``aggregate_replies``; it keeps what is in flight and the generator picking the nodes.
    A strategy with an ``aggregate_train`` of its own is refused: the loop never runs it."""

    def __init__(self, strategy: Any, settings: OverselectSettings) -> None:
        # by name: the common strategy imports this module, which must not import it back
        if type(strategy).aggregate_train.__qualname__ != "AdapterStrategy.aggregate_train":
            raise ValueError(
                f"{MODE}: {type(strategy).__name__} reads each round's replies in an "
                "aggregate_train of its own, which this loop does not run (it checks each "
                "reply as it arrives); use round-mode=sync"
            )
        self.strategy = strategy
        self.settings = settings
        self.in_flight: dict[str, _Task] = {}
        self.pick_rng: np.random.Generator | None = None  # picks the idle nodes to train
        self.clock: VirtualClock | None = getattr(strategy, "clock", None)  # virtual-clock
        self.lost_in_flight = 0  # set by ``load_state_json``: tasks out at the checkpoint

    # -- the loop ----------------------------------------------------------------------
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
        """Run rounds ``first_round`` .. ``num_rounds`` (module docstring)."""
        result = Result()
        arrays = initial_arrays
        if first_round <= 1 and evaluate_fn is not None:
            res = evaluate_fn(0, arrays)
            if res is not None:
                result.evaluate_metrics_serverapp[0] = res
        if self.pick_rng is None:  # else restored from a checkpoint
            self.pick_rng = np.random.default_rng(self.settings.seed)
        row = _Row(lost_in_flight=self.lost_in_flight)
        for server_round in range(first_round, num_rounds + 1):
            flwr_log(logging.INFO, "[ROUND %s/%s]", server_round, num_rounds)
            kept = self._round(grid, server_round, timeout, train_config, row)
            if kept is None:
                log.error(
                    "%s: no node could be sent round %d's tasks for %.0f s (timeout); the "
                    "run stops after %d of %d rounds",
                    MODE, server_round, timeout, server_round - 1, num_rounds,
                )  # fmt: skip
                break
            new_arrays, metrics = self._close(server_round, kept, row)
            row = _Row()
            if new_arrays is not None:
                arrays = new_arrays
                result.arrays = arrays
            result.train_metrics_clientapp[server_round] = metrics
            if evaluate_fn is not None:
                res = evaluate_fn(server_round, arrays)
                if res is not None:
                    result.evaluate_metrics_serverapp[server_round] = res
        if self.in_flight:
            flwr_log(
                logging.INFO,
                "%s: %d training messages still in flight after the last round are not "
                "waited for",
                MODE, len(self.in_flight),
            )  # fmt: skip
        return result

    def _round(
        self, grid: Grid, server_round: int, timeout: float, train_config: ConfigRecord, row: _Row
    ) -> list[tuple[Message, Reply]] | None:
        """Send the round's tasks, then take replies until it closes: at its K-th kept reply,
        at the deadline, or when none of its tasks is left in flight (failed, rejected, timed
        out). The kept replies; None when no node was idle within ``timeout``."""
        strategy = self.strategy
        _, nodes = sample_nodes(grid, strategy.min_available_nodes, 0)  # waits for them
        k, target = round_sizes(
            len(nodes), strategy.fraction_train, strategy.min_train_nodes, self.settings.fraction
        )
        idle = self._idle_nodes(grid, timeout, row)
        if not idle:
            return None
        self._send(grid, server_round, idle, target, train_config, row)
        flwr_log(
            logging.INFO,
            "%s: round %d sent to %d nodes, keeps the first %d replies%s",
            MODE, server_round, row.sent, k,
            f" or those in by {self.settings.deadline:g} s" if self.settings.deadline else "",
        )  # fmt: skip
        if self.clock is not None:  # in virtual finish order, the deadline virtual seconds
            return clocked_round(self, grid, server_round, k, timeout, POLL_SECONDS, row)
        kept: list[tuple[Message, Reply]] = []
        deadline, started = self.settings.deadline, time.monotonic()
        while True:
            self._take(self._pull(grid), server_round, k, kept, row)
            self._expire(timeout, row)
            if len(kept) >= k:
                break
            elapsed = time.monotonic() - started
            if deadline and elapsed >= deadline:
                row.deadline_hit = 1
                log.warning(
                    "%s: round %d closed at its deadline (%g s) with %d of %d replies",
                    MODE, server_round, deadline, len(kept), k,
                )  # fmt: skip
                break
            if not any(task.server_round == server_round for task in self.in_flight.values()):
                break  # no reply of this round is still to come
            # the last poll falls on the deadline: what arrived by then is kept
            time.sleep(min(POLL_SECONDS, deadline - elapsed) if deadline else POLL_SECONDS)
        return kept

    def _pull(self, grid: Grid) -> list[Message]:
        return list(grid.pull_messages(list(self.in_flight))) if self.in_flight else []

    def _idle_nodes(self, grid: Grid, timeout: float, row: _Row) -> list[int]:
        """The connected nodes not training a task of an earlier round (its reply pulled and
        discarded first, if in); none for ``timeout``: []."""
        if self.clock is not None:  # the late replies taken in virtual finish order
            return clocked_idle(self, grid, timeout, POLL_SECONDS, row)
        waited = time.monotonic()
        while True:
            self._take(self._pull(grid), 0, 0, [], row)  # earlier rounds' replies only
            self._expire(timeout, row)
            busy = {task.node for task in self.in_flight.values()}
            idle = sorted(node for node in grid.get_node_ids() if node not in busy)
            if idle or time.monotonic() - waited > timeout:
                return idle
            time.sleep(POLL_SECONDS)

    def _send(
        self,
        grid: Grid,
        server_round: int,
        idle: list[int],
        target: int,
        train_config: ConfigRecord,
        row: _Row,
    ) -> None:
        """The current model to ``target`` of the ``idle`` nodes (all of them if fewer), as
        ``configure_train`` builds, records and encodes a round's training messages."""
        strategy = self.strategy
        assert self.pick_rng is not None
        # by index: node ids are unsigned 64-bit, which numpy would turn into floats
        picks = self.pick_rng.choice(len(idle), size=min(target, len(idle)), replace=False)
        chosen = sorted(idle[int(i)] for i in picks)
        arrays = to_array_record(strategy.global_state)
        config = ConfigRecord({**dict(train_config), "server-round": server_round})
        messages = []
        for node in chosen:
            message = Message(
                RecordDict({"arrays": arrays, "config": config}),
                dst_node_id=node,
                message_type=MessageType.TRAIN,
            )
            message = strategy.extend_train_message(server_round, message)
            messages.append(strategy.at_node_rank(server_round, message))
        strategy.communication.record_sent(server_round, messages)  # parameters and fp32 bytes
        if strategy.encodings.encode(messages, server_round):
            strategy.communication.record_wire(server_round, messages)  # the bytes, encoded
        clock = self.clock  # virtual-clock: the tasks' durations (profiles learnt first)
        seconds = clock.durations(grid, messages, server_round) if clock else []
        now, ids = time.monotonic(), list(grid.push_messages(messages))
        for message_id, message in zip(ids, messages, strict=True):
            self.in_flight[message_id] = _Task(message.metadata.dst_node_id, server_round, now)
        if clock is not None:  # each task finishes on the virtual clock, sent at its now
            clock.start(ids, messages, seconds)
        row.sent = len(messages)

    def _take(
        self,
        arrived: list[Message],
        server_round: int,
        k: int,
        kept: list[tuple[Message, Reply]],
        row: _Row,
    ) -> None:
        """Take the replies pulled in one poll: those to round ``server_round``'s tasks in
        partition order, checked and kept until ``kept`` holds ``k``; the rest (an earlier
        round's, or beyond the K-th) discarded and counted as ``late-discarded``."""
        ledger = self.strategy.ledger
        found = [
            (task, msg) for msg in arrived
            if (task := self.in_flight.pop(msg.metadata.reply_to_message_id, None)) is not None
        ]  # fmt: skip
        ledger.learn([msg for _, msg in found])
        # partition order, as aggregate_replies orders replies: when several arrive in one
        # poll, which of them make the K never depends on the order the SuperLink returns
        found.sort(key=lambda pair: (ledger.partition_of(pair[0].node), pair[0].node))
        for task, msg in found:
            # its bytes as the ledger counts a reply (a sync row's), before it is decoded
            row.up_bytes.append(wire_bytes(msg))
            row.received.append(msg)
            if task.server_round == server_round and len(kept) < k:
                reply = self._check(msg, task, row)
                if reply is not None:
                    kept.append((msg, reply))
                continue
            row.late += 1
            if not msg.has_error():
                row.up_params += declared_params(msg.content)  # it travelled all the same
            log.info(
                "%s: the reply of node %s (partition %s) to round %d came after the round "
                "closed; discarded",
                MODE, task.node, ledger.partition_of(task.node), task.server_round,
            )  # fmt: skip

    def _check(self, msg: Message, task: _Task, row: _Row) -> Reply | None:
        """A reply to the open round, decoded (``uplink-encoding``) and checked as
        ``aggregate_train`` checks one; None, counted, when it failed or was rejected."""
        strategy = self.strategy
        partition = strategy.ledger.partition_of(task.node)
        row.taken.append(msg)
        if int(msg.metadata.src_node_id) == task.node:
            row.partitions.append(partition)
        else:  # the SuperLink answered for the node (it left): lost, as in a sync round
            row.lost.append(partition)
        strategy.encodings.decode(msg)
        where = f"node {task.node} (partition {partition})"
        if msg.has_error():
            row.failures += 1
            log.warning("%s: %s failed, reply dropped: %s", MODE, where, msg.error.reason)
            return None
        row.up_params += declared_params(msg.content)
        try:
            reply = strategy.check_reply(msg, task.server_round)
        except ReplyRejected as err:
            row.rejected += 1
            log.warning("%s: rejected update from %s: %s", MODE, where, err)
            return None
        strategy.router.learn(reply)
        return reply

    def _expire(self, timeout: float, row: _Row) -> None:
        """Tasks older than ``timeout`` are lost: the node is free again."""
        now = time.monotonic()
        for message_id, task in list(self.in_flight.items()):
            if now - task.sent_at > timeout and not (self.clock and self.clock.is_held(message_id)):
                del self.in_flight[message_id]
                row.lost.append(self.strategy.ledger.partition_of(task.node))
                log.warning(
                    "%s: node %s (partition %s) sent no reply in %.0f s; lost",
                    MODE, task.node, self.strategy.ledger.partition_of(task.node), timeout,
                )  # fmt: skip

    def _close(
        self, server_round: int, kept: list[tuple[Message, Reply]], row: _Row
    ) -> tuple[ArrayRecord | None, MetricRecord]:
        """The synchronous step over the kept replies (``aggregate_replies``; none kept: the
        model unchanged) with the row's metrics, a synchronous round's and this loop's."""
        strategy = self.strategy
        record = strategy.example_dp  # dp=example: the clients' epsilons, discarded ones too
        example_dp = record.observe(server_round, row.received) if record else {}
        down = strategy.communication.down_bytes.get(server_round, [])
        node_metrics: dict[str, Any] = {
            "partitions": sorted(row.partitions),
            "lost-partitions": sorted(row.lost),
            "lost-nodes": len(row.lost),
            "sent": row.sent,
            "kept": len(kept),
            "late-discarded": row.late,
            "deadline-hit": row.deadline_hit,
            **({"lost-in-flight": row.lost_in_flight} if row.lost_in_flight else {}),
            **example_dp,
            **train_time_metrics(row.taken),
            **traffic_metrics(down, row.up_bytes),
            **(self.clock.row() if self.clock else {}),
        }
        return strategy.aggregate_replies(
            server_round,
            [reply for _, reply in kept],
            failures=row.failures,
            rejected=row.rejected,
            up_params=row.up_params,
            node_metrics=node_metrics,
        )

    # -- checkpoints ---------------------------------------------------------------------
    def state_json(self) -> dict[str, Any]:
        """The tasks in flight (lost if the run resumes from here) and the state of the
        generator that picks the nodes."""
        state: dict[str, Any] = {"in-flight": len(self.in_flight)}
        if self.pick_rng is not None:
            state["rng"] = self.pick_rng.bit_generator.state
        return state

    def load_state_json(self, state: dict[str, Any]) -> None:
        self.lost_in_flight = int(state.get("in-flight", 0))
        if "rng" in state:
            self.pick_rng = np.random.default_rng()
            self.pick_rng.bit_generator.state = dict(state["rng"])
