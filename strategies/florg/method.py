"""FLoRG (paper §3): clients train one matrix A per layer (``W = W0 + s L AᵀA R``, L and R
fixed and identical on every node) and send it; the server averages the Gram matrices
AₙᵀAₙ, decomposes the average and aligns the factor with the previous A by orthogonal
Procrustes (Algorithm 1; ``strategies/florg/rule.py``, batched in
``strategies/florg/rule_torch.py``).

``florg-no-procrustes`` is the paper's ablation: the same step without the alignment.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from strategies.florg.settings import FLoRGSettings
from strategies.shared.base_method import BaseMethod

if TYPE_CHECKING:
    from flower_app.settings.run_settings import RunSettings

    class FLoRGConfig(RunSettings, FLoRGSettings):
        """What FLoRG reads: the core's settings and its own."""


@dataclass(frozen=True)
class FLoRG(BaseMethod):
    procrustes: bool = True
    # FLoRG's server-step settings, read by every method built on this class
    settings: type | None = FLoRGSettings

    def strategy_class(self) -> type:
        """The strategy ``build_strategy`` calls (a variant may return its own)."""
        from strategies.florg.strategy import FLoRGStrategy

        return FLoRGStrategy

    def secure_contribution(self, arrays, server_round):
        """Each layer's Gram AₙᵀAₙ (its upper triangle), the head as it is (secure.py)."""
        from strategies.florg.secure import gram_contribution

        return gram_contribution(arrays)

    def secure_shapes(self, uplink):
        from strategies.florg.secure import gram_shapes

        return gram_shapes(uplink)

    def aggregate_secure(self, strategy, server_round, mean, clients):
        """The FLoRG step from the mean Grams (``secure.aggregate_from_grams``); the head
        is the mean head."""
        from strategies.florg.secure import aggregate_from_grams
        from strategies.florg.strategy import summarize_layers

        keys = [f"{layer}.A" for layer in strategy.layers()]
        settings = strategy.round_loop.settings.secaggplus
        step = 2 * settings.clipping_range / settings.quantization_range
        # stochastic rounding errs by at most one step, std at most step / 2, per client: the
        # mean of the survivors' errs by step / (2 √N)
        rounding_std = step / (2 * max(clients, 1) ** 0.5)
        new, per_layer = aggregate_from_grams(
            mean,
            {key: strategy.global_state[key] for key in keys},
            clients,
            procrustes=strategy.procrustes,
            rank_mismatch=strategy.rank_mismatch,
            device=str(strategy.server_device),
            rounding_std=rounding_std,
        )
        new.update({key: mean[key] for key in strategy.head_keys()})
        return {**strategy.global_state, **new}, summarize_layers(per_layer)

    def secure_private_contribution(self, arrays, received, clipping_norm, server_round):
        """dp=central: the Grams of A clipped jointly with the head (``secure.py``)."""
        from strategies.florg.secure import private_contribution

        return private_contribution(arrays, received, clipping_norm)

    def aggregate_secure_private(self, strategy, server_round, sums, clients):
        """dp=central on the masked sum: the private FLoRG step from the summed Grams
        (``secure.private_from_grams``), the head by the mean mechanism with the same z."""
        from strategies.florg.dp import florg_sensitivity
        from strategies.florg.secure import private_from_grams
        from strategies.florg.strategy import summarize_layers

        dp, sent = strategy.dp, strategy.global_state
        m, sampled = strategy.private_divisor(server_round, clients)
        keys = [f"{layer}.A" for layer in strategy.layers()]
        new, per_layer, std = private_from_grams(
            sums, {key: sent[key] for key in keys}, clients, m, dp.clipping_norm,
            dp.noise_multiplier, dp.rng, procrustes=strategy.procrustes,
            device=str(strategy.server_device),
        )  # fmt: skip
        head_std = dp.noise_multiplier * dp.clipping_norm
        for key in strategy.head_keys():
            noise = dp.rng.normal(0.0, head_std, np.shape(sent[key]))
            new[key] = np.asarray(sent[key], np.float64) + (sums[key] + noise) / m
        info = summarize_layers(per_layer, ("rank", "drift", "eigengap", "negative_eigenvalues"))
        info["dp-sensitivity"] = florg_sensitivity(dp.clipping_norm, {k: sent[k] for k in keys})
        return {**sent, **new}, {**info, "dp-noise-std": std / m, **sampled}

    def build_strategy(self, config: FLoRGConfig, initial_state, *, fingerprint=None, run_dir=None):
        return self.strategy_class()(
            initial_state,
            method=self,
            procrustes=self.procrustes,
            fingerprint=fingerprint,
            server_device=config.server_device,
            rank_mismatch=config.rank_mismatch,
            fedavg_gap=config.fedavg_gap,
            **self.strategy_settings(config, run_dir=run_dir),
        )


FLORG = FLoRG(
    name="florg",
    summary="Gram aggregation of A, eigendecomposition, Procrustes alignment (the paper)",
    adapter="florg",
    shared=("A",),
    heterogeneous_ranks=True,
    # clip A - A_prev with the head; noised Gram mean; eigh, Procrustes (strategy.py)
    dp_mechanism="gram",
    async_update="gram",  # the Gram average moved by each stale reply's Gram delta
    secure_sum="gram",  # each client's Gram AₙᵀAₙ: the server decomposes their mean
)
FLORG_NO_PROCRUSTES = FLoRG(
    name="florg-no-procrustes",
    summary="FLoRG without the Procrustes alignment (the paper's ablation)",
    adapter="florg",
    shared=("A",),
    heterogeneous_ranks=True,
    dp_mechanism="gram",
    async_update="gram",
    secure_sum="gram",
    procrustes=False,
)

METHODS = (FLORG, FLORG_NO_PROCRUSTES)
