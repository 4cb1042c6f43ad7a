"""FedIT: LoRA's A and B travel and are averaged separately (``strategies/fedit/rule.py``)."""

from __future__ import annotations

from strategies.shared.base_method import BaseMethod
from strategies.shared.per_layer import LORA_PARTS, aggregate_per_layer


class FedIT(BaseMethod):
    def aggregate(self, sent, payloads, weights):
        from strategies.fedit.rule import aggregate_fedit

        new, _ = aggregate_per_layer(sent, payloads, weights, LORA_PARTS, aggregate_fedit)
        return new, {}


FEDIT = FedIT(
    name="fedit",
    summary="average A and B separately",
    adapter="lora",
    shared=("A", "B"),
    dp_mechanism="mean",  # clip reply - sent over A, B and the head; noised mean
    async_update="mean",  # A and B each a weighted mean: the mean of the stale deltas
    secure_sum="mean",  # A and B each a weighted mean
)

METHODS = (FEDIT,)
