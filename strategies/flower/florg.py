"""FLoRGStrategy: Gram aggregation + decomposition + Procrustes for every adapted layer,
batched over layers of equal shape on the server's device (``aggregate_florg_layers``)."""

from __future__ import annotations

import numpy as np

from strategies.florg import check_rank_mismatch
from strategies.florg_torch import aggregate_florg_layers
from strategies.flower.base import AdapterStrategy, Reply, ReplyRejected, metric_number


class FLoRGStrategy(AdapterStrategy):
    """Clients send each layer's A (r x k); the server runs the FLoRG step on all of them.

    ``server_device``: 'auto' (CUDA when the ServerApp sees a GPU), 'cpu' or 'cuda'.
    ``rank_mismatch``: 'procrustes' (the paper) or 'truncate' (see ``strategies.florg``).
    """

    method = "florg"

    def __init__(
        self,
        *args,
        procrustes: bool = True,
        fingerprint: int | None = None,
        server_device: str = "auto",
        rank_mismatch: str = "procrustes",
        **kwargs,
    ) -> None:
        super().__init__(*args, **kwargs)
        from strategies.florg_torch import resolve_server_device

        self.procrustes = procrustes
        self.fingerprint = fingerprint
        self.rank_mismatch = check_rank_mismatch(rank_mismatch)
        self.server_device = resolve_server_device(server_device)  # 'cuda' without a GPU fails

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
        keys = [f"{layer}.A" for layer in self.layers()]
        # The replies' float32 arrays go in as they are (widened exactly on the device).
        new_As, per_layer = aggregate_florg_layers(
            {key: [p[key] for p in payloads] for key in keys},
            weights,
            {key: self.global_state[key] for key in keys},
            self.procrustes,
            device=str(self.server_device),
            rank_mismatch=self.rank_mismatch,
        )
        return dict(new_As), summarize_layers(per_layer)


def summarize_layers(per_layer: dict[str, dict[str, float]]) -> dict[str, float]:
    """Mean of each diagnostic over layers, plus the worst case (max / min) of each."""
    out: dict[str, float] = {}
    for name in ("rank", "gram_rel_error", "drift", "eigengap"):
        values = np.array([float(info[name]) for info in per_layer.values()])
        out[name] = float(values.mean())
        worst = values.min() if name in ("rank", "eigengap") else values.max()
        out[f"{name}_{'min' if name in ('rank', 'eigengap') else 'max'}"] = float(worst)
    return out
