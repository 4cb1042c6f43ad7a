"""Flower Message-API strategies for every method, built by name."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from strategies.flower.base import AdapterStrategy
from strategies.flower.fedex_lora import FedExLoRAStrategy
from strategies.flower.florg import FLoRGStrategy
from strategies.flower.lora_strategies import (
    FeDeRAStrategy,
    FedITStrategy,
    FedSALoRAStrategy,
    FFALoRAStrategy,
)
from strategies.methods import check_method


def build_strategy(
    method: str, initial_state: Mapping[str, np.ndarray], **kwargs: Any
) -> AdapterStrategy:
    """The strategy for ``method``; kwargs go to AdapterStrategy, plus ``residual_mode``
    (FedEx-LoRA) and ``fingerprint`` (FLoRG: the server's L/R fingerprint)."""
    check_method(method)
    residual_mode = kwargs.pop("residual_mode", "dense")
    fingerprint = kwargs.pop("fingerprint", None)
    if method in ("florg", "florg-no-procrustes"):
        return FLoRGStrategy(
            initial_state, procrustes=method == "florg", fingerprint=fingerprint, **kwargs
        )
    if method == "fedex-lora":
        return FedExLoRAStrategy(initial_state, residual_mode=residual_mode, **kwargs)
    classes = {
        "fedit": FedITStrategy,
        "federa": FeDeRAStrategy,
        "ffa-lora": FFALoRAStrategy,
        "fedsa-lora": FedSALoRAStrategy,
    }
    return classes[method](initial_state, **kwargs)


__all__ = ["AdapterStrategy", "build_strategy"]
