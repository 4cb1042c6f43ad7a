"""FlexLoRA (Bai et al., 2024): LoRA clients of different rank; the server averages the
products BₙAₙ (as factors, never d_out x d_in) and hands each client the truncated SVD at
its rank, singular values split symmetrically (``strategies/flexlora/rule.py``).  With equal
ranks: the SVD re-factoring of the weighted product."""

from __future__ import annotations

import numpy as np

from strategies.shared.per_layer import LORA_PARTS, aggregate_per_layer
from strategies.shared.product_sum import ProductSumMethod


class FlexLoRA(ProductSumMethod):
    def aggregate(self, sent, payloads, weights):
        """Each node is then sent the first r_n singular directions, its own truncated SVD
        (the common strategy's ``sent_state``: the top r_n rows of A and columns of B)."""
        from flower_app.wire.ranks import rank_of
        from strategies.flexlora.rule import aggregate_flexlora

        new, infos = aggregate_per_layer(
            sent, payloads, weights, LORA_PARTS, aggregate_flexlora, rank=rank_of(sent)
        )
        errors = [info["trunc_rel_error"] for info in infos]
        return new, {"trunc_rel_error": float(np.mean(errors))}

    def aggregate_private(self, dp, sent, payloads, num_sampled):
        """With one common rank (dp=central refuses client-ranks) the rule is linear in the
        products: the product-mean mechanism."""
        from strategies.server.product_mean import product_mean_mechanism

        return product_mean_mechanism(dp, sent, payloads, num_sampled)


FLEXLORA = FlexLoRA(
    name="flexlora",
    summary="average the products B A over ranks, truncated SVD at each client's rank",
    adapter="lora",
    shared=("A", "B"),
    heterogeneous_ranks=True,
    dp_mechanism="product-mean",
    # one common rank (client-ranks is refused): each client's product BₙAₙ, the truncated
    # SVD of their mean at the global rank (product_sum.py)
    secure_sum="product",
)

METHODS = (FLEXLORA,)
