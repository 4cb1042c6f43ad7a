"""benchmarks.centralised.adapter_growth: the relative change of the adapted weights it prints is
s ||A_t^T A_t - A_0^T A_0||_F / ||W0||_F for FLoRG (L, R semi-orthogonal, paper eq. (1))
and s ||B A||_F / ||W0||_F for LoRA, whose B starts at zero."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from benchmarks.centralised import adapter_growth as growth
from flower_app.adapters.florg.model import florg_layers, inject_florg
from flower_app.adapters.lora.layer import LoRAConfig, inject_lora, lora_layers
from flower_app.adapters.registry import get_adapter_kind
from tests.runtime.test_adapter import TARGETS, florg_config, perturb_As, tiny_bert


def test_florg_change_is_the_scaled_change_of_the_gram_matrix():
    model = tiny_bert()
    inject_florg(model, florg_config(r=3, alpha=6.0, target_modules=TARGETS, seed=2))
    adapted = SimpleNamespace(kind=get_adapter_kind("florg"), model=model)
    layers = florg_layers(model)
    start_A = {n: layer.A.detach().double().clone() for n, layer in layers.items()}
    start = growth.effective_weights(adapted)
    assert growth.relative_change(start, start) == [0.0] * len(layers)
    perturb_As(model)
    changes = growth.relative_change(start, growth.effective_weights(adapted))
    for change, (name, layer) in zip(changes, layers.items(), strict=True):
        A0, A1 = start_A[name], layer.A.detach().double()
        expected = layer.scaling * torch.linalg.norm(A1.T @ A1 - A0.T @ A0)
        expected /= torch.linalg.norm(layer.base_layer.weight.double())
        assert change == pytest.approx(float(expected), rel=1e-5)
        assert change > 0


def test_lora_change_is_the_scaled_product_of_its_factors():
    model = inject_lora(tiny_bert(), LoRAConfig(r=2, alpha=4.0, target_modules=TARGETS, seed=1))
    adapted = SimpleNamespace(kind=get_adapter_kind("lora"), model=model)
    start = growth.effective_weights(adapted)
    layers = lora_layers(model)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for layer in layers.values():
            B = layer.lora_B["default"].weight
            B.copy_(torch.randn(B.shape, generator=g))
    changes = growth.relative_change(start, growth.effective_weights(adapted))
    for change, layer in zip(changes, layers.values(), strict=True):
        B = layer.lora_B["default"].weight.detach().double()
        A = layer.lora_A["default"].weight.detach().double()
        expected = layer.scaling["default"] * torch.linalg.norm(B @ A)
        expected /= torch.linalg.norm(layer.base_layer.weight.double())
        assert change == pytest.approx(float(expected), rel=1e-5)


def test_bad_arguments_are_refused():
    with pytest.raises(SystemExit):
        growth.parse_args(["--learning-rates", "fast"])
    with pytest.raises(SystemExit):
        growth.parse_args(["--learning-rates", "-1e-3"])
    assert growth.parse_args(["--learning-rates", "5e-4,2e-3"]).learning_rates == [5e-4, 2e-3]
