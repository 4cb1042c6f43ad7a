"""FFA-LoRA: A stays frozen at its seeded initialisation (the same on every node); only B
travels and is averaged (``strategies/ffa_lora/rule.py``)."""

from __future__ import annotations

from strategies.shared.base_method import BaseMethod
from strategies.shared.per_layer import aggregate_per_layer


class FFALoRA(BaseMethod):
    def aggregate(self, sent, payloads, weights):
        from strategies.ffa_lora.rule import aggregate_ffa_lora

        new, _ = aggregate_per_layer(sent, payloads, weights, ("lora_B",), aggregate_ffa_lora)
        return new, {}


FFA_LORA = FFALoRA(
    name="ffa-lora",
    summary="A frozen and seeded, average B",
    adapter="lora",
    shared=("B",),
    frozen=("A",),
    dp_mechanism="mean",  # clip reply - sent over B and the head; noised mean
    async_update="mean",  # B a weighted mean: the mean of the stale deltas
    secure_sum="mean",  # B a weighted mean
)

METHODS = (FFA_LORA,)
