"""FLoRAStrategy: stack the clients' factors into the round's exact update (under secure
aggregation: factor the mean product), keep it as the round's fold into W0 (sent to every
client with its next training message, in the checkpoint: ``strategies/server/
folding_strategy.py``) and send a fresh LoRA for the next round."""

from __future__ import annotations

import numpy as np

from flower_app.methods.contract import stacked
from strategies.flora.rule import factor_mean_product, fresh_lora, stack_flora
from strategies.server.folding_strategy import FoldingStrategy
from strategies.shared.folds import Residual
from strategies.shared.product_sum import PRODUCT_SUFFIX


class FLoRAStrategy(FoldingStrategy):
    def __init__(self, *args, seed: int = 0, **kwargs) -> None:
        super().__init__(*args, fold_prefix="flora", **kwargs)
        self.seed = seed  # the fresh LoRA of round t is drawn from (seed, layer, t): resumable

    def aggregate_adapter(self, server_round, payloads, weights):
        folds: dict[str, Residual] = {}
        for layer in self.layers():
            kb, ka = f"{layer}.lora_B", f"{layer}.lora_A"
            folds[layer] = stack_flora(stacked(payloads, kb), stacked(payloads, ka), weights)
        return self.fresh_state(server_round), {
            "update_norm": self.record_folds(server_round, folds)
        }

    def aggregate_mean_product(
        self, server_round: int, mean: dict[str, np.ndarray], clients: int
    ) -> tuple[dict[str, np.ndarray], dict[str, float]]:
        """A secure round: the fold from each layer's mean product (``factor_mean_product``
        at the stack's width, ``clients`` times the rank), a fresh LoRA, the mean head."""
        folds = {
            layer: factor_mean_product(
                mean[layer + PRODUCT_SUFFIX], clients * np.shape(parts["lora_B"])[1]
            )
            for layer, parts in self.layers().items()
        }
        new = self.fresh_state(server_round)
        new.update({key: np.asarray(mean[key], np.float64) for key in self.head_keys()})
        info = {"update_norm": self.record_folds(server_round, folds)}
        return {**self.global_state, **new}, info

    def fresh_state(self, server_round: int) -> dict[str, np.ndarray]:
        """Round ``server_round + 1``'s fresh LoRA, drawn from (seed, layer, round)."""
        from flower_app.adapters.florg.projections import seeded_rng

        new: dict[str, np.ndarray] = {}
        for layer, parts in self.layers().items():
            (d_out, r), d_in = parts["lora_B"].shape, parts["lora_A"].shape[1]
            rng = seeded_rng(self.seed, layer, f"flora-round-{server_round + 1}")
            new[f"{layer}.lora_B"], new[f"{layer}.lora_A"] = fresh_lora(rng, d_out, d_in, r)
        return new

    def state_json(self) -> dict:
        return {**super().state_json(), "seed": self.seed}

    def restore(self, arrays, state) -> None:
        if state.get("seed") != self.seed:
            raise ValueError("checkpoint of a run with another seed (its fresh LoRAs differ)")
        super().restore(arrays, state)
