"""RoLoRA: clients train B in odd rounds and A in even rounds; only the trained factor travels
up and is averaged, exactly (``strategies/rolora/rule.py``). Both factors travel down, so a
client that missed a round starts from the global model."""

from __future__ import annotations

import numpy as np

from flower_app.methods.contract import stacked
from strategies.shared.base_method import BaseMethod
from strategies.shared.per_layer import LORA_PARTS, layer_keys


class RoLoRA(BaseMethod):
    def trained_parts(self, server_round):
        from strategies.rolora.rule import rolora_part

        return (rolora_part(server_round),)

    def aggregate(self, sent, payloads, weights):
        from strategies.rolora.rule import aggregate_rolora

        new = {}
        for keys in layer_keys(sent, LORA_PARTS):
            for key in keys:
                moved = key in payloads[0]  # the round's trained factor
                new[key] = (
                    aggregate_rolora(stacked(payloads, key), weights)
                    if moved
                    else np.asarray(sent[key], np.float64)
                )
        return new, {}


ROLORA = RoLoRA(
    name="rolora",
    summary="alternate rounds: train and average B, then A",
    adapter="lora",
    shared=("A", "B"),
    # clip reply - sent over the round's trained factor and the head; noised mean
    dp_mechanism="mean",
    secure_sum="mean",  # the round's trained factor a weighted mean
)

METHODS = (ROLORA,)
