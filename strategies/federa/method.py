"""FeDeRA: LoRA initialised from the SVD of W0 (``lora-init=federa-svd``, PEFT's
``pissa``); the server averages the products BₙAₙ and re-factors them by truncated SVD
(``strategies/federa/rule.py``)."""

from __future__ import annotations

import numpy as np

from flower_app.methods.contract import adapter_layers, stacked
from strategies.federa.settings import FeDeRASettings
from strategies.shared.base_method import BaseMethod


class FeDeRA(BaseMethod):
    def lora_init(self, config):
        """``lora-init=federa-svd``: the adapter's SVD initialisation; 'default': PEFT's."""
        return "svd" if config.lora_init == "federa-svd" else "default"

    def aggregate(self, sent, payloads, weights):
        from strategies.federa.rule import aggregate_federa

        new, errors = {}, []
        for layer in adapter_layers(sent):
            kb, ka = f"{layer}.lora_B", f"{layer}.lora_A"
            new[kb], new[ka], info = aggregate_federa(
                stacked(payloads, kb), stacked(payloads, ka), weights
            )
            errors.append(info["trunc_rel_error"])
        return new, {"trunc_rel_error": float(np.mean(errors))}

    def aggregate_private(self, dp, sent, payloads, num_sampled):
        from strategies.server.product_mean import product_mean_mechanism

        return product_mean_mechanism(dp, sent, payloads, num_sampled)


FEDERA = FeDeRA(
    name="federa",
    summary="average the products B A, re-factor by truncated SVD",
    adapter="lora",
    shared=("A", "B"),
    settings=FeDeRASettings,
    # clip the product updates B A - B_sent A_sent with the head; noised mean product
    dp_mechanism="product-mean",
)

METHODS = (FEDERA,)
