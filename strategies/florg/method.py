"""FLoRG (paper §3): clients train one matrix A per layer (``W = W0 + s L AᵀA R``, L and R
fixed and identical on every node) and send it; the server averages the Gram matrices
AₙᵀAₙ, decomposes the average and aligns the factor with the previous A by orthogonal
Procrustes (Algorithm 1; ``strategies/florg/rule.py``, batched in
``strategies/florg/rule_torch.py``).

``florg-no-procrustes`` is the paper's ablation: the same step without the alignment.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from strategies.florg.settings import FLoRGSettings
from strategies.shared.base_method import BaseMethod

if TYPE_CHECKING:
    from flower_app.settings.run_settings import RunSettings

    class FLoRGConfig(RunSettings, FLoRGSettings):
        """What FLoRG reads: the core's settings and its own."""


@dataclass(frozen=True)
class FLoRG(BaseMethod):
    procrustes: bool = True
    # FLoRG's server-step settings, read by every method built on this class
    settings: type | None = FLoRGSettings

    def strategy_class(self) -> type:
        """The strategy ``build_strategy`` calls (a variant may return its own)."""
        from strategies.florg.strategy import FLoRGStrategy

        return FLoRGStrategy

    def build_strategy(self, config: FLoRGConfig, initial_state, *, fingerprint=None, run_dir=None):
        return self.strategy_class()(
            initial_state,
            method=self,
            procrustes=self.procrustes,
            fingerprint=fingerprint,
            server_device=config.server_device,
            rank_mismatch=config.rank_mismatch,
            fedavg_gap=config.fedavg_gap,
            **self.strategy_settings(config, run_dir=run_dir),
        )


FLORG = FLoRG(
    name="florg",
    summary="Gram aggregation of A, eigendecomposition, Procrustes alignment (the paper)",
    adapter="florg",
    shared=("A",),
    heterogeneous_ranks=True,
    # clip A - A_prev with the head; noised Gram mean; eigh, Procrustes (strategy.py)
    dp_mechanism="gram",
    async_update="gram",  # the Gram average moved by each stale reply's Gram delta
)
FLORG_NO_PROCRUSTES = FLoRG(
    name="florg-no-procrustes",
    summary="FLoRG without the Procrustes alignment (the paper's ablation)",
    adapter="florg",
    shared=("A",),
    heterogeneous_ranks=True,
    dp_mechanism="gram",
    async_update="gram",
    procrustes=False,
)

METHODS = (FLORG, FLORG_NO_PROCRUSTES)
