"""Injecting FLoRG into a Hugging Face model, its trainable state, and export to PEFT LoRA.

``inject_florg`` replaces every targeted nn.Linear by a FLoRGLinear whose L, R come from the
seed and the layer's shape (``projection_sharing='shape'``) or its module name (``'module'``),
and whose A starts as N(0, a_init_std^2) entries seeded by module name (A = 0 is excluded:
grad_A = A (H + H^T) vanishes there, paper eq. gradient_A). Everything but the A matrices (and,
if ``train_head``, the task head) is frozen, and the ``form_pass_factors`` pre-hook installed.

Export: L A^T D A R = (L A^T D)(A R), a rank-r LoRA with lora_B = L A^T D, lora_A = A R and the
same scaling alpha/r; with ``subtract_init`` (the frozen weight W0 - s L A1^T D A1 R) exactly
the rank-2r LoRA B = [L A^T D, -L A1^T D], A = [A R; A1 R]. D = diag(signs), I without them."""

from __future__ import annotations

import copy
import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from flower_app.adapters.custom_adapter import CustomLayers, adapter_dtype, save_peft_lora
from flower_app.adapters.florg.layer import FLoRGLinear, FLoRGProjections, form_pass_factors
from flower_app.adapters.florg.projections import (
    PROJECTION_INITS,
    PROJECTION_SHARINGS,
    fingerprint,
    make_projections,
    projection_key,
    seeded_rng,
)
from flower_app.adapters.targets import check_rank_and_alpha


@dataclass(frozen=True, kw_only=True)
class FLoRGConfig:
    """FLoRG adapter settings; the paper's defaults are r = 4, alpha = 16. A run builds it
    from its settings (``flower_app.adapted.florg_config``); ``a_init_std`` has no default
    here: its default and its check (> 0) are the run setting ``a-init-std``'s."""

    r: int = 4
    alpha: float = 16.0
    target_modules: tuple[str, ...] = ("query", "value")
    seed: int = 0
    a_init_std: float
    projection_init: str = "semi-orthogonal"
    projection_sharing: str = "shape"
    subtract_init: bool = False
    head_modules: tuple[str, ...] | None = None
    train_head: bool = True
    # a method's row signs of A in the core A^T D A (None: all +1, the paper)
    signs: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        check_rank_and_alpha(self.r, self.alpha)
        if self.projection_init not in PROJECTION_INITS:
            raise ValueError(
                f"projection_init {self.projection_init!r} unknown; "
                f"choose one of {PROJECTION_INITS}"
            )
        if self.signs is not None and (
            len(self.signs) != self.r or any(abs(v) != 1 for v in self.signs)
        ):
            raise ValueError(f"signs must be r = {self.r} entries of +1 or -1, got {self.signs}")
        if self.projection_sharing not in PROJECTION_SHARINGS:
            raise ValueError(
                f"projection_sharing {self.projection_sharing!r} unknown; "
                f"choose one of {PROJECTION_SHARINGS}"
            )

    @property
    def scaling(self) -> float:
        return self.alpha / self.r


# FLoRG on a model: FLoRGLinear layers whose A trains and travels, the settings and the head
# recorded as ``model.florg_config`` and ``model.florg_heads``.
FLORG = CustomLayers(FLoRGLinear, part="A", label="FLoRG", prefix="florg")


def inject_florg(model: nn.Module, config: FLoRGConfig) -> dict[str, FLoRGLinear]:
    """Replace the targeted Linears by FLoRGLinear in place; freeze all but A and the head."""
    # key -> (L, R, their buffers); with sharing 'shape' one entry per layer shape and dtype.
    shared: dict[tuple, tuple[np.ndarray, np.ndarray, FLoRGProjections]] = {}

    def make_layer(name: str, linear: nn.Linear) -> FLoRGLinear:
        d_out, d_in = linear.out_features, linear.in_features
        k = min(d_in, d_out)
        key = projection_key(name, d_out, d_in, config.projection_sharing, config.projection_init)
        dtype = adapter_dtype(linear.weight.dtype)  # float32 for a bf16 / fp16 base
        cache_key = (key, dtype, linear.weight.device)
        if cache_key not in shared:
            weight = None
            if config.projection_init == "svd":
                weight = linear.weight.detach().to(torch.float64).cpu().numpy()
            L, R = make_projections(
                d_out, d_in, seed=config.seed, name=key, init=config.projection_init, weight=weight
            )
            holder = FLoRGProjections(L, R, dtype, linear.weight.device)
            shared[cache_key] = (L, R, holder)
        L, R, holder = shared[cache_key]
        A1 = seeded_rng(config.seed, name, "A").standard_normal((config.r, k)) * config.a_init_std
        signs = None if config.signs is None else np.asarray(config.signs, dtype=np.float64)
        return FLoRGLinear(
            linear, L, R, A1, config.scaling, config.subtract_init, projections=holder, signs=signs
        )

    layers = FLORG.inject(model, config, make_layer)
    # Each layer's factors formed once per training forward, outside the (checkpointed)
    # blocks, and reused by their recomputation (florg_layer.py's module docstring).
    model.register_forward_pre_hook(form_pass_factors)
    return layers


# A model's FLoRG layers by module name; what a FLoRG client sends, every layer's A (r x k)
# as '<module>.A' plus the head; and loading the global A matrices and head (keys and shapes
# must match exactly).
florg_layers = FLORG.layers
get_florg_state = FLORG.get_state
set_florg_state = FLORG.set_state


def florg_fingerprint(model: nn.Module) -> str:
    """One hash over the sharing mode and every layer's L and R (float32), for nodes to
    compare: a node with another seed, model, initialisation or sharing mode differs."""
    h = hashlib.sha256()
    h.update(f"projection-sharing={model.florg_config.projection_sharing}".encode())
    per_holder: dict[int, str] = {}  # a shared L, R pair is hashed once
    for name, layer in sorted(florg_layers(model).items()):
        holder = layer.projections
        if id(holder) not in per_holder:
            per_holder[id(holder)] = fingerprint(layer.L.cpu().numpy(), layer.R.cpu().numpy())
        h.update(name.encode())
        h.update(per_holder[id(holder)].encode())
    return h.hexdigest()[:16]


def _signed(layer: FLoRGLinear, left: torch.Tensor) -> torch.Tensor:
    """``left`` (d_out x r) times the layer's D = diag(signs) (unchanged without signs)."""
    return left if layer.signs is None else left * layer.signs.to(left.dtype)


def _lora_export_factors(layer: FLoRGLinear) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(lora_B, lora_A, rank) with s * lora_B @ lora_A equal to the layer's update over W0."""
    with torch.no_grad():
        left, right = (t.detach().to(torch.float64) for t in layer.lora_factors())
        if not layer.subtract_init:
            return left, right, layer.r
        A1 = layer.A_init.to(torch.float64)
        L64, R64 = layer.L.to(torch.float64), layer.R.to(torch.float64)
        B = torch.cat([left, -_signed(layer, L64 @ A1.T)], dim=1)
        A = torch.cat([right, A1 @ R64], dim=0)
        return B, A, 2 * layer.r


def export_peft_lora(
    model: nn.Module, out_dir: str | Path, base_model_name_or_path: str | None = None
) -> Path:
    """Write a standard PEFT LoRA adapter folder equivalent to the FLoRG model.

    ``PeftModel.from_pretrained(base_model, out_dir)`` on the original base model
    reproduces this model's outputs (the head is saved through ``modules_to_save``). A
    causal LM's folder has ``task_type`` ``CAUSAL_LM`` and, given
    ``base_model_name_or_path``, loads from the folder alone:
    ``peft.AutoPeftModelForCausalLM.from_pretrained(out_dir)``
    (tests/runtime/test_causal_lm_export.py).
    """
    config: FLoRGConfig = model.florg_config
    layers = florg_layers(model)
    factors = {name: _lora_export_factors(layer) for name, layer in layers.items()}
    rank = next(iter(factors.values()))[2]

    base = copy.deepcopy(model)
    for layer in florg_layers(base).values():
        if layer.subtract_init:  # restore the original W0 = (W0 - s L A1^T A1 R) + s L A1^T A1 R
            linear = layer.base_layer
            A1 = layer.A_init.to(torch.float64)
            restore = (
                layer.scaling * _signed(layer, layer.L.double() @ A1.T) @ (A1 @ layer.R.double())
            )
            with torch.no_grad():
                linear.weight.copy_((linear.weight.double() + restore).to(linear.weight.dtype))
    FLORG.strip(base)
    return save_peft_lora(
        base,
        {name: (B, A) for name, (B, A, _) in factors.items()},
        rank=rank,
        alpha=config.scaling * rank,
        heads=FLORG.heads(model),
        out_dir=out_dir,
        base_model_name_or_path=base_model_name_or_path,
        config_file="florg_config.json",
        config=config,
    )
