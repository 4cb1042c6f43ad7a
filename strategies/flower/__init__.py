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
    (FedEx-LoRA) and, for FLoRG, ``fingerprint`` (the server's L/R fingerprint),
    ``server_device`` ('auto' | 'cpu' | 'cuda') and ``rank_mismatch`` ('procrustes' |
    'truncate'); the FLoRG keys are ignored by the other methods."""
    check_method(method)
    residual_mode = kwargs.pop("residual_mode", "dense")
    florg_kwargs = {
        "fingerprint": kwargs.pop("fingerprint", None),
        "server_device": kwargs.pop("server_device", "auto"),
        "rank_mismatch": kwargs.pop("rank_mismatch", "procrustes"),
    }
    if method in ("florg", "florg-no-procrustes"):
        return FLoRGStrategy(initial_state, procrustes=method == "florg", **florg_kwargs, **kwargs)
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
