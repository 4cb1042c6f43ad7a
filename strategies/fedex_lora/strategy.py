"""FedExLoRAStrategy: average B and A, and ship the exact residual so clients fold it into W0.

Every client must fold every round's residual exactly once, including rounds it
did not take part in.  The server therefore keeps each round's residual and sends
a node, with its next training message, all residuals after the last round that
node reported as folded (its ``residual-round`` metric).  These arrays count in
the round's downlink.  The cumulative dense residual is also kept here so the
server can evaluate W0 + s (sum of residuals) + s avg(B) avg(A).
"""

from __future__ import annotations

import math

import numpy as np
from flwr.app import Message, RecordDict

from strategies.common.strategy import AdapterStrategy
from strategies.fedex_lora.residual_messages import residuals_record
from strategies.fedex_lora.rule import Residual, aggregate_fedex_lora
from strategies.method import stacked


class FedExLoRAStrategy(AdapterStrategy):
    def __init__(self, *args, residual_mode: str = "dense", **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.residual_mode = residual_mode
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

    def aggregate_adapter(self, server_round, payloads, weights):
        new: dict[str, np.ndarray] = {}
        residuals: dict[str, Residual] = {}
        for layer in self.layers():
            kb, ka = f"{layer}.lora_B", f"{layer}.lora_A"
            new[kb], new[ka], residuals[layer] = aggregate_fedex_lora(
                stacked(payloads, kb),
                stacked(payloads, ka),
                weights,
                self.residual_mode,
            )
            dense = residuals[layer].to_dense()
            self.cumulative[layer] = self.cumulative.get(layer, 0.0) + dense
        self.residuals[server_round] = residuals
        norms = [np.linalg.norm(r.to_dense()) for r in residuals.values()]
        return new, {"residual_norm": float(np.mean(norms))}

    # -- checkpoint and resume: every round's residual and the server's cumulative one --
    def state_arrays(self) -> dict[str, np.ndarray]:
        arrays = super().state_arrays()
        arrays.update({f"fedex/cumulative/{k}": v for k, v in self.cumulative.items()})
        for t, layers in self.residuals.items():
            for layer, res in layers.items():
                parts = {"dense": res.dense} if res.dense is not None else {"P": res.P, "Q": res.Q}
                arrays.update({f"fedex/residual/{t}/{layer}/{k}": v for k, v in parts.items()})
        return arrays

    def state_json(self) -> dict:
        return {**super().state_json(), "residual-mode": self.residual_mode}

    def restore(self, arrays, state) -> None:
        """Resume: the residuals of every round (a resumed run is a new Flower run, so its
        clients start with nothing folded and are sent all of them with their first
        training message: ``node_synced`` starts empty) and the cumulative residual."""
        super().restore(arrays, state)
        if state.get("residual-mode") != self.residual_mode:
            raise ValueError("checkpoint of another fedex-residual mode")
        self.cumulative, self.residuals, self.node_synced = {}, {}, {}
        parts: dict[int, dict[str, dict[str, np.ndarray]]] = {}
        for key, value in arrays.items():
            if key.startswith("fedex/cumulative/"):
                self.cumulative[key[len("fedex/cumulative/") :]] = np.asarray(value, np.float64)
            elif key.startswith("fedex/residual/"):
                t, rest = key[len("fedex/residual/") :].split("/", 1)
                layer, kind = rest.rsplit("/", 1)
                parts.setdefault(int(t), {}).setdefault(layer, {})[kind] = value
        for t, layers in parts.items():
            self.residuals[t] = {
                layer: Residual(dense=p.get("dense"), P=p.get("P"), Q=p.get("Q"))
                for layer, p in layers.items()
            }
