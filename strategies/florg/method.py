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

    def gram_blocks(self, arrays) -> dict[str, tuple[str, slice]]:
        """The units of its Gram step over the factors of ``arrays``, name -> (A key, rows),
        as its strategy's ``blocks()`` names them: each layer's whole A."""
        from strategies.florg.secure import whole_factors

        return whole_factors(arrays)

    def secure_contribution(self, arrays, server_round, *, received=None, config=None):
        """Each block's Gram A_bᵀA_b (its upper triangle), the head as it is (secure.py)."""
        from strategies.florg.secure import gram_contribution

        return gram_contribution(arrays, self.gram_blocks(arrays))

    def secure_shapes(self, uplink):
        from strategies.florg.secure import gram_shapes

        return gram_shapes(uplink, self.gram_blocks(uplink))

    def aggregate_secure(self, strategy, server_round, mean, clients):
        """The FLoRG step from each block's mean Gram (``secure.aggregate_from_grams``, the
        strategy's ``blocks()``), the blocks' rows stacked back into each layer's A; the head
        is the mean head."""
        from strategies.florg.secure import aggregate_from_grams, join_blocks
        from strategies.florg.strategy import summarize_layers

        blocks, sent = strategy.blocks(), strategy.global_state
        settings = strategy.round_loop.settings.secaggplus
        step = 2 * settings.clipping_range / settings.quantization_range
        # stochastic rounding errs by at most one step, std at most step / 2, per client: the
        # mean of the survivors' errs by step / (2 √N)
        rounding_std = step / (2 * max(clients, 1) ** 0.5)
        new, per_block = aggregate_from_grams(
            mean,
            {name: sent[key][rows] for name, (key, rows) in blocks.items()},
            clients,
            procrustes=strategy.procrustes,
            rank_mismatch=strategy.rank_mismatch,
            device=str(strategy.server_device),
            rounding_std=rounding_std,
        )
        new_As = join_blocks(new, blocks)
        new_As.update({key: mean[key] for key in strategy.head_keys()})
        return {**sent, **new_As}, summarize_layers(per_block)

    def secure_private_contribution(
        self, arrays, received, clipping_norm, server_round, *, config=None
    ):
        """dp=central: the blocks' Grams of A clipped jointly with the head (``secure.py``)."""
        from strategies.florg.secure import private_contribution

        return private_contribution(arrays, received, clipping_norm, self.gram_blocks(arrays))

    def aggregate_secure_private(self, strategy, server_round, sums, clients):
        """dp=central on the masked sum: the private FLoRG step from each block's summed Gram
        (``secure.private_from_grams``, the strategy's ``blocks()`` as the plain mechanism's),
        the head by the mean mechanism with the same z."""
        from strategies.florg.dp import florg_sensitivity
        from strategies.florg.secure import join_blocks, private_from_grams
        from strategies.florg.strategy import summarize_layers

        dp, sent, blocks = strategy.dp, strategy.global_state, strategy.blocks()
        m, sampled = strategy.private_divisor(server_round, clients)
        prev = {name: sent[key][rows] for name, (key, rows) in blocks.items()}
        new_blocks, per_block, std = private_from_grams(
            sums, prev, clients, m, dp.clipping_norm, dp.noise_multiplier, dp.rng,
            procrustes=strategy.procrustes, device=str(strategy.server_device),
        )  # fmt: skip
        new = join_blocks(new_blocks, blocks)
        head_std = dp.noise_multiplier * dp.clipping_norm
        for key in strategy.head_keys():
            noise = dp.rng.normal(0.0, head_std, np.shape(sent[key]))
            new[key] = np.asarray(sent[key], np.float64) + (sums[key] + noise) / m
        info = summarize_layers(per_block, ("rank", "drift", "eigengap", "negative_eigenvalues"))
        info["dp-sensitivity"] = florg_sensitivity(dp.clipping_norm, prev)
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
