"""FedSA-LoRA: A travels and is averaged (``strategies/fedsa_lora/rule.py``); each client keeps
its own B between rounds (in its Flower context, and on disk under
``$FLORG_NODE_STATE_DIR`` when the operator sets it), so the global model is evaluated
with B = 0 and the clients evaluate their personalised models."""

from __future__ import annotations

from strategies.method import Method


class FedSALoRA(Method):
    def dp_mechanism(self):
        return "mean"  # clip reply - sent over A and the head; noised mean (B never leaves)

    def build_strategy(self, config, initial_state, *, fingerprint=None, run_dir=None):
        from strategies.common.lora_strategies import FedSALoRAStrategy

        return FedSALoRAStrategy(initial_state, **self.strategy_settings(config, run_dir=run_dir))


FEDSA_LORA = FedSALoRA(
    name="fedsa-lora",
    summary="average A, each client keeps its own B",
    adapter="lora",
    shared=("A",),
    local=("B",),
)

METHODS = (FEDSA_LORA,)
