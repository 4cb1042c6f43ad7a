"""The server's ledgers: which node holds which partition, who took part in each round and
who was lost (``NodeLedger``), and the parameters and bytes each round sent down and
received up (``CommunicationLedger``, ``traffic_metrics``).

Node ids are random (a restarted SuperNode registers with a new one); clients report their
``partition-id`` in every reply, so the server learns node id -> partition id from replies.
A sampled node that delivers no reply of its own (the SuperLink answers for it, or nothing
comes before the timeout) is *lost*, named by the partition it reported earlier (-1 if it
never replied); a ClientApp that raised still answered: a failure, not a loss.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
from flwr.app import Message

from flower_app.wire.deployment_bytes import wire_bytes_each
from flower_app.wire.records import record_params
from strategies.server.replies import Reply

log = logging.getLogger("flwr.florg")

UNKNOWN_PARTITION = -1


@dataclass(frozen=True)
class LostNode:
    node_id: int
    partition_id: int
    reason: str


@dataclass(frozen=True)
class RoundNodes:
    """One round's participants: partitions of the nodes that replied themselves (failed
    ClientApps included), and the lost nodes."""

    replied: dict[int, int]
    lost: list[LostNode] = field(default_factory=list)

    def metrics(self) -> dict[str, list[int] | int]:
        return {
            "partitions": sorted(self.replied.values()),
            "lost-partitions": sorted(n.partition_id for n in self.lost),
            "lost-nodes": len(self.lost),
        }


class NodeLedger:
    """node id -> partition id from replies; per round, the messages sent."""

    def __init__(self) -> None:
        self.partitions: dict[int, int] = {}
        self._sent: dict[int, list[Message]] = {}

    def partition_of(self, node_id: int) -> int:
        return self.partitions.get(int(node_id), UNKNOWN_PARTITION)

    def learn(self, replies: Iterable[Message]) -> None:
        """Record the partition each (non-error) reply reports."""
        for msg in replies:
            if msg.has_error() or "metrics" not in msg.content.metric_records:
                continue
            pid = msg.content["metrics"].get("partition-id")
            if (
                isinstance(pid, int | float)
                and not isinstance(pid, bool)
                and math.isfinite(pid)
                and pid == int(pid)
                and pid >= 0
            ):  # anything else (NaN, a list, ...) teaches nothing, and must not crash
                self.partitions[int(msg.metadata.src_node_id)] = int(pid)

    def sent(self, server_round: int, messages: list[Message]) -> None:
        """The round's instructions (Flower sets their message ids when it pushes them)."""
        self._sent[server_round] = messages

    def settle(self, server_round: int, replies: list[Message]) -> RoundNodes:
        """Who answered this round and who was lost (logged with its partition)."""
        self.learn(replies)
        sent = self._sent.pop(server_round, [])
        sampled = {int(m.metadata.dst_node_id) for m in sent}
        by_message = {m.metadata.message_id: int(m.metadata.dst_node_id) for m in sent}
        replied: dict[int, int] = {}
        reasons: dict[int, str] = {}
        for msg in replies:
            src = int(msg.metadata.src_node_id)
            if src in sampled:
                replied[src] = self.partition_of(src)
            elif msg.has_error():  # answered by the SuperLink on the node's behalf
                node = by_message.get(msg.metadata.reply_to_message_id)
                if node is not None:
                    reasons[node] = msg.error.reason
        lost = [
            LostNode(node, self.partition_of(node), reasons.get(node, "no reply before timeout"))
            for node in sorted(sampled - set(replied))
        ]
        for node in lost:
            log.warning(
                "round %d: lost node %s (partition %s): %s",
                server_round,
                node.node_id,
                node.partition_id if node.partition_id >= 0 else "unknown",
                node.reason,
            )
        return RoundNodes(replied, lost)


class CommunicationLedger:
    """What each round's training messages carried, per round and per node."""

    def __init__(self) -> None:
        self.down_params: dict[int, int] = {}  # round -> parameters sent down
        self.down_by_node: dict[int, int] = {}  # node -> parameters sent this round
        self.down_bytes: dict[int, list[int]] = {}  # round -> each message's bytes
        self.sampled: dict[int, int] = {}  # round -> nodes sent a training message

    def record_sent(self, server_round: int, messages: Iterable[Message]) -> None:
        messages = list(messages)
        self.down_params[server_round] = sum(record_params(m.content) for m in messages)
        self.down_by_node = {m.metadata.dst_node_id: record_params(m.content) for m in messages}
        self.down_bytes[server_round] = wire_bytes_each(messages)
        self.sampled[server_round] = len(messages)

    def record_sent_counts(self, server_round: int, params: list[int]) -> None:
        """The parameters of each training message counted toward ``server_round`` where
        they were sent in several batches (round-mode=async: between two updates)."""
        self.down_params[server_round] = sum(params)
        self.sampled[server_round] = len(params)

    def record_wire(self, server_round: int, messages: Iterable[Message]) -> None:
        """The round's messages as they travel (encoded): their bytes."""
        self.down_bytes[server_round] = wire_bytes_each(messages)

    def down(self, server_round: int) -> int:
        return self.down_params.get(server_round, 0)

    def bytes_metrics(self, server_round: int, replies: Iterable[Message]) -> dict[str, float]:
        """The bytes that travelled in ``server_round``, as a deployment sends the messages
        (``wire_bytes_each``): ``downlink-bytes`` (every training message sent) and
        ``uplink-bytes`` (every reply received, failed and rejected ones included), in
        total and per client (``-per-client``: the mean over the messages; ``-max``: the
        largest)."""
        return traffic_metrics(self.down_bytes.get(server_round, []), wire_bytes_each(replies))

    def num_sampled(self, server_round: int, replies: int) -> int:
        """m: the nodes sent a training message this round (public), at least the replies
        (a caller without ``configure_train``, such as the overhead benchmark: the replies)."""
        return max(self.sampled.get(server_round, 0), replies, 1)

    def per_rank(self, replies: list[Reply]) -> dict[str, float]:
        """Per-client communication of a round with mixed ranks, from the arrays that
        travelled: ``up-params-per-client`` / ``down-params-per-client`` (mean over the
        checked replies) and ``up-params-r<r>`` / ``down-params-r<r>`` (mean over the
        clients of rank r)."""
        down = self.down_by_node
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


def traffic_metrics(down: list[int], up: list[int]) -> dict[str, float]:
    """``downlink-bytes*`` and ``uplink-bytes*`` from the bytes of each message sent
    (``down``) and each reply received (``up``), counted as they travelled (``wire_bytes``:
    a reply's before it is decoded)."""
    out: dict[str, float] = {}
    for direction, sizes in (("downlink", down), ("uplink", up)):
        out[f"{direction}-bytes"] = float(sum(sizes))
        out[f"{direction}-bytes-per-client"] = float(np.mean(sizes)) if sizes else 0.0
        out[f"{direction}-bytes-max"] = float(max(sizes, default=0))
    return out
