"""LoRA-SB (Ponkshe et al. 2024; Singhal et al. 2025): a frozen nn.Linear plus s * B R A, with
B (d_out x r) and A (r x d_in) fixed and identical on every node and only the r x r R trained.

    y = W0 x + b + s * B R A x,   computed as  s * ((x Aᵀ) Rᵀ) Bᵀ

B and A are non-persistent buffers a method fills (``set_basis``) from what every node receives
from the server (zero before: the layer adds nothing); R starts at zero and travels as
'<module>.R', the head as '<head>.<param>'. Precision as FLoRG's layer (B, R, A float32 over a
bf16 / fp16 base; ``compute_dtype``, custom_adapter.py). Export (``export_peft_lora_sb``): a
rank-r LoRA with lora_B = B R, lora_A = A and the same scaling alpha / r, loadable by
``PeftModel.from_pretrained``."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from flower_app.adapters.custom_adapter import (
    AdapterLinear,
    CustomLayers,
    adapter_dtype,
    save_peft_lora,
)
from flower_app.adapters.targets import check_rank_and_alpha


@dataclass(frozen=True)
class LoRASBConfig:
    """LoRA-SB adapter settings (a run builds it from its settings: ``rank``, ``alpha``,
    ``target-modules``, ``head-modules``, ``train-head``)."""

    r: int = 4
    alpha: float = 16.0
    target_modules: tuple[str, ...] = ("query", "value")
    head_modules: tuple[str, ...] | None = None
    train_head: bool = True

    def __post_init__(self) -> None:
        check_rank_and_alpha(self.r, self.alpha)

    @property
    def scaling(self) -> float:
        return self.alpha / self.r


class LoRASBLinear(AdapterLinear):
    """Wraps ``base_layer`` (frozen) with the fixed B, A (buffers) and the trained R."""

    def __init__(self, base_layer: nn.Linear, r: int, scaling: float) -> None:
        super().__init__(base_layer, scaling)
        # in/out_features, not weight.shape: a bitsandbytes Linear4bit packs its weight
        d_out, d_in = base_layer.out_features, base_layer.in_features
        self.r = int(r)
        dtype, device = adapter_dtype(base_layer.weight.dtype), base_layer.weight.device
        zeros = {"dtype": dtype, "device": device}
        self.register_buffer("B", torch.zeros(d_out, r, **zeros), persistent=False)
        self.register_buffer("A", torch.zeros(r, d_in, **zeros), persistent=False)
        self.R = nn.Parameter(torch.zeros(r, r, dtype=dtype, device=device))

    @property
    def trained_matrix(self) -> torch.Tensor:
        return self.R

    def set_basis(self, B: np.ndarray, A: np.ndarray) -> None:
        """Load the fixed B (d_out x r) and A (r x d_in); ValueError on another shape."""
        for name, value in (("B", B), ("A", A)):
            buffer = getattr(self, name)
            value = np.asarray(value)
            if value.shape != tuple(buffer.shape):
                raise ValueError(f"{name}: shape {value.shape} != expected {tuple(buffer.shape)}")
            if not np.all(np.isfinite(value)):
                raise ValueError(f"{name}: contains NaN/Inf")
            with torch.no_grad():
                buffer.copy_(torch.as_tensor(value, dtype=buffer.dtype, device=buffer.device))

    def delta_weight(self) -> torch.Tensor:
        """s * B R A (d_out x d_in); for tests and export only, never in the forward."""
        return self.scaling * self.B @ self.R @ self.A

    def low_rank_update(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """((x Aᵀ) Rᵀ) Bᵀ in ``dtype``; the scaling and the cast to the output's dtype are
        AdapterLinear's."""
        h = F.linear(x.to(dtype), self.A.to(dtype))  # x Aᵀ
        h = F.linear(h, self.R.to(dtype))  # (x Aᵀ) Rᵀ
        return F.linear(h, self.B.to(dtype))  # ((x Aᵀ) Rᵀ) Bᵀ

    def extra_repr(self) -> str:
        return f"r={self.r}, scaling={self.scaling:g}"


# LoRA-SB on a model: LoRASBLinear layers whose R trains and travels, the settings and the
# head recorded as ``model.lora_sb_config`` and ``model.lora_sb_heads``.
LORA_SB = CustomLayers(LoRASBLinear, part="R", label="LoRA-SB", prefix="lora_sb")


def inject_lora_sb(model: nn.Module, config: LoRASBConfig) -> dict[str, LoRASBLinear]:
    """Replace the targeted Linears by LoRASBLinear in place; freeze all but R and the head."""
    return LORA_SB.inject(
        model, config, lambda _name, linear: LoRASBLinear(linear, config.r, config.scaling)
    )


# A model's LoRA-SB layers by module name; what travels, every layer's R (r x r) as
# '<module>.R' plus the head; and loading every R and the head (keys and shapes must match
# exactly).
lora_sb_layers = LORA_SB.layers
get_lora_sb_state = LORA_SB.get_state
set_lora_sb_state = LORA_SB.set_state


def set_lora_sb_basis(model: nn.Module, basis: Mapping[str, np.ndarray]) -> None:
    """Load every layer's fixed '<module>.B' and '<module>.A'; the keys must match exactly."""
    layers = lora_sb_layers(model)
    expected = {f"{n}.{part}" for n in layers for part in ("B", "A")}
    if set(basis) != expected:
        missing, unexpected = sorted(expected - set(basis)), sorted(set(basis) - expected)
        raise KeyError(f"basis keys differ: missing {missing[:5]}, unexpected {unexpected[:5]}")
    for name, layer in layers.items():
        layer.set_basis(basis[f"{name}.B"], basis[f"{name}.A"])


def export_peft_lora_sb(
    model: nn.Module, out_dir: str | Path, base_model_name_or_path: str | None = None
) -> Path:
    """A standard PEFT LoRA folder equal to the LoRA-SB model: lora_B = B R, lora_A = A at
    rank r, scaling alpha / r kept, the head through ``modules_to_save``;
    ``PeftModel.from_pretrained(base_model, out_dir)`` on the unchanged base reproduces
    this model's outputs."""
    config: LoRASBConfig = model.lora_sb_config
    layers = lora_sb_layers(model)
    with torch.no_grad():
        factors = {
            name: (layer.B.double() @ layer.R.detach().double(), layer.A.double())
            for name, layer in layers.items()
        }
    base = copy.deepcopy(model)
    LORA_SB.strip(base)
    return save_peft_lora(
        base,
        factors,
        rank=config.r,
        alpha=config.alpha,
        heads=LORA_SB.heads(model),
        out_dir=out_dir,
        base_model_name_or_path=base_model_name_or_path,
        config_file="lora_sb_config.json",
        config=config,
    )
