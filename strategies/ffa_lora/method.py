"""FFA-LoRA: A stays frozen at its seeded initialisation (the same on every node); only B
travels and is averaged (``strategies/ffa_lora/rule.py``)."""

from __future__ import annotations

from strategies.method import Method


class FFALoRA(Method):
    def dp_mechanism(self):
        return "mean"  # clip reply - sent over B and the head; noised mean

    def build_strategy(self, config, initial_state, *, fingerprint=None, run_dir=None):
        from strategies.common.lora_strategies import FFALoRAStrategy

        return FFALoRAStrategy(initial_state, **self.strategy_settings(config, run_dir=run_dir))


FFA_LORA = FFALoRA(
    name="ffa-lora",
    summary="A frozen and seeded, average B",
    adapter="lora",
    shared=("B",),
    frozen=("A",),
)

METHODS = (FFA_LORA,)
