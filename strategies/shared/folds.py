"""Methods whose clients fold an exact dense update into their frozen W0 every round
(``FoldsIntoW0``), and the folds' parts (``Residual``: dense, or exact factors ``P @ Q``).

The server sends a node, with its next training message, every fold it has not applied yet
(``strategies/server/folding_strategy.py``), or, for a node behind the server's base (the
float64 sum of the folds up to round h), that base, which the node takes as its cumulative.
The client adds the folds in float64 to its cumulative fold, kept in its Flower context, and
sets ``W0 ← W0_pristine + s · cumulative`` (``fold_residual``; the pristine W0 is kept so one
process can serve clients with different folds). The server's evaluator folds the server's
cumulative the same way. Two methods fold: one the residual its averaged factors miss, the
other the whole stacked update of the round; each names its context and checkpoint keys by
``fold_prefix``. docs/architecture.md, "The math".
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from strategies.shared.base_method import BaseMethod


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


class FoldsIntoW0(BaseMethod):
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
        from flower_app.adapters.lora.layer import lora_layers

        adapted.held_tensors[self.pristine_key] = {
            name: layer.get_base_layer().weight.detach().clone()
            for name, layer in lora_layers(adapted.model).items()
        }

    def receive_on_client(self, msg, context, adapted):
        """Add the folds of rounds not yet folded to this node's cumulative fold."""
        from flwr.app import Array, ArrayRecord, MetricRecord

        from flower_app.wire.records import from_array_record

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
            record = msg.content["residuals"]
            base = read_base(record)
            if base is not None and base[0] > done:
                # the server's sum of rounds 1..h, bitwise what folding them one by one from
                # 0 gives: it replaces (not adds to) whatever this node folded before
                done, cumulative = base
            for t, layers in sorted(read_residuals(record).items()):
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

    from flower_app.adapters.lora.layer import lora_layers

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


def dense_from_parts(parts: Mapping[str, np.ndarray]) -> np.ndarray:
    """A fold's float64 dense matrix from the arrays it travelled as ({'dense'} or {'P', 'Q'}):
    cast to float64 first, then P @ Q in float64."""
    if "dense" in parts:
        return parts["dense"].astype(np.float64)
    return parts["P"].astype(np.float64) @ parts["Q"].astype(np.float64)


def read_residuals(record: Any) -> dict[int, dict[str, np.ndarray]]:
    """Client side: {round: {layer: dense residual}} from a 'residuals' ArrayRecord (its
    'base/...' arrays aside: ``read_base``)."""
    parts: dict[int, dict[str, dict[str, np.ndarray]]] = {}
    for key, arr in record.items():
        if key.startswith("base/"):
            continue
        t, layer, kind = key.split("/")
        parts.setdefault(int(t), {}).setdefault(layer, {})[kind] = arr.numpy()
    return {
        t: {layer: dense_from_parts(p) for layer, p in layers.items()}
        for t, layers in parts.items()
    }


def read_base(record: Any) -> tuple[int, dict[str, np.ndarray]] | None:
    """Client side: (h, {layer: C_h}) from a 'residuals' ArrayRecord's 'base/<h>/<layer>/dense'
    arrays (float64, sent as they are), or None when the message has no base."""
    horizon, layers = None, {}
    for key, arr in record.items():
        if key.startswith("base/"):
            _, h, layer, _ = key.split("/")
            horizon, layers[layer] = int(h), np.asarray(arr.numpy(), np.float64)
    return None if horizon is None else (horizon, layers)
