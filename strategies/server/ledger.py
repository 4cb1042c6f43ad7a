"""The communication ledger: the parameters and the bytes each round actually sent down and
received up, and the nodes sampled (m, the public count central DP divides by)."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
from flwr.app import Message

from flower_app.wire.deployment_bytes import wire_bytes_each
from flower_app.wire.records import record_params
from strategies.server.replies import Reply


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
