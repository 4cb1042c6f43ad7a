"""A Grid whose nodes answer in this process through the ClientApp's secure-aggregation mod.

The secure-aggregation tests and the overhead benchmark drive a strategy's round through it:
each message goes through ``secure_aggregation_mod`` (Flower's SecAgg+ stages and the
method's contribution) to a training step that replies with the node's fixed upload. A
raised handler becomes an error reply, as a ClientApp returns it; the collect stage's
replies are kept (``collected``, what the server received from each node) unless
``keep_collected`` is false; the clients' seconds are summed (``client_seconds``).
Subclasses change a reply's metrics or fail a node by overriding ``metrics`` or ``train``.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping

import numpy as np
from flwr.app import Context, Error, Message, MetricRecord, RecordDict
from flwr.common.secure_aggregation.secaggplus_constants import (
    RECORD_KEY_CONFIGS,
    Key,
    Stage,
)

from flower_app.secure.client_mod import secure_aggregation_mod
from flower_app.wire.records import to_array_record

__all__ = ["InProcessGrid"]


class InProcessGrid:
    """Nodes ``uploads`` (node id -> the arrays it uploads), each with a Context whose run
    config is ``{"method": method, **run_config}``."""

    def __init__(
        self,
        uploads: Mapping[int, Mapping[str, np.ndarray]],
        method: str,
        *,
        keep_collected: bool = True,
        **run_config,
    ) -> None:
        self.uploads = dict(uploads)
        self.keep_collected = keep_collected
        self.contexts = {
            node: Context(
                run_id=1,
                node_id=node,
                node_config={},
                state=RecordDict(),
                run_config={"method": method, **run_config},
            )
            for node in self.uploads
        }
        self.collected: dict[int, Message] = {}
        self.client_seconds = 0.0

    def get_node_ids(self) -> list[int]:
        return list(self.uploads)

    def metrics(self, node: int) -> MetricRecord:
        """The metrics a node's reply carries: its partition (its id), 10 examples."""
        return MetricRecord({"partition-id": node, "num-examples": 10, "train-loss": 0.5})

    def train(self, msg: Message, context: Context) -> Message:
        """The node's training step: its fixed upload and ``metrics``."""
        node = msg.metadata.dst_node_id
        arrays = to_array_record(self.uploads[node])
        return Message(RecordDict({"arrays": arrays, "metrics": self.metrics(node)}), reply_to=msg)

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> list[Message]:
        replies = []
        for msg in messages:
            node = msg.metadata.dst_node_id
            start = time.perf_counter()
            try:
                reply = secure_aggregation_mod(msg, self.contexts[node], self.train)
            except Exception as exc:  # a ClientApp returns a raised handler as an error
                reply = Message(Error(code=0, reason=repr(exc)), reply_to=msg)
            self.client_seconds += time.perf_counter() - start
            configs = msg.content.config_records.get(RECORD_KEY_CONFIGS)
            collect = configs is not None and configs[Key.STAGE] == Stage.COLLECT_MASKED_VECTORS
            if collect and self.keep_collected:
                self.collected[node] = reply
            replies.append(reply)
        return replies
