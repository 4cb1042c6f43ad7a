"""The virtual clock (``virtual-clock``): node speed and bandwidth modelled, not measured.

Each node states its profile once (the ClientApp's ``query.profile``: partition, training
examples, seconds per example, bandwidth, latency). A task sent at virtual time t finishes
at t + ``task_seconds``: 2 x latency + down bytes / bandwidth + examples x seconds per
example + a straggler's fixed delay + up bytes / bandwidth. ``VirtualClock`` keeps ``now``,
each node's busy-until and each task's finish; the loops take replies in finish order
(ties: partition, node) once their real replies are in (``next_reply``), so the rows never
depend on which real reply came first. A synchronous round lasts its slowest replying task
(``sync_close``). Tasks lost to the run's real timeout stay wall-clock events.
docs/async.md, "The virtual clock".
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from flwr.app import Message, MessageType, RecordDict
from flwr.serverapp import Grid

from flower_app.wire.deployment_bytes import wire_bytes, wire_bytes_each
from flower_app.wire.encoding import decode_record, encode_record
from flower_app.wire.records import from_array_record

PROFILE = f"{MessageType.QUERY}.profile"  # routed to the ClientApp's @app.query("profile")
BITS_PER_MEGABIT = 1e6


@dataclass(frozen=True)
class NodeProfile:
    """A node's ``query.profile`` reply (client_app/client_app.py)."""

    partition: int
    examples: int  # its training examples (its share after max-train-examples)
    seconds_per_example: float  # after its compute multiplier (flower_app/client/node_speed.py)
    bandwidth_mbps: float  # both directions
    latency: float  # seconds per message, each way
    delay: float  # fixed seconds before each reply (a straggler's delay-seconds)

    @classmethod
    def from_reply(cls, message: Message) -> NodeProfile:
        m = message.content["metrics"]
        return cls(int(m["partition-id"]), int(m["num-examples"]),
                   float(m["seconds-per-example"]), float(m["bandwidth-mbps"]),
                   float(m["latency"]), float(m["delay"]))  # fmt: skip


@dataclass(frozen=True)
class ClockSettings:
    """What the server needs to cost a task: the run's local work per round."""

    local_steps: int = 0
    local_epochs: int = 1
    batch_size: int = 16


def task_examples(settings: ClockSettings, node_examples: int) -> int:
    """The examples a task trains on: local-steps x batch-size, or local-epochs x the
    node's training examples where local-steps is 0."""
    if settings.local_steps > 0:
        return settings.local_steps * settings.batch_size
    return settings.local_epochs * node_examples


def task_seconds(profile: NodeProfile, examples: int, down_bytes: int, up_bytes: int) -> float:
    """A task's virtual duration on ``profile``'s node: 2 x latency + down_bytes / bandwidth
    + examples x seconds_per_example + delay + up_bytes / bandwidth (bandwidth in bytes a
    second)."""
    per_second = profile.bandwidth_mbps * BITS_PER_MEGABIT / 8
    return (2 * profile.latency + down_bytes / per_second
            + examples * profile.seconds_per_example + profile.delay
            + up_bytes / per_second)  # fmt: skip


class VirtualClock:
    """``now`` (virtual seconds), each node's profile and busy-until, and each task in
    flight's (finish, partition, node), held by the common strategy as ``clock``."""

    def __init__(
        self,
        settings: ClockSettings,
        encodings: Any,
        uplink_state: Callable[[int], Mapping[str, Any]] = lambda _: {},
    ) -> None:
        self.settings = settings
        self.encodings = encodings  # the strategy's MessageEncodings (uplink, downlink)
        self.uplink_state = uplink_state  # the arrays a round's replies carry
        self.timeout = 3600.0  # the run's: how long a profile query may take
        self.now = 0.0
        self.row_start = 0.0  # ``now`` at the last row
        self.busy_until: dict[int, float] = {}
        self.profiles: dict[int, NodeProfile] = {}
        self.tasks: dict[str, tuple[float, int, int]] = {}  # message id -> order key
        self.held: dict[str, Message] = {}  # real replies in, not yet due on the clock
        self.sync_seconds: dict[int, dict[int, float]] = {}  # round -> node -> duration
        self._up_bytes: dict[tuple[Any, ...], int] = {}

    # -- profiles and costs -------------------------------------------------------------
    def learn(self, grid: Grid, nodes: Iterable[int]) -> None:
        """Ask the nodes not seen yet for their profile (one ``send_and_receive``)."""
        unknown = sorted({int(n) for n in nodes} - set(self.profiles))
        if not unknown:
            return
        asks = [Message(RecordDict(), dst_node_id=n, message_type=PROFILE) for n in unknown]
        for reply in grid.send_and_receive(asks, timeout=self.timeout):
            node = int(reply.metadata.src_node_id)
            if reply.has_error():
                raise RuntimeError(
                    f"virtual-clock: node {node} could not state its profile "
                    f"(query.profile): {reply.error.reason}"
                )
            self.profiles[node] = NodeProfile.from_reply(reply)
        missing = [n for n in unknown if n not in self.profiles]
        if missing:
            raise RuntimeError(
                f"virtual-clock: nodes {missing} sent no profile (query.profile) within "
                f"{self.timeout:.0f} s"
            )

    def up_bytes(self, message: Message, uplink_keys: Iterable[str]) -> int:
        """The estimated bytes of the reply to ``message``: a message of the arrays it
        sends (those the node trains this round, ``uplink_keys``, where it sends them)
        encoded by ``uplink-encoding``, its metrics not counted. Sizes do not depend on
        the values, so it is kept per names and shapes."""
        arrays = from_array_record(
            decode_record(message.content["arrays"], self.encodings.downlink)
        )
        keys = set(uplink_keys) & set(arrays)
        up = {k: v for k, v in arrays.items() if k in keys} if keys else arrays
        key = tuple((k, v.shape) for k, v in up.items())
        if key not in self._up_bytes:
            record = encode_record(up, self.encodings.uplink, np.random.default_rng(0))
            reply = Message(RecordDict({"arrays": record}), dst_node_id=0,
                            message_type=MessageType.TRAIN)  # fmt: skip
            self._up_bytes[key] = wire_bytes(reply)
        return self._up_bytes[key]

    def durations(
        self, grid: Grid, messages: Sequence[Message], server_round: int,
        down_bytes: Sequence[int] | None = None,
    ) -> list[float]:  # fmt: skip
        """Each of round ``server_round``'s messages' ``task_seconds`` on its node (every
        connected node's profile learnt first), as encoded for the wire."""
        nodes = [int(m.metadata.dst_node_id) for m in messages]
        self.learn(grid, [*nodes, *grid.get_node_ids()])
        down = list(down_bytes) if down_bytes is not None else wire_bytes_each(messages)
        keys = list(self.uplink_state(server_round))
        up: dict[int, int] = {}  # the messages of one round share their arrays' record
        for m in messages:
            record = id(m.content["arrays"])
            up[record] = up[record] if record in up else self.up_bytes(m, keys)
        return [
            task_seconds(self.profiles[node], task_examples(self.settings,
                         self.profiles[node].examples), d, up[id(m.content["arrays"])])
            for node, d, m in zip(nodes, down, messages, strict=True)
        ]  # fmt: skip

    # -- tasks in flight ----------------------------------------------------------------
    def start(self, message_ids: Iterable[str], messages: Sequence[Message],
              seconds: Sequence[float]) -> None:  # fmt: skip
        """The tasks sent at ``now``: each one's finish, and its node busy until then."""
        for message_id, message, duration in zip(message_ids, messages, seconds, strict=True):
            node = int(message.metadata.dst_node_id)
            finish = self.now + duration
            self.tasks[message_id] = (finish, self.profiles[node].partition, node)
            self.busy_until[node] = finish

    def earliest(self, in_flight: Iterable[str]) -> str | None:
        """The task in flight that finishes first (ties: partition, node)."""
        known = [i for i in in_flight if i in self.tasks]
        return min(known, key=self.tasks.__getitem__, default=None)

    def finish(self, message_id: str) -> float:
        return self.tasks[message_id][0]

    def next_reply(self, grid: Grid, in_flight: Mapping[str, Any]) -> Message | None:
        """The reply of the earliest task in flight, once its real reply is in (the others
        that came are held); ``now`` moves to its finish. None: not in yet."""
        waiting = [i for i in in_flight if i not in self.held]
        if waiting:
            for msg in grid.pull_messages(waiting):
                self.held[msg.metadata.reply_to_message_id] = msg
        first = self.earliest(in_flight)
        if first is None or first not in self.held:
            return None
        self.now = max(self.now, self.tasks.pop(first)[0])
        return self.held.pop(first)

    def is_held(self, message_id: str) -> bool:
        """Whether a task's real reply is in: then it is not lost to the real timeout."""
        return message_id in self.held

    def row(self) -> dict[str, float]:
        """A row's keys: ``virtual-seconds`` (now) and ``virtual-round-seconds`` (since the
        last row)."""
        row = {"virtual-seconds": self.now, "virtual-round-seconds": self.now - self.row_start}
        self.row_start = self.now
        return row

    # -- round-mode=sync (Flower's loop: configure_train / aggregate_train) -----------------
    def sync_round(self, grid: Grid, server_round: int, messages: Sequence[Message]) -> None:
        """Cost the round's training messages (sent at ``now``)."""
        seconds = self.durations(grid, messages, server_round)
        nodes = [int(m.metadata.dst_node_id) for m in messages]
        self.sync_seconds[server_round] = dict(zip(nodes, seconds, strict=True))
        for node, duration in zip(nodes, seconds, strict=True):
            self.busy_until[node] = self.now + duration

    def sync_close(self, server_round: int, replies: Iterable[Message]) -> dict[str, float]:
        """The round lasts its slowest task that replied (a failed reply too; a task lost
        to the real timeout is not modelled); the row's keys."""
        seconds = self.sync_seconds.pop(server_round, {})
        got = [seconds[n] for r in replies if (n := int(r.metadata.src_node_id)) in seconds]
        self.now += max(got, default=0.0)
        return self.row()

    # -- checkpoints --------------------------------------------------------------------
    def state_json(self) -> dict[str, Any]:
        """``now`` and each node's busy-until (the tasks in flight are lost on resume)."""
        return {"now": self.now, "busy-until": {str(k): v for k, v in self.busy_until.items()}}

    def load_state_json(self, state: Mapping[str, Any]) -> None:
        self.now = self.row_start = float(state.get("now", 0.0))
        self.busy_until = {int(k): float(v) for k, v in state.get("busy-until", {}).items()}


def clock_for(settings: ClockSettings | None, strategy: Any) -> VirtualClock | None:
    """The common strategy's clock (None: ``virtual-clock`` off)."""
    if settings is None:
        return None
    return VirtualClock(settings, strategy.encodings, strategy.uplink_state)


# -- round-mode=sync-overselect (overselected_rounds.py's loop, ``loop``) ------------------
def clocked_idle(loop: Any, grid: Grid, timeout: float, poll: float, row: Any) -> list[int]:
    """The connected nodes with no task in flight (each task left finishes after ``now``);
    none: the earliest task's reply is taken (discarded as late) and ``now`` moves to its
    finish, until a node is idle. No node at all for ``timeout``: []."""
    clock: VirtualClock = loop.clock
    waited = time.monotonic()
    while True:
        loop._expire(timeout, row)  # lost to the real timeout: wall-clock, as without it
        busy = {task.node for task in loop.in_flight.values()}
        idle = sorted(node for node in grid.get_node_ids() if node not in busy)
        if idle or (not loop.in_flight and time.monotonic() - waited > timeout):
            return idle
        msg = clock.next_reply(grid, loop.in_flight) if loop.in_flight else None
        if msg is None:
            time.sleep(poll)
            continue
        loop._take([msg], 0, 0, [], row)  # an earlier round's: discarded


def clocked_round(
    loop: Any, grid: Grid, server_round: int, k: int, timeout: float, poll: float, row: Any
) -> list[Any]:
    """Round ``server_round``'s replies in virtual finish order (earlier rounds' late ones
    among them, discarded), each taken once its real reply is in: the round closes at its
    K-th kept reply, at ``round-deadline`` virtual seconds after ``now`` (then ``now`` is
    the deadline), or when none of its tasks is left. The kept (message, reply) pairs."""
    clock: VirtualClock = loop.clock
    started, deadline = clock.now, loop.settings.deadline
    kept: list[Any] = []
    while any(task.server_round == server_round for task in loop.in_flight.values()):
        loop._expire(timeout, row)
        first = clock.earliest(loop.in_flight)
        if first is None:  # only tasks lost to the real timeout were left
            break
        if deadline and clock.finish(first) > started + deadline:
            clock.now, row.deadline_hit = started + deadline, 1
            break
        msg = clock.next_reply(grid, loop.in_flight)
        if msg is None:
            time.sleep(poll)
            continue
        loop._take([msg], server_round, k, kept, row)
        if len(kept) >= k:
            break
    return kept
