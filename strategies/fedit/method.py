"""FedIT: LoRA's A and B travel and are averaged separately (``strategies/fedit/rule.py``)."""

from __future__ import annotations

from strategies.method import Method


class FedIT(Method):
    def dp_mechanism(self):
        return "mean"  # clip reply - sent over A, B and the head; noised mean

    def build_strategy(self, config, initial_state, *, fingerprint=None, run_dir=None):
        from strategies.common.lora_strategies import FedITStrategy

        return FedITStrategy(initial_state, **self.strategy_settings(config, run_dir=run_dir))


FEDIT = FedIT(
    name="fedit",
    summary="average A and B separately",
    adapter="lora",
    shared=("A", "B"),
)

METHODS = (FEDIT,)
