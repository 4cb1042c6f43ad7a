"""florg-signed: FLoRG with a fixed sign matrix in the core, ``W = W0 + s L AᵀDA R``,
D = diag(+1 for the first ⌈r/2⌉ rows of A, -1 for the rest).

FLoRG's core AᵀA is positive semi-definite, so in the L, R frame it reaches only those
updates; with D the core A₊ᵀA₊ - A₋ᵀA₋ reaches every symmetric matrix of rank <= r. The
server aggregates the two row blocks as two FLoRG steps (Gram average, eigendecomposition,
Procrustes per block; ``strategies/florg_signed/rule.py``): aggregation stays exact and linear
in the Gram matrices, and the traffic is FLoRG's (A, r x k per layer, each way). Under secure
aggregation each client sends each block's Gram (FLoRG's hooks over ``gram_blocks``).
"""

from __future__ import annotations

from dataclasses import dataclass

from strategies.florg.method import FLoRG


@dataclass(frozen=True)
class FLoRGSigned(FLoRG):
    def florg_signs(self, rank: int) -> tuple[float, ...]:
        from strategies.florg_signed.rule import row_signs

        return row_signs(rank)

    def gram_blocks(self, arrays) -> dict[str, tuple[str, slice]]:
        """Each layer's sign blocks, as ``FLoRGSignedStrategy.blocks()`` names them: under
        secure aggregation a client sends one Gram per block (FLoRG's secure hooks)."""
        from strategies.florg_signed.rule import signed_blocks

        return signed_blocks(arrays)

    def strategy_class(self) -> type:
        """FLoRG's step per sign block, built with FLoRG's options (``FLoRG.build_strategy``)."""
        from strategies.florg_signed.strategy import FLoRGSignedStrategy

        return FLoRGSignedStrategy


METHODS = (
    FLoRGSigned(
        name="florg-signed",
        summary="FLoRG with core AᵀDA, D = diag(+1, ..., -1, ...): each sign block as FLoRG",
        adapter="florg",
        shared=("A",),
        # each sign block through the Gram step as its own "layer"
        dp_mechanism="gram",
        # each sign block's Gram A_bᵀA_b: the server decomposes each block's mean
        secure_sum="gram",
    ),
)
