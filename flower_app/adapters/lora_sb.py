"""LoRA-SB (Ponkshe et al. 2024; Singhal et al. 2025): a frozen nn.Linear plus s * B R A
with B (d_out x r) and A (r x d_in) fixed and identical on every node, and only the r x r
R trained.

    y = W0 x + b + s * B R A x,   computed as  s * ((x Aᵀ) Rᵀ) Bᵀ

(three skinny products; never a d_out x d_in matrix). B and A are non-trainable,
non-persistent buffers: a method fills them (``set_basis``) from its initialisation, which
every node receives from the server; before that they are zero and the layer adds nothing.
R starts at zero here and is a shared part ('<module>.R'); the task head trains as FLoRG's
does (its own parameters, '<head>.<param>').

Precision (``precision``, flower_app/precision.py), as FLoRG's layer: B, R, A are held in
float32 over a bf16 / fp16 base (float64 over a float64 one, in tests); the per-token
products run in autocast's dtype where autocast is on (as PEFT's LoRA layers do), else in the
adapter's, and the update is added in the output's dtype.

Export: B R A = (B R) A, so the layer is a rank-r LoRA with lora_B = B R, lora_A = A and the
same scaling alpha / r (``export_peft_lora_sb``, loadable by ``PeftModel.from_pretrained``).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from flower_app.adapters.florg_layer import adapter_dtype, compute_dtype
from flower_app.adapters.state import load_arrays, module_parameters, to_numpy
from flower_app.adapters.targets import (
    AdapterSettingError,
    check_rank_and_alpha,
    find_head_modules,
    find_target_linears,
)


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


class LoRASBLinear(nn.Module):
    """Wraps ``base_layer`` (frozen) with the fixed B, A (buffers) and the trained R."""

    def __init__(self, base_layer: nn.Linear, r: int, scaling: float) -> None:
        super().__init__()
        # in/out_features, not weight.shape: a bitsandbytes Linear4bit packs its weight
        d_out, d_in = base_layer.out_features, base_layer.in_features
        self.base_layer = base_layer
        self.base_layer.requires_grad_(False)
        self.r, self.scaling = int(r), float(scaling)
        dtype, device = adapter_dtype(base_layer.weight.dtype), base_layer.weight.device
        zeros = {"dtype": dtype, "device": device}
        self.register_buffer("B", torch.zeros(d_out, r, **zeros), persistent=False)
        self.register_buffer("A", torch.zeros(r, d_in, **zeros), persistent=False)
        self.R = nn.Parameter(torch.zeros(r, r, dtype=dtype, device=device))

    @property
    def in_features(self) -> int:
        return self.base_layer.in_features

    @property
    def out_features(self) -> int:
        return self.base_layer.out_features

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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        result = self.base_layer(x)
        dtype = compute_dtype(x.device.type, self.R.dtype)
        h = F.linear(x.to(dtype), self.A.to(dtype))  # x Aᵀ
        h = F.linear(h, self.R.to(dtype))  # (x Aᵀ) Rᵀ
        update = F.linear(h, self.B.to(dtype))  # ((x Aᵀ) Rᵀ) Bᵀ
        return result + (self.scaling * update).to(result.dtype)

    def extra_repr(self) -> str:
        return f"r={self.r}, scaling={self.scaling:g}"


def inject_lora_sb(model: nn.Module, config: LoRASBConfig) -> dict[str, LoRASBLinear]:
    """Replace the targeted Linears by LoRASBLinear in place; freeze all but R and the head."""
    if lora_sb_layers(model):
        raise ValueError("model already carries LoRA-SB layers")
    heads = find_head_modules(model, config.head_modules)
    targets = find_target_linears(model, config.target_modules, exclude=heads)
    for name, linear in targets.items():
        k = min(linear.in_features, linear.out_features)
        if config.r > k:
            raise AdapterSettingError(
                "rank", f"{name}: rank r={config.r} exceeds k=min(d_in, d_out)={k}"
            )
    model.requires_grad_(False)
    layers: dict[str, LoRASBLinear] = {}
    for name, linear in targets.items():
        layer = LoRASBLinear(linear, config.r, config.scaling)
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, layer)
        layers[name] = layer
    if config.train_head:
        for p in module_parameters(model, heads).values():
            p.requires_grad_(True)
    model.lora_sb_config = config
    model.lora_sb_heads = heads
    return layers


def lora_sb_layers(model: nn.Module) -> dict[str, LoRASBLinear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, LoRASBLinear)}


def _state_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {f"{n}.R": m.R for n, m in lora_sb_layers(model).items()}
    if model.lora_sb_config.train_head:
        tensors.update(module_parameters(model, model.lora_sb_heads))
    return tensors


def get_lora_sb_state(model: nn.Module) -> dict[str, np.ndarray]:
    """What travels: every layer's R (r x r) as '<module>.R', plus the head."""
    return {key: to_numpy(t) for key, t in _state_tensors(model).items()}


def set_lora_sb_state(model: nn.Module, state: Mapping[str, np.ndarray]) -> None:
    """Load every R and the head; keys and shapes must match exactly."""
    load_arrays(_state_tensors(model), state)


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
    from peft import LoraConfig, get_peft_model

    from flower_app.adapters.florg_model import peft_task_type

    config: LoRASBConfig = model.lora_sb_config
    layers = lora_sb_layers(model)
    with torch.no_grad():
        factors = {
            name: (layer.B.double() @ layer.R.detach().double(), layer.A.double())
            for name, layer in layers.items()
        }
    base = copy.deepcopy(model)
    for name, layer in lora_sb_layers(base).items():
        parent_name, _, child = name.rpartition(".")
        setattr(base.get_submodule(parent_name) if parent_name else base, child, layer.base_layer)
    for attr in ("lora_sb_config", "lora_sb_heads"):
        base.__dict__.pop(attr, None)
    lora_config = LoraConfig(
        r=config.r,
        lora_alpha=config.alpha,
        target_modules=sorted(layers),
        lora_dropout=0.0,
        bias="none",
        modules_to_save=list(model.lora_sb_heads) or None,
        base_model_name_or_path=base_model_name_or_path,
        task_type=peft_task_type(model),
    )
    peft_model = get_peft_model(base, lora_config)
    peft_modules = dict(peft_model.base_model.model.named_modules())
    with torch.no_grad():
        for name, (B, A) in factors.items():
            lora = peft_modules[name]
            lora.lora_B["default"].weight.copy_(B.to(lora.lora_B["default"].weight.dtype))
            lora.lora_A["default"].weight.copy_(A.to(lora.lora_A["default"].weight.dtype))
    out = Path(out_dir)
    peft_model.save_pretrained(out)
    (out / "lora_sb_config.json").write_text(json.dumps(asdict(config), indent=2))
    return out
