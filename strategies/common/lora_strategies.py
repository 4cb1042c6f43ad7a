"""The five baselines as Flower strategies, each calling its rule from strategies/."""

from __future__ import annotations

import numpy as np

from flower_app.records import split_state
from strategies.common.central_dp import (
    federa_private_step,
    noise_std_mean,
    noised_mean,
    product_update,
)
from strategies.common.strategy import AdapterStrategy
from strategies.federa.rule import aggregate_federa
from strategies.fedit.rule import aggregate_fedit
from strategies.fedsa_lora.rule import aggregate_fedsa_lora
from strategies.ffa_lora.rule import aggregate_ffa_lora
from strategies.flexlora.rule import aggregate_flexlora
from strategies.hetlora.rule import aggregate_hetlora


class FedITStrategy(AdapterStrategy):
    """Average B and A separately."""

    method = "fedit"

    def aggregate_adapter(self, server_round, payloads, weights):
        new: dict[str, np.ndarray] = {}
        for layer in self.layers():
            kb, ka = f"{layer}.lora_B", f"{layer}.lora_A"
            new[kb], new[ka] = aggregate_fedit(
                self.stacked(payloads, kb), self.stacked(payloads, ka), weights
            )
        return new, {}


class FeDeRAStrategy(AdapterStrategy):
    """Aggregate the products B_n A_n and re-factor by truncated SVD."""

    method = "federa"
    dp_mechanism = "product-mean"

    def aggregate_adapter(self, server_round, payloads, weights):
        new: dict[str, np.ndarray] = {}
        errors = []
        for layer in self.layers():
            kb, ka = f"{layer}.lora_B", f"{layer}.lora_A"
            new[kb], new[ka], info = aggregate_federa(
                self.stacked(payloads, kb), self.stacked(payloads, ka), weights
            )
            errors.append(info["trunc_rel_error"])
        return new, {"trunc_rel_error": float(np.mean(errors))}

    def aggregate_private(self, server_round, payloads, num_sampled):
        """dp=central (docs/privacy.md section 3): the rule is linear in the products, so
        each client's unit is its product updates B_n A_n - B A (dense d_out x d_in per
        layer) with its head update, clipped jointly to C; ``noised_mean`` of those plus
        B A is the noised mean product, re-factored to rank r by ``federa_private_step``
        (post-processing). One client's dense updates are in memory at a time."""
        dp, sent = self.dp, self.global_state
        layers = list(self.layers())
        head = list(split_state(sent)[1])

        def unit(p):
            update = {
                ("product", layer): product_update(
                    p[f"{layer}.lora_B"], p[f"{layer}.lora_A"],
                    sent[f"{layer}.lora_B"], sent[f"{layer}.lora_A"],
                )
                for layer in layers
            }  # fmt: skip
            update.update({("head", k): np.asarray(p[k], np.float64) - sent[k] for k in head})
            return dp.clip(update)

        mean = noised_mean(
            (unit(p) for p in payloads),
            dp.clipping_norm,
            dp.noise_multiplier,
            dp.rng,
            num_sampled=num_sampled,
        )
        new: dict[str, np.ndarray] = {}
        errors = []
        for layer in layers:
            kb, ka = f"{layer}.lora_B", f"{layer}.lora_A"
            product = sent[kb] @ sent[ka] + mean[("product", layer)]
            new[kb], new[ka], info = federa_private_step(product, sent[kb].shape[1])
            errors.append(info["trunc_rel_error"])
        new.update({k: sent[k] + mean[("head", k)] for k in head})
        return new, {
            "trunc_rel_error": float(np.mean(errors)),
            "dp-noise-std": noise_std_mean(dp.clipping_norm, dp.noise_multiplier, num_sampled),
        }


class FFALoRAStrategy(AdapterStrategy):
    """Only B travels and is averaged; A stays frozen at its seeded initialisation."""

    method = "ffa-lora"

    def aggregate_adapter(self, server_round, payloads, weights):
        return {
            f"{layer}.lora_B": aggregate_ffa_lora(
                self.stacked(payloads, f"{layer}.lora_B"), weights
            )
            for layer in self.layers()
        }, {}


class FedSALoRAStrategy(AdapterStrategy):
    """Only A travels and is averaged; each client keeps its own B."""

    method = "fedsa-lora"

    def aggregate_adapter(self, server_round, payloads, weights):
        return {
            f"{layer}.lora_A": aggregate_fedsa_lora(
                self.stacked(payloads, f"{layer}.lora_A"), weights
            )
            for layer in self.layers()
        }, {}


class HetLoRAStrategy(AdapterStrategy):
    """HetLoRA: clients of different rank; zero-pad B and A to the global rank and
    average (``strategies.hetlora.rule``); each node is sent its top r_n (``sent_state``)."""

    method = "hetlora"
    # dp=central needs one common rank (refused with client-ranks); then HetLoRA is FedIT
    # and the base class's mean mechanism is its private round
    dp_mechanism = "mean"
    heterogeneous_ranks = True

    def aggregate_adapter(self, server_round, payloads, weights):
        new: dict[str, np.ndarray] = {}
        for layer in self.layers():
            kb, ka = f"{layer}.lora_B", f"{layer}.lora_A"
            new[kb], new[ka] = aggregate_hetlora(
                self.stacked(payloads, kb), self.stacked(payloads, ka), weights,
                rank=self.largest_rank,
            )  # fmt: skip
        return new, {}


class FlexLoRAStrategy(FeDeRAStrategy):
    """FlexLoRA: clients of different rank; the weighted sum of the products, truncated
    SVD at the global rank (``strategies.flexlora.rule``); each node is sent the first r_n
    singular directions, its own truncated SVD (``sent_state``)."""

    method = "flexlora"
    # dp=central needs one common rank (refused with client-ranks); then FlexLoRA is
    # FeDeRA's rule and FeDeRA's product-mean mechanism its private round (inherited)
    dp_mechanism = "product-mean"
    heterogeneous_ranks = True

    def aggregate_adapter(self, server_round, payloads, weights):
        new: dict[str, np.ndarray] = {}
        errors = []
        for layer in self.layers():
            kb, ka = f"{layer}.lora_B", f"{layer}.lora_A"
            new[kb], new[ka], info = aggregate_flexlora(
                self.stacked(payloads, kb), self.stacked(payloads, ka), weights,
                rank=self.largest_rank,
            )  # fmt: skip
            errors.append(info["trunc_rel_error"])
        return new, {"trunc_rel_error": float(np.mean(errors))}
