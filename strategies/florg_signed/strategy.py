"""FLoRGSignedStrategy: FLoRG's server step per sign block of A (``rule.sign_blocks``),
batched over layers on the server's device; its central DP is FLoRG's Gram mechanism over
the same blocks. The sign blocks split one common rank, so the method declares no
heterogeneous ranks."""

from __future__ import annotations

import numpy as np

from strategies.florg.rule_torch import aggregate_florg_layers
from strategies.florg.strategy import FLoRGStrategy
from strategies.florg_signed.rule import sign_blocks, signed_blocks


class FLoRGSignedStrategy(FLoRGStrategy):
    """florg-signed: each layer's A = [A₊; A₋] is aggregated as two FLoRG blocks (the
    Gram average of each, decomposed and aligned with the previous block by Procrustes),
    so the core A₊ᵀA₊ - A₋ᵀA₋ averages exactly where each block's rank fits."""

    def blocks(self) -> dict[str, tuple[str, slice]]:
        """Each sign block of each layer's A (the blocks partition A's rows, so the joint
        clipping and Delta of FLoRG cover them: docs/privacy.md section 4.3); the method's
        ``gram_blocks`` names a client's the same way (secure aggregation)."""
        return signed_blocks({f"{layer}.A": self.global_state[f"{layer}.A"]
                              for layer in self.layers()})  # fmt: skip

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
