"""FeDeRA: LoRA initialised from the SVD of W0 (``lora-init=federa-svd``, PEFT's
``pissa``); the server averages the products BₙAₙ and re-factors them by truncated SVD
(``strategies/federa/rule.py``)."""

from __future__ import annotations

from strategies.method import Method


class FeDeRA(Method):
    def dp_mechanism(self):
        return "product-mean"  # clip the product updates B A - B_sent A_sent with the head

    def lora_init(self, config):
        return config.lora_init

    def build_strategy(self, config, initial_state, *, fingerprint=None, run_dir=None):
        from strategies.common.lora_strategies import FeDeRAStrategy

        return FeDeRAStrategy(initial_state, **self.strategy_settings(config, run_dir=run_dir))


FEDERA = FeDeRA(
    name="federa",
    summary="average the products B A, re-factor by truncated SVD",
    adapter="lora",
    shared=("A", "B"),
)

METHODS = (FEDERA,)
