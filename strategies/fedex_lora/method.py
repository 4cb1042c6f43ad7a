"""FedEx-LoRA: the separate averages of A and B, plus the exact residual
``Σ wₙBₙAₙ − B̄Ā`` that every client folds into its frozen W0 (``strategies/fedex_lora/rule.py``).

How a residual reaches every client and is folded into W0, and how the server's evaluator
folds it: ``strategies/shared/folds.py``. The residual travels dense (the paper's version) or
as exact factors of rank ≤ (N + 1) r (``fedex-residual=factored``, ours). Under secure
aggregation (dense only) each client adds its A, B and BₙAₙ, whose means give the round.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np

from strategies.fedex_lora.settings import FedExLoRASettings
from strategies.shared.folds import FoldsIntoW0
from strategies.shared.product_sum import product_contribution, product_shapes

if TYPE_CHECKING:
    from flower_app.settings.run_settings import RunSettings
    from strategies.fedex_lora.strategy import FedExLoRAStrategy

    class FedExLoRAConfig(RunSettings, FedExLoRASettings):
        """What FedEx-LoRA reads: the core's settings and its own."""


# Why dp=central is refused rather than noised. The round's result is (avg B, avg A,
# residual) with residual = sum_n w_n B_n A_n - avg(B) avg(A), folded into W0 so that the
# model equals the exact mean of the products. The residual is quadratic in each client's
# factors: its sensitivity is that of the product update B_n A_n - B A = dB A + B dA + dB dA,
# a second Gaussian release on a dense d_out x d_in matrix. Unlike the SVD and Gram rules, which
# truncate to rank r after the noise, FedEx keeps the residual exactly, so full-rank noise
# of Frobenius norm ~ sigma sqrt(d_out d_in) would enter W0 every round and never leave.
FEDEX_REFUSAL = (
    "dp: dp=central is not supported for fedex-lora: its residual is quadratic in each "
    "client's factors and is folded into W0 whole every round, so Gaussian noise on it "
    "would be full-rank and accumulate in W0 (docs/privacy.md, section 8); use a method "
    "with a mechanism, florg among them"
)
# Why fedex-residual=factored is refused under secure aggregation: its residual travels as
# the stacked factors P = [B_s, -avg(B)], Q = [A_s; avg(A)], one block per client, which the
# server must hold one by one; a secure round gives it sums only.
FACTORED_SECURE_REFUSAL = (
    "fedex-residual: fedex-residual=factored cannot run under secure aggregation: its "
    "residual stacks each client's factors (one block per client), which a sum of the "
    "clients' contributions does not give; use fedex-residual=dense (the paper's version)"
)


class FedExLoRA(FoldsIntoW0):
    fold_prefix = "fedex"  # its context keys 'fedex-cumulative-residual', ... (folds.py)

    def check_settings(self, config: FedExLoRAConfig) -> None:
        """The common checks, and: the factored residual has no secure sum."""
        super().check_settings(config)
        if config.secure_aggregation != "off" and config.fedex_residual == "factored":
            raise ValueError(FACTORED_SECURE_REFUSAL)

    # -- secure aggregation (secure_sum='mean-and-product'): the round from three means --
    def secure_contribution(
        self,
        arrays: Mapping[str, np.ndarray],
        server_round: int,
        *,
        received: Mapping[str, np.ndarray] | None = None,
        config: RunSettings | None = None,
    ) -> dict[str, np.ndarray]:
        """A, B and the head as uploaded, and each layer's product BₙAₙ under
        '<layer>.lora_BA' (float64): their weighted means are avg(A), avg(B) and
        Σ wₙBₙAₙ, from which the server builds the residual."""
        return {
            **super().secure_contribution(arrays, server_round),
            **product_contribution(arrays),
        }

    def secure_shapes(self, uplink: Mapping[str, np.ndarray]) -> dict[str, tuple[int, ...]]:
        return {**super().secure_shapes(uplink), **product_shapes(uplink)}

    def aggregate_secure(
        self,
        strategy: FedExLoRAStrategy,
        server_round: int,
        mean: dict[str, np.ndarray],
        clients: int,
    ) -> tuple[dict[str, np.ndarray], dict[str, float]]:
        """B̄ = avg(B), Ā = avg(A), residual = Σ wₙBₙAₙ − B̄Ā from the mean contribution
        (``FedExLoRAStrategy.aggregate_means``, which records the folds); the mean head."""
        new_state, info = strategy.aggregate_means(server_round, mean)
        new_state.update({key: mean[key] for key in strategy.head_keys()})
        return {**strategy.global_state, **new_state}, info

    def build_strategy(
        self, config: FedExLoRAConfig, initial_state, *, fingerprint=None, run_dir=None
    ):
        from strategies.fedex_lora.strategy import FedExLoRAStrategy

        return FedExLoRAStrategy(
            initial_state,
            method=self,
            residual_mode=config.fedex_residual,
            **self.strategy_settings(config, run_dir=run_dir),
        )

    def extra_down_params(self, d_out, d_in, r, num_clients, config: FedExLoRAConfig | None):
        """The residual sent down (``fedex-residual``): d_out d_in (dense, the paper's
        version) or (N + 1) r (d_out + d_in) (its exact factors)."""
        from strategies.fedex_lora.rule import RESIDUAL_MODES

        mode = FedExLoRASettings.fedex_residual if config is None else config.fedex_residual
        if mode not in RESIDUAL_MODES:
            raise ValueError(f"fedex-residual {mode!r} unknown; choose one of {RESIDUAL_MODES}")
        if mode == "dense":
            return d_out * d_in
        return (num_clients + 1) * r * (d_out + d_in)


FEDEX_LORA = FedExLoRA(
    name="fedex-lora",
    summary="average A and B, clients fold the exact residual into W0",
    adapter="lora",
    shared=("A", "B"),
    settings=FedExLoRASettings,
    dp_refusal=FEDEX_REFUSAL,
    writes_base_weights=True,  # the residual fold
    # fedex-residual=dense: each client's A, B and BₙAₙ, whose means give avg(B), avg(A) and
    # the residual Σ wₙBₙAₙ − avg(B) avg(A); factored is refused (check_settings)
    secure_sum="mean-and-product",
)

METHODS = (FEDEX_LORA,)
