"""The five baselines as Flower strategies, each calling its rule from strategies/."""

from __future__ import annotations

import numpy as np

from strategies.federa import aggregate_federa
from strategies.fedit import aggregate_fedit
from strategies.fedsa_lora import aggregate_fedsa_lora
from strategies.ffa_lora import aggregate_ffa_lora
from strategies.flower.base import AdapterStrategy


class FedITStrategy(AdapterStrategy):
    """Average B and A separately."""

    method = "fedit"

    def aggregate_adapter(self, server_round, payloads, weights):
        new: dict[str, np.ndarray] = {}
        for layer in self.layers():
            kb, ka = f"{layer}.lora_B", f"{layer}.lora_A"
            new[kb], new[ka] = aggregate_fedit(
                self.stacked(payloads, kb), self.stacked(payloads, ka), weights
            )
        return new, {}


class FeDeRAStrategy(AdapterStrategy):
    """Aggregate the products B_n A_n and re-factor by truncated SVD."""

    method = "federa"

    def aggregate_adapter(self, server_round, payloads, weights):
        new: dict[str, np.ndarray] = {}
        errors = []
        for layer in self.layers():
            kb, ka = f"{layer}.lora_B", f"{layer}.lora_A"
            new[kb], new[ka], info = aggregate_federa(
                self.stacked(payloads, kb), self.stacked(payloads, ka), weights
            )
            errors.append(info["trunc_rel_error"])
        return new, {"trunc_rel_error": float(np.mean(errors))}


class FFALoRAStrategy(AdapterStrategy):
    """Only B travels and is averaged; A stays frozen at its seeded initialisation."""

    method = "ffa-lora"

    def aggregate_adapter(self, server_round, payloads, weights):
        return {
            f"{layer}.lora_B": aggregate_ffa_lora(
                self.stacked(payloads, f"{layer}.lora_B"), weights
            )
            for layer in self.layers()
        }, {}


class FedSALoRAStrategy(AdapterStrategy):
    """Only A travels and is averaged; each client keeps its own B."""

    method = "fedsa-lora"

    def aggregate_adapter(self, server_round, payloads, weights):
        return {
            f"{layer}.lora_A": aggregate_fedsa_lora(
                self.stacked(payloads, f"{layer}.lora_A"), weights
            )
            for layer in self.layers()
        }, {}
