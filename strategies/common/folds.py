"""Methods whose clients fold an exact dense update into their frozen W0 every round.

The server keeps each round's fold (a ``Residual``: dense, or exact factors ``P @ Q``) and
sends a node, with its next training message, every fold it has not applied yet
(``strategies/common/folding_strategy.py``). The client adds them, in float64, to its
cumulative fold (kept in its Flower context) and sets ``W0 ← W0_pristine + s · cumulative``;
the pristine W0 is kept so one process can serve clients with different folds. The server's
evaluator folds the server's cumulative fold the same way (``FoldsIntoW0``'s hooks).

Two methods fold: one folds the residual its averaged factors miss, the other the whole
stacked update of the round. Each names its context and checkpoint keys by ``fold_prefix``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from strategies.method import Method


@dataclass(frozen=True)
class Residual:
    """One layer's fold: ``dense`` (d_out x d_in) or factors ``P @ Q``."""

    dense: np.ndarray | None = None
    P: np.ndarray | None = None
    Q: np.ndarray | None = None

    def to_dense(self) -> np.ndarray:
        return self.dense if self.dense is not None else self.P @ self.Q

    @property
    def num_params(self) -> int:
        if self.dense is not None:
            return int(self.dense.size)
        return int(self.P.size + self.Q.size)


class FoldsIntoW0(Method):
    """A LoRA method whose clients fold the server's dense updates into W0 (``fold_prefix``
    names the keys it keeps in a node's context and in the model's held tensors)."""

    fold_prefix = "fold"

    @property
    def cumulative_key(self) -> str:  # the client's context: float64 dense cumulative fold
        return f"{self.fold_prefix}-cumulative-residual"

    @property
    def folded_round_key(self) -> str:  # the client's context: the last round folded
        return f"{self.fold_prefix}-residual-round"

    @property
    def pristine_key(self) -> str:  # AdaptedModel.held_tensors: W0 before any fold
        return f"{self.fold_prefix}-pristine-W0"

    def prepare_model(self, adapted):
        from flower_app.adapters.lora import lora_layers

        adapted.held_tensors[self.pristine_key] = {
            name: layer.get_base_layer().weight.detach().clone()
            for name, layer in lora_layers(adapted.model).items()
        }

    def receive_on_client(self, msg, context, adapted):
        """Add the folds of rounds not yet folded to this node's cumulative fold."""
        from flwr.app import Array, ArrayRecord, MetricRecord

        from flower_app.records import from_array_record

        state = context.state
        cumulative = (
            from_array_record(state[self.cumulative_key]) if self.cumulative_key in state else {}
        )
        done = (
            int(state[self.folded_round_key]["round"])
            if self.folded_round_key in state.metric_records
            else 0
        )
        if "residuals" in msg.content.array_records:
            for t, layers in sorted(read_residuals(msg.content["residuals"]).items()):
                if t <= done:
                    continue
                for layer, dense in layers.items():
                    cumulative[layer] = cumulative.get(layer, 0.0) + dense
                done = t
        # float64, so that folding rounds one by one equals folding them all at once (a
        # resumed run)
        state[self.cumulative_key] = ArrayRecord(
            {k: Array(np.ascontiguousarray(v, np.float64)) for k, v in cumulative.items()}
        )
        state[self.folded_round_key] = MetricRecord({"round": done})
        fold_residual(adapted, cumulative, self.pristine_key)
        return {"residual-round": done}

    def receive_on_server(self, adapted, strategy):
        fold_residual(adapted, getattr(strategy, "cumulative", {}), self.pristine_key)


def fold_residual(adapted, cumulative: Mapping[str, np.ndarray], pristine_key: str) -> None:
    """W0 ← W0_pristine + s · cumulative fold (dense, per layer); {} restores W0."""
    import torch

    from flower_app.adapters.lora import lora_layers

    layers = lora_layers(adapted.model)
    with torch.no_grad():
        for name, w0 in adapted.held_tensors[pristine_key].items():
            weight = layers[name].get_base_layer().weight
            if name in cumulative:
                scale = layers[name].scaling["default"]
                delta = torch.as_tensor(np.asarray(cumulative[name], np.float64)) * scale
                weight.copy_((w0.double() + delta.to(w0.device)).to(w0.dtype))
            else:
                weight.copy_(w0)


def read_residuals(record: Any) -> dict[int, dict[str, np.ndarray]]:
    """Client side: {round: {layer: dense residual}} from a 'residuals' ArrayRecord."""
    parts: dict[int, dict[str, dict[str, np.ndarray]]] = {}
    for key, arr in record.items():
        t, layer, kind = key.split("/")
        parts.setdefault(int(t), {}).setdefault(layer, {})[kind] = arr.numpy().astype(np.float64)
    out: dict[int, dict[str, np.ndarray]] = {}
    for t, layers in parts.items():
        out[t] = {
            layer: p["dense"] if "dense" in p else p["P"] @ p["Q"] for layer, p in layers.items()
        }
    return out
