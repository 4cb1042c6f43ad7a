"""Which node holds which partition, who took part in a round, and who was lost.

Node ids are random (a restarted SuperNode registers with a new one); clients report
their ``partition-id`` in every reply's metrics, so the server learns the map
node id -> partition id from replies. A node sampled for a round that delivers no reply
of its own -- the SuperLink answers for it (``NODE_UNAVAILABLE`` once its heartbeats
stop, or an expired message), or nothing comes back before the timeout -- is *lost*;
it is named by the partition it reported in an earlier round (``-1`` if it never
replied). A client whose ClientApp raised still answered: that is a failure, not a loss.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from flwr.app import Message

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
