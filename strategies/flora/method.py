"""FLoRA: clients train a fresh LoRA every round; the server stacks their factors into the
exact update sum_n w_n B_n A_n (``strategies/flora/rule.py``), which every client and the
server's evaluator fold into W0 (``strategies/shared/folds.py``), and sends the next round's
fresh LoRA. Up: B and A; down: the fresh B and A, plus the last round's stacked factors,
N r (d_out + d_in) per layer, growing with the number of clients. Under secure aggregation
each client adds its products BₙAₙ (``secure_sum='product'``) and the server factors their
mean at the stack's width (``factor_mean_product``): the same update, never one client's.

Client weights: its authors weight each client by its dataset size (n_k / sum n, their
``_agg_flora`` ratio); ``aggregation-weights=num-examples`` reproduces that, the default
``uniform`` is the evidence protocol's rule for every method (docs/architecture.md).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np

from strategies.shared.folds import FoldsIntoW0
from strategies.shared.product_sum import product_contribution, product_shapes

if TYPE_CHECKING:
    from flower_app.settings.run_settings import RunSettings
    from strategies.flora.strategy import FLoRAStrategy


# Why dp=central is refused rather than noised. FLoRA's round releases the dense product
# sum_n w_n B_n A_n and folds it into W0 whole, with no truncation afterwards. A Gaussian
# mechanism on it needs the product update's sensitivity (the clipped unit would be each
# client's B_n A_n, dense d_out x d_in), and its noise, std z C / m on each of the
# d_out d_in entries, would enter W0 every round and never leave: full-rank noise of norm
# about z C sqrt(d_out d_in) / m per layer against a signal bounded by C / m. The noised
# product has no stacked factors either, so it would travel dense. That is DP fine-tuning
# of W0, not FLoRA's exact stacking.
FLORA_REFUSAL = (
    "dp: dp=central is not supported for flora: its round folds the dense product of the "
    "stacked factors into W0 with no truncation, so Gaussian noise on it would be full-rank "
    "and accumulate in W0 (docs/privacy.md, section 8); use a method with a mechanism, "
    "florg among them"
)


class FLoRA(FoldsIntoW0):
    fold_prefix = "flora"  # its context keys 'flora-cumulative-residual', ... (folds.py)

    # -- secure aggregation (secure_sum='product'): the update from the mean product --------
    def secure_contribution(self, arrays, server_round, *, received=None, config=None):
        """Each layer's product BₙAₙ (d_out × d_in, float64) and the head: their weighted
        mean is the round's update Σ wₙBₙAₙ, which the plain round stacks."""
        return product_contribution(arrays)

    def secure_shapes(self, uplink: Mapping[str, np.ndarray]) -> dict[str, tuple[int, ...]]:
        return product_shapes(uplink)

    def aggregate_secure(
        self, strategy: FLoRAStrategy, server_round: int, mean: dict[str, np.ndarray], clients: int
    ) -> tuple[dict[str, np.ndarray], dict[str, float]]:
        """The fold factored from the mean product, a fresh LoRA, the mean head
        (``FLoRAStrategy.aggregate_mean_product``, which records the fold)."""
        return strategy.aggregate_mean_product(server_round, mean, clients)

    def build_strategy(self, config: RunSettings, initial_state, *, fingerprint=None, run_dir=None):
        from strategies.flora.strategy import FLoRAStrategy

        return FLoRAStrategy(
            initial_state,
            method=self,
            seed=config.seed,
            **self.strategy_settings(config, run_dir=run_dir),
        )

    def extra_down_params(self, d_out, d_in, r, num_clients, config: RunSettings | None):
        """The last round's stacked factors: N r (d_out + d_in), r_n summed over clients of
        different rank."""
        return num_clients * r * (d_out + d_in)


FLORA = FLoRA(
    name="flora",
    summary="stack the clients' B and A into the exact update, fold it into W0, restart LoRA",
    adapter="lora",
    shared=("A", "B"),
    heterogeneous_ranks=True,  # the stack takes any r_n
    dp_refusal=FLORA_REFUSAL,
    writes_base_weights=True,  # the fold
    # each client's product BₙAₙ; the server factors their mean at the stack's width
    secure_sum="product",
)

METHODS = (FLORA,)
