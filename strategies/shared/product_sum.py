"""Secure sums of LoRA products: each client adds its BₙAₙ, the server re-factors their mean.

A rule that averages the LoRA products and re-factors the mean by truncated SVD is linear in
the products, so a secure sum of each client's BₙAₙ (d_out × d_in a layer, '<layer>.lora_BA')
and its head gives the server the mean product and the mean head; the re-factorisation the
dp=central product-mean mechanism applies to a released mean product
(``strategies.server.product_mean.refactor_noised_product``, the rules' split B = U_r S_r^½,
A = S_r^½ V_rᵀ) then gives the plain round's B A, up to the quantisation. The price: d_out d_in
values a layer against the factors' r (d_out + d_in). Under dp=central the same sum carries
the product-mean mechanism (docs/privacy.md section 3): clipped on the client, noised on the
server. Server parts are imported inside the server step: a ClientApp loads this module for
the contribution only.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np

from flower_app.wire.records import split_state
from strategies.shared.base_method import BaseMethod

if TYPE_CHECKING:
    from flower_app.settings.run_settings import RunSettings
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

    def secure_contribution(self, arrays, server_round, *, received=None, config=None):
        """Each layer's product BₙAₙ, the head as it is (``product_contribution``)."""
        return product_contribution(arrays)

    def secure_shapes(self, uplink):
        return product_shapes(uplink)

    def aggregate_secure(self, strategy: AdapterStrategy, server_round, mean, clients):
        """The rule's re-factorisation of the mean product and the mean head
        (``aggregate_products``)."""
        return aggregate_products(strategy.global_state, mean)

    def secure_private_contribution(
        self,
        arrays: Mapping[str, np.ndarray],
        received: Mapping[str, np.ndarray],
        clipping_norm: float,
        server_round: int,
        *,
        config: RunSettings | None = None,
    ) -> tuple[dict[str, np.ndarray], bool]:
        """dp=central, the product-mean mechanism's client side (docs/privacy.md section 3):
        each layer's product update BₙAₙ − B_sent A_sent (``product_update``, under
        '<layer>.lora_BA') and the head update, clipped jointly to C (``clip_update``), the
        unit the server clips in a plain private round; and whether it was scaled down.
        ``received``: the state the server sent, B_sent and A_sent included."""
        from strategies.server.central_dp import clip_update, flat_norm
        from strategies.server.product_mean import product_update

        layers, head = split_state(arrays)
        update = {
            layer + PRODUCT_SUFFIX: product_update(
                parts["lora_B"], parts["lora_A"],
                received[f"{layer}.lora_B"], received[f"{layer}.lora_A"],
            )
            for layer, parts in layers.items()
        }  # fmt: skip
        update.update(
            {
                key: np.asarray(value, np.float64) - np.asarray(received[key], np.float64)
                for key, value in head.items()
            }
        )
        return clip_update(update, clipping_norm), flat_norm(update) > clipping_norm

    def secure_release_origin(
        self, strategy: AdapterStrategy, server_round: int
    ) -> dict[str, np.ndarray]:
        """dp=central on the masked sum (the product-mean mechanism, docs/privacy.md section
        3): the released mean product update is added to B_sent A_sent, the head's to the sent
        head, in the contribution's order (every layer's product, then the head), the order in
        which the plain mechanism's noised_mean draws the noise; the base method's
        ``aggregate_secure_private`` then noises, divides by m and re-factors
        (``aggregate_secure``: post-processing)."""
        sent = strategy.global_state
        origin: dict[str, np.ndarray] = {}
        for key in self.secure_shapes(strategy.uplink_state(server_round)):
            if key.endswith(PRODUCT_SUFFIX):
                layer = key[: -len(PRODUCT_SUFFIX)]
                B, A = (np.asarray(sent[f"{layer}.{p}"], np.float64) for p in ("lora_B", "lora_A"))
                origin[key] = B @ A
            else:
                origin[key] = np.asarray(sent[key], np.float64)
        return origin
