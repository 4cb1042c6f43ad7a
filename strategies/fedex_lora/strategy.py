"""FedExLoRAStrategy: average B and A, and ship the exact residual so clients fold it into W0
(the folds' bookkeeping, resend and checkpoint: ``strategies/server/folding_strategy.py``)."""

from __future__ import annotations

import numpy as np

from flower_app.methods.contract import stacked
from strategies.fedex_lora.rule import aggregate_fedex_lora
from strategies.server.folding_strategy import FoldingStrategy
from strategies.shared.folds import Residual


class FedExLoRAStrategy(FoldingStrategy):
    def __init__(self, *args, residual_mode: str = "dense", **kwargs) -> None:
        super().__init__(*args, fold_prefix="fedex", **kwargs)
        self.residual_mode = residual_mode

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
        return new, {"residual_norm": self.record_folds(server_round, residuals)}

    def state_json(self) -> dict:
        return {**super().state_json(), "residual-mode": self.residual_mode}

    def restore(self, arrays, state) -> None:
        if state.get("residual-mode") != self.residual_mode:
            raise ValueError("checkpoint of another fedex-residual mode")
        super().restore(arrays, state)
