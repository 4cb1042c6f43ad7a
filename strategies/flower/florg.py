"""FLoRGStrategy: Gram aggregation + decomposition + Procrustes for every adapted layer,
batched over layers of equal shape on the server's device (``aggregate_florg_layers``);
FLoRGSignedStrategy: the same step per sign block of A (``strategies.florg_signed``).

Every round also records how far the server step lands from plain FedAvg on A, under both
rank-mismatch policies (``fedavg_gap_procrustes``, ``fedavg_gap_truncate``; mean over
layers of ||A_new - Σ wₙ Aₙ||_F / ||A_new - A_prev||_F). With N r > r (every round of a
federation) the paper's Procrustes over all r' = N r rows can land close to the plain
mean, which would make FLoRG FedAvg on A in effect; this key measures it in every run."""

from __future__ import annotations

import numpy as np

from strategies.florg import RANK_MISMATCH_POLICIES, check_rank_mismatch
from strategies.florg_signed import sign_blocks
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

    def server_step(
        self, payloads: list[dict[str, np.ndarray]], weights: np.ndarray, rank_mismatch: str
    ) -> tuple[dict[str, np.ndarray], dict[str, dict[str, float]]]:
        """The new A of every layer ('<layer>.A') and the diagnostics per aggregated block."""
        keys = [f"{layer}.A" for layer in self.layers()]
        # The replies' float32 arrays go in as they are (widened exactly on the device).
        new_As, per_layer = aggregate_florg_layers(
            {key: [p[key] for p in payloads] for key in keys},
            weights,
            {key: self.global_state[key] for key in keys},
            self.procrustes,
            device=str(self.server_device),
            rank_mismatch=rank_mismatch,
        )
        return dict(new_As), per_layer

    def aggregate_adapter(self, server_round, payloads, weights):
        new_As, per_layer = self.server_step(payloads, weights, self.rank_mismatch)
        info = summarize_layers(per_layer)
        if self.procrustes:
            info |= self.fedavg_gaps(payloads, weights, new_As)
        return new_As, info

    def fedavg_gaps(
        self,
        payloads: list[dict[str, np.ndarray]],
        weights: np.ndarray,
        new_As: dict[str, np.ndarray],
    ) -> dict[str, float]:
        """``fedavg_gap_<policy>`` for both rank-mismatch policies: the mean over layers of
        ||A_new - Σ wₙ Aₙ||_F / ||A_new - A_prev||_F (the run's own policy from ``new_As``,
        the other one computed here and discarded)."""
        out = {}
        for policy in RANK_MISMATCH_POLICIES:
            As = new_As if policy == self.rank_mismatch else self.server_step(
                payloads, weights, policy
            )[0]  # fmt: skip
            gaps = []
            for key, new in As.items():
                mean = sum(
                    w * p[key].astype(np.float64) for w, p in zip(weights, payloads, strict=True)
                )
                move = float(np.linalg.norm(new - self.global_state[key]))
                gaps.append(float(np.linalg.norm(new - mean)) / move if move > 0 else np.nan)
            out[f"fedavg_gap_{policy}"] = float(np.nanmean(gaps)) if gaps else np.nan
        return out


class FLoRGSignedStrategy(FLoRGStrategy):
    """florg-signed: each layer's A = [A₊; A₋] is aggregated as two FLoRG blocks (the
    Gram average of each, decomposed and aligned with the previous block by Procrustes),
    so the core A₊ᵀA₊ - A₋ᵀA₋ averages exactly where each block's rank fits."""

    method = "florg-signed"

    def server_step(self, payloads, weights, rank_mismatch):
        keys = [f"{layer}.A" for layer in self.layers()]
        blocks: dict[str, list[np.ndarray]] = {}
        prev: dict[str, np.ndarray] = {}
        for key in keys:
            for i, rows in enumerate(sign_blocks(self.global_state[key].shape[0])):
                blocks[f"{key}#{i}"] = [p[key][rows] for p in payloads]
                prev[f"{key}#{i}"] = self.global_state[key][rows]
        new_blocks, per_block = aggregate_florg_layers(
            blocks, weights, prev, self.procrustes,
            device=str(self.server_device), rank_mismatch=rank_mismatch,
        )  # fmt: skip
        new_As = {
            key: np.concatenate([b for name, b in new_blocks.items() if name.split("#")[0] == key])
            for key in keys
        }
        return new_As, per_block


def summarize_layers(per_layer: dict[str, dict[str, float]]) -> dict[str, float]:
    """Mean of each diagnostic over layers, plus the worst case (max / min) of each."""
    out: dict[str, float] = {}
    for name in ("rank", "gram_rel_error", "drift", "eigengap"):
        values = np.array([float(info[name]) for info in per_layer.values()])
        out[name] = float(values.mean())
        worst = values.min() if name in ("rank", "eigengap") else values.max()
        out[f"{name}_{'min' if name in ('rank', 'eigengap') else 'max'}"] = float(worst)
    return out
