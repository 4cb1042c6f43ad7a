"""FLoRAStrategy: stack the clients' factors into the round's exact update, keep it as the
round's fold into W0 (sent to every client with its next training message, in the checkpoint:
``strategies/server/folding_strategy.py``) and send a fresh LoRA for the next round."""

from __future__ import annotations

import numpy as np

from flower_app.methods.contract import stacked
from strategies.flora.rule import fresh_lora, stack_flora
from strategies.server.folding_strategy import FoldingStrategy
from strategies.shared.folds import Residual


class FLoRAStrategy(FoldingStrategy):
    def __init__(self, *args, seed: int = 0, **kwargs) -> None:
        super().__init__(*args, fold_prefix="flora", **kwargs)
        self.seed = seed  # the fresh LoRA of round t is drawn from (seed, layer, t): resumable

    def aggregate_adapter(self, server_round, payloads, weights):
        from flower_app.adapters.florg.projections import seeded_rng

        new: dict[str, np.ndarray] = {}
        folds: dict[str, Residual] = {}
        for layer, parts in self.layers().items():
            kb, ka = f"{layer}.lora_B", f"{layer}.lora_A"
            folds[layer] = stack_flora(stacked(payloads, kb), stacked(payloads, ka), weights)
            (d_out, r), d_in = parts["lora_B"].shape, parts["lora_A"].shape[1]
            rng = seeded_rng(self.seed, layer, f"flora-round-{server_round + 1}")
            new[kb], new[ka] = fresh_lora(rng, d_out, d_in, r)
        return new, {"update_norm": self.record_folds(server_round, folds)}

    def state_json(self) -> dict:
        return {**super().state_json(), "seed": self.seed}

    def restore(self, arrays, state) -> None:
        if state.get("seed") != self.seed:
            raise ValueError("checkpoint of a run with another seed (its fresh LoRAs differ)")
        super().restore(arrays, state)
