"""FedExLoRAStrategy: average B and A, and ship the exact residual so clients fold it into W0
(the folds' bookkeeping, resend and checkpoint: ``strategies/server/folding_strategy.py``)."""

from __future__ import annotations

import numpy as np

from flower_app.methods.contract import stacked
from strategies.fedex_lora.rule import aggregate_fedex_lora, fedex_from_means
from strategies.server.folding_strategy import FoldingStrategy
from strategies.shared.folds import Residual
from strategies.shared.product_sum import PRODUCT_SUFFIX


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

    def aggregate_means(
        self, server_round: int, mean: dict[str, np.ndarray]
    ) -> tuple[dict[str, np.ndarray], dict[str, float]]:
        """A secure round's update from the survivors' weighted mean contribution: per layer
        avg(B), avg(A) and avg(BA) ('<layer>.lora_BA'), the dense residual
        avg(BA) - avg(B) avg(A) (``fedex_from_means``), its folds recorded as
        ``aggregate_adapter`` records the plain round's."""
        if self.residual_mode != "dense":  # refused before launch (FedExLoRA.check_settings)
            raise ValueError("fedex-residual=factored stacks each client's factors: no sum")
        new: dict[str, np.ndarray] = {}
        residuals: dict[str, Residual] = {}
        for layer in self.layers():
            kb, ka = f"{layer}.lora_B", f"{layer}.lora_A"
            new[kb], new[ka], residuals[layer] = fedex_from_means(
                mean[kb], mean[ka], mean[layer + PRODUCT_SUFFIX]
            )
        return new, {"residual_norm": self.record_folds(server_round, residuals)}

    def state_json(self) -> dict:
        return {**super().state_json(), "residual-mode": self.residual_mode}

    def restore(self, arrays, state) -> None:
        if state.get("residual-mode") != self.residual_mode:
            raise ValueError("checkpoint of another fedex-residual mode")
        super().restore(arrays, state)
