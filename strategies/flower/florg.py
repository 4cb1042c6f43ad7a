"""FLoRGStrategy: per adapted layer, Gram aggregation + decomposition + Procrustes."""

from __future__ import annotations

import numpy as np

from strategies.florg import aggregate_florg
from strategies.flower.base import AdapterStrategy, Reply, ReplyRejected, metric_number


class FLoRGStrategy(AdapterStrategy):
    """Clients send each layer's A (r x k); the server runs ``aggregate_florg`` on each."""

    method = "florg"

    def __init__(
        self, *args, procrustes: bool = True, fingerprint: int | None = None, **kwargs
    ) -> None:
        super().__init__(*args, **kwargs)
        self.procrustes = procrustes
        self.fingerprint = fingerprint

    def check_reply(self, message) -> Reply:
        """Also reject a client whose fixed L, R differ from the server's (other seed/model),
        or that does not say which it used (no ``lr-fingerprint``)."""
        reply = super().check_reply(message)
        if self.fingerprint is not None:
            theirs = metric_number(message.content["metrics"], "lr-fingerprint", required=False)
            if theirs is None:
                raise ReplyRejected("no L/R fingerprint ('lr-fingerprint' metric missing)")
            if theirs != self.fingerprint:
                raise ReplyRejected(
                    f"L/R fingerprint {int(theirs):012x} != server's {self.fingerprint:012x}"
                )
        return reply

    def aggregate_adapter(self, server_round, payloads, weights):
        new_state: dict[str, np.ndarray] = {}
        per_layer: dict[str, dict[str, float]] = {}
        for layer in self.layers():
            key = f"{layer}.A"
            new_state[key], per_layer[layer] = aggregate_florg(
                self.stacked(payloads, key), weights, self.global_state[key], self.procrustes
            )
        return new_state, summarize_layers(per_layer)


def summarize_layers(per_layer: dict[str, dict[str, float]]) -> dict[str, float]:
    """Mean of each diagnostic over layers, plus the worst case (max / min) of each."""
    out: dict[str, float] = {}
    for name in ("rank", "gram_rel_error", "drift", "eigengap"):
        values = np.array([float(info[name]) for info in per_layer.values()])
        out[name] = float(values.mean())
        worst = values.min() if name in ("rank", "eigengap") else values.max()
        out[f"{name}_{'min' if name in ('rank', 'eigengap') else 'max'}"] = float(worst)
    return out
