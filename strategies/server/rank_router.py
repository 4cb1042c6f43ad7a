"""The rank router: the rank each node trains at, and the state each node is sent.

Clients of different rank (docs/architecture.md): the global state has the run's largest
rank r_max; a reply declares its client's rank r_n (its ``rank`` metric), checked against
the arrays' shapes (every layer's A has r_n rows) and rejected when r_n exceeds k or r_max,
when the method aggregates one rank only (``Method.heterogeneous_ranks`` false), or under
dp=central. The router learns each node's rank from its accepted replies and from then on
sends it the state of its own rank (the strategy's ``sent_state``: by default the top r_n
rows of A / columns of B of the global state; FLoRG a factor of its own); a node whose rank
it does not know yet gets the r_max state and keeps the top r_n rows. Screening measures
each client from the state it was sent (``start_state``). With every rank equal to r_max
no message and no number changes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
from flwr.app import Message, RecordDict

from flower_app.wire.ranks import adapter_k, rank_of, shapes_at_rank, truncate_to_rank
from flower_app.wire.records import to_array_record
from strategies.server.replies import Reply, ReplyRejected, declared_rank

SentState = Callable[[int], dict[str, np.ndarray]]  # rank -> the state a node of it is sent


class RankRouter:
    """Each node's rank, learnt from its replies, and the ranks sent in each round."""

    def __init__(self, global_state: Mapping[str, np.ndarray]) -> None:
        self.largest_rank = rank_of(global_state)  # r_max
        self.max_k = adapter_k(global_state)  # a rank above it fits no layer
        self.node_ranks: dict[int, int] = {}  # node id -> rank, learnt from its replies
        self.sent_ranks: dict[int, dict[int, int]] = {}  # round -> node -> rank sent

    def expected_state(
        self,
        metrics: Mapping[str, Any],
        global_state: Mapping[str, np.ndarray],
        *,
        method_name: str,
        heterogeneous: bool,
        private: bool,
    ) -> tuple[int, Mapping[str, np.ndarray]]:
        """The rank a reply declares (``declared_rank``) and the arrays it must match: the
        global state at that rank; ReplyRejected for a rank the run cannot aggregate."""
        rank = declared_rank(
            metrics, default=self.largest_rank, k=self.max_k, largest=self.largest_rank
        )
        if rank == self.largest_rank:
            return rank, global_state
        if not heterogeneous:
            raise ReplyRejected(
                f"declared rank {rank}, but {method_name} aggregates rank {self.largest_rank} only"
            )
        if private:
            raise ReplyRejected(f"declared rank {rank}: dp=central needs one rank")
        return rank, {
            key: np.empty(shape, np.float32)
            for key, shape in shapes_at_rank(global_state, rank).items()
        }

    def learn(self, reply: Reply) -> None:
        """Remember the rank of an accepted reply's node."""
        self.node_ranks[reply.node] = reply.rank

    def route(self, server_round: int | None, message: Message, sent_state: SentState) -> Message:
        """``message`` carrying the state of its node's rank when the node has declared a
        rank other than r_max (else unchanged: a node of unknown rank gets r_max and keeps
        the top rows); ``server_round``: a training round, whose sent ranks are recorded."""
        node = message.metadata.dst_node_id
        rank = self.node_ranks.get(node, self.largest_rank)
        if server_round is not None:
            self.sent_ranks.setdefault(server_round, {})[node] = rank
        if rank == self.largest_rank:
            return message
        content = RecordDict(dict(message.content.items()))
        content["arrays"] = to_array_record(sent_state(rank))
        return Message(
            content=content, message_type=message.metadata.message_type, dst_node_id=node
        )

    def start_state(
        self, server_round: int, reply: Reply, sent_state: SentState
    ) -> dict[str, np.ndarray]:
        """The state ``reply``'s client started this round from: what it was sent, cut to
        its rank."""
        sent = self.sent_ranks.get(server_round, {}).get(reply.node, self.largest_rank)
        return truncate_to_rank(sent_state(sent), reply.rank)

    def is_mixed(self, server_round: int, checked: list[Reply]) -> bool:
        """Whether a round involved a rank other than r_max, in a reply or a message sent."""
        sent = self.sent_ranks.get(server_round, {})
        return any(r.rank not in (0, self.largest_rank) for r in checked) or any(
            rank != self.largest_rank for rank in sent.values()
        )

    # -- checkpoint ---------------------------------------------------------------------
    def state_json(self) -> dict[str, Any]:
        return {str(k): v for k, v in self.node_ranks.items()}

    def load_state_json(self, state: Mapping[str, Any]) -> None:
        self.node_ranks = {int(k): int(v) for k, v in state.items()}
