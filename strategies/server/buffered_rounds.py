"""Buffered asynchronous rounds (``round-mode=async``): stragglers do not set the pace.

FedBuff's scheme (Nguyen et al., AISTATS 2022) on Flower's Message API: the server keeps
``async-concurrency`` clients training (``Grid.push_messages``), takes replies as they
arrive (``Grid.pull_messages``) and every ``async-buffer-size`` replies applies one server
update (strategies/server/buffered_update.py); a run is ``num-server-rounds`` updates, each
a row of metrics.jsonl. A reply that trained from version v and is applied at update t + 1
has staleness τ = t − v and enters scaled by (1 + τ)^-a. No node trains twice from one
model; the server keeps the last ``async-max-staleness`` versions and refuses a staler reply
(``stale-rejected``). ``BufferedRounds`` runs the loop and checkpoints it (``state_json``).
A row's keys, a buffer that cannot fill, the server round a task carries, resuming:
docs/async.md.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.common.logger import log as flwr_log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result
from flwr.serverapp.strategy.strategy_utils import sample_nodes

from flower_app.wire.deployment_bytes import wire_bytes, wire_bytes_each
from flower_app.wire.records import declared_params, record_params, to_array_record
from strategies.server.buffered_update import AsyncSettings
from strategies.server.ledger import traffic_metrics
from strategies.server.replies import Reply, ReplyRejected, train_time_metrics
from strategies.server.simulation_slots import warn_simulation_slots
from strategies.server.virtual_clock import VirtualClock

log = logging.getLogger("flwr.florg")
POLL_SECONDS = 0.2  # how often the server asks the SuperLink for replies


@dataclass
class Task:
    """A training message in flight."""

    node: int
    version: int
    sent_at: float


@dataclass
class Buffered:
    """A checked reply waiting in the buffer, with the message it came in, the version it
    trained from and who sent it (for the log)."""

    message: Message
    reply: Reply
    trained_from: int
    sender: str


class BufferedRounds:
    """The asynchronous loop, held by the common strategy (``strategy``): it sends through
    the strategy's hooks (``extend_train_message``, ``at_node_rank``, its encodings), checks
    replies with ``check_reply`` and applies each buffer with ``aggregate_replies``; it keeps
    what is in flight, each node's last round and version, and the picking generator."""

    def __init__(self, strategy: Any, settings: AsyncSettings) -> None:
        self.strategy = strategy
        self.settings = settings
        self.in_flight: dict[str, Task] = {}
        self.buffered: list[Buffered] = []  # replies received, not applied yet
        self.node_tasks: dict[int, int] = {}  # node -> the round of its last task
        self.node_versions: dict[int, int] = {}  # node -> the version its last task started
        self.pick_rng: np.random.Generator | None = None  # picks the idle nodes to train
        self.clock: VirtualClock | None = getattr(strategy, "clock", None)  # virtual-clock
        # set by ``load_state_json``: replies in flight or beyond the buffer when the
        # checkpoint was taken
        self.lost_in_flight = 0

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
        """Run updates ``first_round`` .. ``num_rounds`` (module docstring)."""
        settings = self.settings
        result = Result()
        version = first_round - 1
        arrays = initial_arrays
        if first_round <= 1 and evaluate_fn is not None:
            res = evaluate_fn(0, arrays)
            if res is not None:
                result.evaluate_metrics_serverapp[0] = res
        versions: dict[int, dict[str, np.ndarray]] = {version: dict(self.strategy.global_state)}
        if self.pick_rng is None:  # else restored from a checkpoint
            self.pick_rng = np.random.default_rng(settings.seed)
        rng = self.pick_rng
        concurrency = self._concurrency(grid, settings)
        buffer_size = settings.buffer_size or concurrency
        if buffer_size > concurrency:
            raise ValueError(
                f"async-buffer-size: {buffer_size} replies per update cannot come from the "
                f"{concurrency} clients in flight (async-concurrency, or the sample size)"
            )
        flwr_log(
            logging.INFO,
            "round-mode=async: %d clients in flight, an update every %d replies, "
            "staleness exponent %g, server rate %g, versions kept %d",
            concurrency, buffer_size, settings.staleness_exponent, settings.server_lr,
            settings.max_staleness,
        )  # fmt: skip
        warn_simulation_slots(grid, concurrency)
        pending = _Pending(lost_in_flight=self.lost_in_flight)
        self._dispatch(grid, version, concurrency, rng, train_config, pending)
        self.buffered = []
        stuck_since: float | None = None  # when the buffer got stuck empty
        while version < num_rounds:
            if self.clock is None:
                arrived = list(grid.pull_messages(list(self.in_flight)))
                self._expire(timeout, pending)
            else:  # the earliest task's reply on the virtual clock, once its real one is in
                self._expire(timeout, pending)
                arrived = [m for m in [self.clock.next_reply(grid, self.in_flight)] if m]
            for msg in arrived:
                entry = self._receive(msg, version, versions, settings, pending)
                if entry is not None:
                    self.buffered.append(entry)
            # a full buffer, or one that can fill no further: no task in flight and no node
            # left that has not trained from this version (failed and lost replies)
            stuck = not self.in_flight and not self._eligible(grid, version)
            if stuck and not self.buffered:  # nothing to apply: wait for a node
                now = time.monotonic()
                if stuck_since is None:
                    stuck_since = now
                    log.warning(
                        "round-mode=async: no node can train from version %d and no reply "
                        "is buffered; waiting up to %.0f s for one",
                        version, timeout,
                    )  # fmt: skip
                if now - stuck_since > timeout:
                    log.error(
                        "round-mode=async: no node could train from version %d for %.0f s "
                        "(timeout) and no reply is buffered; the run stops after %d of %d "
                        "updates",
                        version, timeout, version, num_rounds,
                    )  # fmt: skip
                    break
                time.sleep(POLL_SECONDS)
                continue
            stuck_since = None
            if len(self.buffered) < buffer_size and not stuck:
                if not arrived:
                    time.sleep(POLL_SECONDS)
                self._dispatch(grid, version, concurrency, rng, train_config, pending)
                continue
            taken, self.buffered = self.buffered[:buffer_size], self.buffered[buffer_size:]
            version += 1
            taken = self._with_staleness(taken, version, settings, pending)
            new_arrays, metrics = self._update(version, taken, pending)
            pending = _Pending()
            if new_arrays is not None:
                arrays = new_arrays
                result.arrays = arrays
            if metrics is not None:
                result.train_metrics_clientapp[version] = metrics
            versions[version] = dict(self.strategy.global_state)
            for old in [v for v in versions if v < version - settings.max_staleness]:
                del versions[old]
            if evaluate_fn is not None:
                res = evaluate_fn(version, arrays)
                if res is not None:
                    result.evaluate_metrics_serverapp[version] = res
            if version < num_rounds:
                self._dispatch(grid, version, concurrency, rng, train_config, pending)
        if self.in_flight:
            flwr_log(
                logging.INFO,
                "round-mode=async: %d training messages still in flight after the last "
                "update are not waited for",
                len(self.in_flight),
            )
        return result

    def _concurrency(self, grid: Grid, settings: AsyncSettings) -> int:
        """``async-concurrency``, or the synchronous sample size, once
        ``min-available-nodes`` are connected."""
        _, nodes = sample_nodes(grid, self.strategy.min_available_nodes, 0)
        strategy = self.strategy
        sync_size = max(int(len(nodes) * strategy.fraction_train), strategy.min_train_nodes)
        return settings.concurrency or sync_size

    def _dispatch(
        self,
        grid: Grid,
        version: int,
        concurrency: int,
        rng: np.random.Generator,
        train_config: ConfigRecord,
        pending: _Pending,
    ) -> None:
        """Send the current model to idle nodes until ``concurrency`` are training."""
        busy = {task.node for task in self.in_flight.values()}
        idle = self._eligible(grid, version)
        free = concurrency - len(busy)
        if free <= 0 or not idle:
            return
        # by index: node ids are unsigned 64-bit, which numpy would turn into floats
        picks = rng.choice(len(idle), size=min(free, len(idle)), replace=False)
        chosen = sorted(idle[int(i)] for i in picks)
        arrays = to_array_record(self.strategy.global_state)
        messages = []
        for node in chosen:
            # the node's round: the update this task is for, and later than its last task
            task = max(version + 1, self.node_tasks.get(node, 0) + 1)
            self.node_tasks[node], self.node_versions[node] = task, version
            config = ConfigRecord({**dict(train_config), "server-round": task})
            message = Message(
                RecordDict({"arrays": arrays, "config": config}),
                dst_node_id=node,
                message_type=MessageType.TRAIN,
            )
            message = self.strategy.extend_train_message(version + 1, message)
            messages.append(self.strategy.at_node_rank(version + 1, message))
        pending.down_params += [record_params(m.content) for m in messages]
        self.strategy.encodings.encode(messages, version + 1)  # downlink (nothing at fp32)
        pending.down_bytes += (down := wire_bytes_each(messages))
        clock = self.clock  # virtual-clock: the tasks' durations (profiles learnt first)
        seconds = clock.durations(grid, messages, version + 1, down) if clock else []
        now, ids = time.monotonic(), list(grid.push_messages(messages))
        for message_id, message in zip(ids, messages, strict=True):
            self.in_flight[message_id] = Task(message.metadata.dst_node_id, version, now)
        if clock is not None:  # each task finishes on the virtual clock, sent at its now
            clock.start(ids, messages, seconds)

    def _eligible(self, grid: Grid, version: int) -> list[int]:
        """The connected nodes that are idle and have not trained from ``version`` yet: no
        node trains twice from one model, so a fast node waits for the next update rather
        than fill the buffer with a second reply from the same start (with every node in
        the buffer, each update is the synchronous round)."""
        busy = {task.node for task in self.in_flight.values()}
        return sorted(
            node for node in grid.get_node_ids()
            if node not in busy and self.node_versions.get(node, -1) < version
        )  # fmt: skip

    def _expire(self, timeout: float, pending: _Pending) -> None:
        """Tasks older than ``timeout`` are lost: the node is free again."""
        now = time.monotonic()
        for message_id, task in list(self.in_flight.items()):
            if now - task.sent_at > timeout and not (self.clock and self.clock.is_held(message_id)):
                del self.in_flight[message_id]
                pending.lost.append(self.strategy.ledger.partition_of(task.node))
                log.warning(
                    "round-mode=async: node %s (partition %s) sent no reply in %.0f s; lost",
                    task.node, self.strategy.ledger.partition_of(task.node), timeout,
                )  # fmt: skip

    def _receive(
        self,
        msg: Message,
        version: int,
        versions: Mapping[int, dict[str, np.ndarray]],
        settings: AsyncSettings,
        pending: _Pending,
    ) -> Buffered | None:
        """A reply checked and tagged with its staleness, or None (counted) when it failed,
        was rejected or is staler than the versions kept."""
        task = self.in_flight.pop(msg.metadata.reply_to_message_id, None)
        if task is None:
            return None
        pending.replies.append(msg)
        pending.up_bytes.append(wire_bytes(msg))  # as it travelled, before it is decoded
        self.strategy.encodings.decode(msg)  # uplink-encoding
        self.strategy.ledger.learn([msg])
        where = f"node {task.node} (partition {self.strategy.ledger.partition_of(task.node)})"
        if msg.has_error():
            pending.failures += 1
            log.warning("round-mode=async: %s failed, reply dropped: %s", where, msg.error.reason)
            return None
        pending.up_params += declared_params(msg.content)
        if task.version not in versions:
            self._refuse_stale(where, task.version, version, settings, pending)
            return None
        try:
            reply = self.strategy.check_reply(msg, None)
        except ReplyRejected as err:
            pending.rejected += 1
            log.warning("round-mode=async: rejected update from %s: %s", where, err)
            return None
        return Buffered(msg, replace(reply, start=versions[task.version]), task.version, where)

    @staticmethod
    def _refuse_stale(
        where: str, trained_from: int, version: int, settings: AsyncSettings, pending: _Pending
    ) -> None:
        pending.stale_rejected += 1
        log.warning(
            "round-mode=async: %s trained from version %d, %d updates ago; more than "
            "async-max-staleness=%d, reply refused",
            where, trained_from, version - trained_from, settings.max_staleness,
        )  # fmt: skip

    def _with_staleness(
        self, taken: list[Buffered], version: int, settings: AsyncSettings, pending: _Pending
    ) -> list[Buffered]:
        """The replies that update ``version`` - 1 into ``version``, each with its staleness
        τ = version - 1 - the version it trained from; staler than the versions kept:
        refused."""
        kept = []
        for entry in taken:
            staleness = version - 1 - entry.trained_from
            if staleness > settings.max_staleness:
                self._refuse_stale(entry.sender, entry.trained_from, version - 1, settings, pending)
                continue
            kept.append(replace(entry, reply=replace(entry.reply, staleness=staleness)))
        return kept

    def _update(
        self, version: int, taken: list[Buffered], pending: _Pending
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """One server update over the buffer (``aggregate_replies``), with the row's
        asynchronous metrics."""
        self.strategy.communication.record_sent_counts(version, pending.down_params)
        taken = sorted(taken, key=lambda b: (b.reply.partition, b.reply.node))
        messages = [b.message for b in taken]
        record = self.strategy.example_dp  # dp=example: the clients' epsilons
        example_dp = record.observe(version, messages) if record else {}
        staleness = [b.reply.staleness for b in taken]
        node_metrics: dict[str, Any] = {
            "version": version,
            "partitions": [b.reply.partition for b in taken],
            "staleness": staleness,  # each reply's, in the order of partitions
            "staleness-mean": float(np.mean(staleness)) if staleness else 0.0,
            "staleness-max": int(max(staleness, default=0)),
            "in-flight": len(self.in_flight),
            "stale-rejected": pending.stale_rejected,
            "lost-partitions": sorted(pending.lost),
            "lost-nodes": len(pending.lost),
            **({"lost-in-flight": pending.lost_in_flight} if pending.lost_in_flight else {}),
            **example_dp,
            **train_time_metrics(messages),
            **traffic_metrics(pending.down_bytes, pending.up_bytes),
            **(self.clock.row() if self.clock else {}),
        }
        return self.strategy.aggregate_replies(
            version,
            [b.reply for b in taken],
            failures=pending.failures,
            rejected=pending.rejected,
            up_params=pending.up_params,
            node_metrics=node_metrics,
        )

    # -- checkpoints ---------------------------------------------------------------------
    def state_json(self) -> dict[str, Any]:
        """The replies in flight and those received beyond the buffer (lost if the run
        resumes from here), each node's last round and the version it trained from, and
        the state of the generator that picks the nodes."""
        state: dict[str, Any] = {
            "in-flight": len(self.in_flight),
            "buffered": len(self.buffered),
            "node-tasks": {str(k): v for k, v in self.node_tasks.items()},
            "node-versions": {str(k): v for k, v in self.node_versions.items()},
        }
        if self.pick_rng is not None:
            state["rng"] = self.pick_rng.bit_generator.state
        return state

    def load_state_json(self, state: Mapping[str, Any]) -> None:
        self.lost_in_flight = int(state.get("in-flight", 0)) + int(state.get("buffered", 0))
        self.node_tasks = {int(k): int(v) for k, v in state.get("node-tasks", {}).items()}
        self.node_versions = {int(k): int(v) for k, v in state.get("node-versions", {}).items()}
        if "rng" in state:
            self.pick_rng = np.random.default_rng()
            self.pick_rng.bit_generator.state = dict(state["rng"])


@dataclass
class _Pending:
    """What happened since the last update: it goes into the next update's row."""

    down_params: list[int] = field(default_factory=list)
    down_bytes: list[int] = field(default_factory=list)
    up_bytes: list[int] = field(default_factory=list)
    replies: list[Message] = field(default_factory=list)
    failures: int = 0
    rejected: int = 0
    stale_rejected: int = 0
    lost: list[int] = field(default_factory=list)  # partitions of the nodes lost
    lost_in_flight: int = 0
    up_params: int = 0
