"""FeDeRA: LoRA initialised from the SVD of W0 (``lora-init=federa-svd``, PEFT's
``pissa``); the server averages the products BₙAₙ and re-factors them by truncated SVD
(``strategies/federa/rule.py``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from strategies.federa.settings import FeDeRASettings
from strategies.shared.per_layer import LORA_PARTS, aggregate_per_layer
from strategies.shared.product_sum import ProductSumMethod

if TYPE_CHECKING:
    from flower_app.settings.run_settings import RunSettings

    class FeDeRAConfig(RunSettings, FeDeRASettings):
        """What FeDeRA reads: the core's settings and its own."""


class FeDeRA(ProductSumMethod):
    def lora_init(self, config: FeDeRAConfig):
        """``lora-init=federa-svd``: the adapter's SVD initialisation; 'default': PEFT's."""
        return "svd" if config.lora_init == "federa-svd" else "default"

    def aggregate(self, sent, payloads, weights):
        from strategies.federa.rule import aggregate_federa

        new, infos = aggregate_per_layer(sent, payloads, weights, LORA_PARTS, aggregate_federa)
        errors = [info["trunc_rel_error"] for info in infos]
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
    # each client's product BₙAₙ: the rule's truncated SVD of their mean (product_sum.py)
    secure_sum="product",
)

METHODS = (FEDERA,)
