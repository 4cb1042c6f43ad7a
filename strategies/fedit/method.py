"""FedIT: LoRA's A and B travel and are averaged separately (``strategies/fedit/rule.py``)."""

from __future__ import annotations

from flower_app.methods.contract import adapter_layers, stacked
from strategies.shared.base_method import BaseMethod


class FedIT(BaseMethod):
    def aggregate(self, sent, payloads, weights):
        from strategies.fedit.rule import aggregate_fedit

        new = {}
        for layer in adapter_layers(sent):
            kb, ka = f"{layer}.lora_B", f"{layer}.lora_A"
            new[kb], new[ka] = aggregate_fedit(
                stacked(payloads, kb), stacked(payloads, ka), weights
            )
        return new, {}


FEDIT = FedIT(
    name="fedit",
    summary="average A and B separately",
    adapter="lora",
    shared=("A", "B"),
    dp_mechanism="mean",  # clip reply - sent over A, B and the head; noised mean
    async_update="mean",  # A and B each a weighted mean: the mean of the stale deltas
)

METHODS = (FEDIT,)
