"""PEFT LoRA adapters for the LoRA methods, with seeded initialisation and named state.

Each targeted W0 (d_out x d_in) gets lora_B (d_out x r) and lora_A (r x d_in) with update
s * B A, s = alpha / r (PEFT's ``LoraConfig``/``get_peft_model``). Initialisations:

- ``default``: B = 0, A ~ U(-1/sqrt(d_in), 1/sqrt(d_in)) (PEFT's kaiming-uniform bound) drawn
  from (seed, module name): every node holds the same A without a broadcast, and a method
  that freezes A (``Method.frozen``) freezes exactly this A;
- ``svd`` (Yan et al. 2024): B = U_r sqrt(S_r / s), A = sqrt(S_r / s) V_r^T from W0's principal
  singular triplets, the residual W0 - s B A frozen (PEFT's ``init_lora_weights="pissa"``).

State keys: '<module>.lora_A', '<module>.lora_B' and the head's '<head>.<param>'."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from flower_app.adapters.florg.projections import seeded_rng
from flower_app.adapters.state import load_arrays, to_numpy
from flower_app.adapters.targets import (
    AdapterSettingError,
    check_rank_and_alpha,
    find_head_modules,
    find_target_linears,
)

LORA_INITS: tuple[str, ...] = ("default", "svd")


@dataclass(frozen=True)
class LoRAConfig:
    """Settings of the baselines' LoRA adapters (paper: r = 4, alpha = 16)."""

    r: int = 4
    alpha: float = 16.0
    target_modules: tuple[str, ...] = ("query", "value")
    seed: int = 0
    init: str = "default"
    freeze_A: bool = False
    head_modules: tuple[str, ...] | None = None
    train_head: bool = True

    def __post_init__(self) -> None:
        check_rank_and_alpha(self.r, self.alpha)
        if self.init not in LORA_INITS:
            raise ValueError(f"LoRA init {self.init!r} unknown; choose one of {LORA_INITS}")

    @property
    def scaling(self) -> float:
        return self.alpha / self.r


def inject_lora(model: nn.Module, config: LoRAConfig) -> nn.Module:
    """Wrap ``model`` with PEFT LoRA on the targeted Linears; returns the PeftModel."""
    from peft import LoraConfig

    from flower_app.adapters.custom_adapter import quiet_get_peft_model

    heads = find_head_modules(model, config.head_modules)
    targets = find_target_linears(model, config.target_modules, exclude=heads)
    for name, linear in targets.items():
        k = min(linear.weight.shape)
        if config.r > k:
            raise AdapterSettingError(
                "rank", f"{name}: rank r={config.r} exceeds k=min(d_in, d_out)={k}"
            )
    peft_config = LoraConfig(
        r=config.r,
        lora_alpha=config.alpha,
        target_modules=sorted(targets),
        lora_dropout=0.0,
        bias="none",
        modules_to_save=heads or None,
        init_lora_weights="pissa" if config.init == "svd" else True,
    )
    peft_model = quiet_get_peft_model(model, peft_config)
    layers = lora_layers(peft_model)
    with torch.no_grad():
        for name, layer in layers.items():
            B, A = layer.lora_B["default"].weight, layer.lora_A["default"].weight
            if config.init == "default":
                bound = 1.0 / np.sqrt(A.shape[1])
                values = seeded_rng(config.seed, name, "lora_A").uniform(-bound, bound, A.shape)
                A.copy_(torch.as_tensor(values, dtype=A.dtype))
                B.zero_()
            A.requires_grad_(not config.freeze_A)
    for p in head_parameters(peft_model).values():
        p.requires_grad_(config.train_head)
    peft_model.lora_settings = config
    return peft_model


def lora_layers(peft_model: nn.Module) -> dict[str, nn.Module]:
    """PEFT LoRA layers keyed by their module names in the original model."""
    from peft.tuners.lora import LoraLayer

    inner = peft_model.base_model.model
    return {n: m for n, m in inner.named_modules() if isinstance(m, LoraLayer)}


def head_parameters(peft_model: nn.Module) -> dict[str, nn.Parameter]:
    """The head's trainable parameters (PEFT's modules_to_save copy), keyed '<head>.<param>'."""
    from peft.utils import ModulesToSaveWrapper

    inner = peft_model.base_model.model
    out: dict[str, nn.Parameter] = {}
    for name, module in inner.named_modules():
        if isinstance(module, ModulesToSaveWrapper):
            for p_name, p in module.modules_to_save["default"].named_parameters():
                out[f"{name}.{p_name}"] = p
    return out


def _state_tensors(
    peft_model: nn.Module, parts: Iterable[str], include_head: bool
) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for name, layer in lora_layers(peft_model).items():
        if "A" in parts:
            tensors[f"{name}.lora_A"] = layer.lora_A["default"].weight
        if "B" in parts:
            tensors[f"{name}.lora_B"] = layer.lora_B["default"].weight
    if include_head:
        tensors.update(head_parameters(peft_model))
    return tensors


def get_lora_state(
    peft_model: nn.Module, parts: Iterable[str] = ("A", "B"), include_head: bool = True
) -> dict[str, np.ndarray]:
    """Selected LoRA factors ('A', 'B') and optionally the head, as float32 arrays."""
    tensors = _state_tensors(peft_model, tuple(parts), include_head)
    return {key: to_numpy(t) for key, t in tensors.items()}


def set_lora_state(
    peft_model: nn.Module,
    state: Mapping[str, np.ndarray],
    parts: Iterable[str] = ("A", "B"),
    include_head: bool = True,
) -> None:
    """Load the selected factors and head; keys and shapes must match exactly."""
    load_arrays(_state_tensors(peft_model, tuple(parts), include_head), state)
