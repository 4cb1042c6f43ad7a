"""FedSA-LoRA: A travels and is averaged (``strategies/fedsa_lora/rule.py``); each client keeps
its own B between rounds (in its Flower context, and on disk under
``$FLORG_NODE_STATE_DIR`` when the operator sets it), so the global model is evaluated
with B = 0 and the clients evaluate their personalised models."""

from __future__ import annotations

from strategies.shared.base_method import BaseMethod
from strategies.shared.per_layer import aggregate_per_layer


class FedSALoRA(BaseMethod):
    def aggregate(self, sent, payloads, weights):
        from strategies.fedsa_lora.rule import aggregate_fedsa_lora

        new, _ = aggregate_per_layer(sent, payloads, weights, ("lora_A",), aggregate_fedsa_lora)
        return new, {}


FEDSA_LORA = FedSALoRA(
    name="fedsa-lora",
    summary="average A, each client keeps its own B",
    adapter="lora",
    shared=("A",),
    local=("B",),
    dp_mechanism="mean",  # clip reply - sent over A and the head; noised mean (B stays)
    secure_sum="mean",  # A a weighted mean; B stays on the client
)

METHODS = (FEDSA_LORA,)
