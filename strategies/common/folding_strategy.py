"""FoldingStrategy: the common strategy plus the folds into W0 (``strategies/common/folds.py``).

Every client must fold every round's update exactly once, including rounds it did not take
part in. The server therefore keeps each round's fold and sends a node, with its next
training message, all folds after the last round that node reported as folded (its
``residual-round`` metric). These arrays count in the round's downlink. The cumulative
dense fold is also kept here, so the server evaluates W0 + s (sum of folds) + s B A.
A method's strategy subclasses it and returns the round's folds from ``aggregate_adapter``
through ``record_folds``.
"""

from __future__ import annotations

import math

import numpy as np
from flwr.app import Message, RecordDict

from strategies.common.fold_messages import residuals_record
from strategies.common.folds import Residual
from strategies.common.strategy import AdapterStrategy


class FoldingStrategy(AdapterStrategy):
    def __init__(self, *args, fold_prefix: str, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.fold_prefix = fold_prefix  # the checkpoint's keys: '<prefix>/cumulative/<layer>'
        self.residuals: dict[int, dict[str, Residual]] = {}
        self.cumulative: dict[str, np.ndarray] = {}
        self.node_synced: dict[int, int] = {}

    def extend_train_message(self, server_round: int, message: Message) -> Message:
        node = message.metadata.dst_node_id
        since = self.node_synced.get(node, 0)
        content = RecordDict(dict(message.content.items()))
        content["residuals"] = residuals_record(self.residuals, since)
        return Message(
            content=content, message_type=message.metadata.message_type, dst_node_id=node
        )

    def aggregate_train(self, server_round, replies):
        replies = list(replies)
        for msg in replies:
            if not msg.has_error() and "metrics" in msg.content.metric_records:
                folded = msg.content["metrics"].get("residual-round", 0)
                if isinstance(folded, int | float) and math.isfinite(folded):
                    # a node that claims more than the server has only starves itself
                    self.node_synced[msg.metadata.src_node_id] = int(folded)
        return super().aggregate_train(server_round, replies)

    def record_folds(self, server_round: int, residuals: dict[str, Residual]) -> float:
        """Keep round ``server_round``'s folds, add them to the cumulative fold; returns their
        mean Frobenius norm over the layers."""
        for layer, residual in residuals.items():
            self.cumulative[layer] = self.cumulative.get(layer, 0.0) + residual.to_dense()
        self.residuals[server_round] = residuals
        return float(np.mean([np.linalg.norm(r.to_dense()) for r in residuals.values()]))

    # -- checkpoint and resume: every round's fold and the server's cumulative one --------
    def state_arrays(self) -> dict[str, np.ndarray]:
        arrays = super().state_arrays()
        prefix = self.fold_prefix
        arrays.update({f"{prefix}/cumulative/{k}": v for k, v in self.cumulative.items()})
        for t, layers in self.residuals.items():
            for layer, res in layers.items():
                parts = {"dense": res.dense} if res.dense is not None else {"P": res.P, "Q": res.Q}
                arrays.update({f"{prefix}/residual/{t}/{layer}/{k}": v for k, v in parts.items()})
        return arrays

    def restore(self, arrays, state) -> None:
        """Resume: the folds of every round (a resumed run is a new Flower run, so its
        clients start with nothing folded and are sent all of them with their first
        training message: ``node_synced`` starts empty) and the cumulative fold."""
        super().restore(arrays, state)
        self.cumulative, self.residuals, self.node_synced = {}, {}, {}
        cumulative, residual = f"{self.fold_prefix}/cumulative/", f"{self.fold_prefix}/residual/"
        parts: dict[int, dict[str, dict[str, np.ndarray]]] = {}
        for key, value in arrays.items():
            if key.startswith(cumulative):
                self.cumulative[key[len(cumulative) :]] = np.asarray(value, np.float64)
            elif key.startswith(residual):
                t, rest = key[len(residual) :].split("/", 1)
                layer, kind = rest.rsplit("/", 1)
                parts.setdefault(int(t), {}).setdefault(layer, {})[kind] = value
        for t, layers in parts.items():
            self.residuals[t] = {
                layer: Residual(dense=p.get("dense"), P=p.get("P"), Q=p.get("Q"))
                for layer, p in layers.items()
            }
