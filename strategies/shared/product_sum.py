"""Secure sums of LoRA products: each client adds its BₙAₙ, the server re-factors their mean.

A rule that averages the LoRA products and re-factors the mean by truncated SVD is linear in
the products, so a secure sum of each client's BₙAₙ (d_out × d_in a layer, '<layer>.lora_BA')
and its head gives the server the mean product and the mean head; the re-factorisation the
dp=central product-mean mechanism applies to a released mean product
(``strategies.server.product_mean.refactor_noised_product``, the rules' split B = U_r S_r^½,
A = S_r^½ V_rᵀ) then gives the plain round's B A, up to the quantisation. The price: d_out d_in
values a layer against the factors' r (d_out + d_in). Server parts are imported inside the
server step: a ClientApp loads this module for the contribution only.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np

from flower_app.wire.records import split_state
from strategies.shared.base_method import BaseMethod

if TYPE_CHECKING:
    from strategies.server.strategy import AdapterStrategy

PRODUCT_SUFFIX = ".lora_BA"  # '<layer>.lora_A' and '<layer>.lora_B' -> '<layer>.lora_BA'


def product_contribution(arrays: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A client's secure-sum contribution: each LoRA layer's product B A (d_out × d_in,
    float64) under '<layer>.lora_BA'; the head's arrays as they are."""
    layers, head = split_state(arrays)
    out = {
        layer + PRODUCT_SUFFIX: np.asarray(parts["lora_B"], np.float64)
        @ np.asarray(parts["lora_A"], np.float64)
        for layer, parts in layers.items()
    }
    out.update({key: np.asarray(value, np.float64) for key, value in head.items()})
    return out


def product_shapes(uplink: Mapping[str, np.ndarray]) -> dict[str, tuple[int, ...]]:
    """The shapes of ``product_contribution`` for arrays shaped as ``uplink``."""
    layers, head = split_state(uplink)
    shapes = {
        layer + PRODUCT_SUFFIX: (np.shape(parts["lora_B"])[0], np.shape(parts["lora_A"])[1])
        for layer, parts in layers.items()
    }
    shapes.update({key: tuple(np.shape(value)) for key, value in head.items()})
    return shapes


def aggregate_products(
    sent: Mapping[str, np.ndarray], mean: Mapping[str, np.ndarray]
) -> tuple[dict[str, np.ndarray], dict[str, float]]:
    """The whole new state from the global state ``sent`` and the mean contribution
    ``mean``: every layer's mean product re-factored at its rank r (the columns of its B),
    the mean head; and ``trunc_rel_error``, ||P - B A||_F / ||P||_F averaged over the
    layers, as the plain rules report it."""
    from strategies.server.product_mean import refactor_noised_product

    layers, head = split_state(sent)
    new: dict[str, np.ndarray] = {}
    errors = []
    for layer, parts in layers.items():
        rank = np.shape(parts["lora_B"])[1]
        B, A, info = refactor_noised_product(mean[layer + PRODUCT_SUFFIX], rank)
        new[f"{layer}.lora_B"], new[f"{layer}.lora_A"] = B, A
        errors.append(info["trunc_rel_error"])
    new.update({key: np.asarray(mean[key], np.float64) for key in head})
    return {**sent, **new}, {"trunc_rel_error": float(np.mean(errors))}


class ProductSumMethod(BaseMethod):
    """A LoRA method whose server rule is the truncated SVD of the mean product
    (``secure_sum='product'``): these hooks sum the products and re-factor their mean."""

    def secure_contribution(self, arrays, server_round):
        """Each layer's product BₙAₙ, the head as it is (``product_contribution``)."""
        return product_contribution(arrays)

    def secure_shapes(self, uplink):
        return product_shapes(uplink)

    def aggregate_secure(self, strategy: AdapterStrategy, server_round, mean, clients):
        """The rule's re-factorisation of the mean product and the mean head
        (``aggregate_products``)."""
        return aggregate_products(strategy.global_state, mean)
