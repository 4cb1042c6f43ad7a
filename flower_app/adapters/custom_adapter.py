"""What the project's own adapter layers share: FLoRG's ``FLoRGLinear`` and LoRA-SB's
``LoRASBLinear`` (PEFT's LoRA brings its own layers and uses none of this).

- ``adapter_dtype``, ``compute_dtype``: an adapter's dtype over a base weight, and the dtype
  its per-token products run in;
- ``AdapterLinear``: a frozen nn.Linear plus s times a low-rank update that the subclass
  computes, added in the output's dtype;
- ``CustomLayers``: one adapter on a model: injects it (the targeted Linears outside the task
  head, the rank checked against each, the rest frozen, the head trainable), lists its layers,
  gets and sets what travels, and strips a copy back to the base model;
- ``save_peft_lora``: a stripped copy as a standard PEFT LoRA folder with the given factors."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

import numpy as np
import torch
from torch import nn

from flower_app.adapters.state import load_arrays, module_parameters, to_numpy
from flower_app.adapters.targets import (
    AdapterSettingError,
    find_head_modules,
    find_target_linears,
)


def quiet_get_peft_model(model: nn.Module, config: Any) -> nn.Module:
    """PEFT's ``get_peft_model`` without the FutureWarning transformers raises when PEFT reads
    its deprecated ``is_gradient_checkpointing`` (PEFT's call, not ours: it would print in
    every run's console and tells a user of this app nothing they can change)."""
    import warnings

    from peft import get_peft_model

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", ".*is_gradient_checkpointing", FutureWarning)
        return get_peft_model(model, config)


def adapter_dtype(base_dtype: torch.dtype) -> torch.dtype:
    """The dtype of an adapter's own matrices and path for a base weight of ``base_dtype``:
    float64 for a float64 base (tests), float32 otherwise (bf16 / fp16 bases, and a
    quantised base whose weight is an integer storage dtype)."""
    return torch.float64 if base_dtype == torch.float64 else torch.float32


def compute_dtype(device_type: str, adapter: torch.dtype) -> torch.dtype:
    """The dtype of the per-token adapter products on ``device_type``: autocast's where
    autocast is on there (as PEFT's LoRA layers compute under it), else ``adapter``."""
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return adapter


class AdapterLinear(nn.Module):
    """A frozen ``base_layer`` plus ``scaling`` times a low-rank update.

    A subclass names its trained matrix (``trained_matrix``: its dtype is the adapter's) and
    computes the update (``low_rank_update``); the forward adds it to the base output in the
    output's dtype, so every such adapter rounds in the same places."""

    def __init__(self, base_layer: nn.Linear, scaling: float) -> None:
        super().__init__()
        self.base_layer = base_layer
        self.base_layer.requires_grad_(False)
        self.scaling = float(scaling)

    @property
    def in_features(self) -> int:
        return self.base_layer.in_features

    @property
    def out_features(self) -> int:
        return self.base_layer.out_features

    @property
    def trained_matrix(self) -> torch.Tensor:
        """The trained parameter whose dtype the update's products start from."""
        raise NotImplementedError

    def low_rank_update(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The update before scaling, its products in ``dtype`` (``x`` not yet cast to it)."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        result = self.base_layer(x)
        # The per-token products in autocast's dtype where autocast is on, else in the
        # adapter's (compute_dtype), then one cast to the output's dtype.
        dtype = compute_dtype(x.device.type, self.trained_matrix.dtype)
        update = self.low_rank_update(x, dtype)
        return result + (self.scaling * update).to(result.dtype)


class InjectionSettings(Protocol):
    """The adapter settings injection reads (FLoRGConfig and LoRASBConfig have them)."""

    @property
    def r(self) -> int: ...

    @property
    def target_modules(self) -> tuple[str, ...]: ...

    @property
    def head_modules(self) -> tuple[str, ...] | None: ...

    @property
    def train_head(self) -> bool: ...


LayerT = TypeVar("LayerT", bound=AdapterLinear)


def replace_module(model: nn.Module, name: str, module: nn.Module) -> None:
    """Put ``module`` in the place of ``model``'s submodule ``name``."""
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, module)


@dataclass(frozen=True)
class CustomLayers(Generic[LayerT]):
    """One custom adapter as a model carries it: its layer type, the attribute of each layer
    that trains and travels (``part``: '<module>.<part>' in the state), and the ``prefix`` of
    the two model attributes injection sets, ``<prefix>_config`` (the adapter's settings) and
    ``<prefix>_heads`` (the task head's module names). ``label`` names it in errors."""

    layer_type: type[LayerT]
    part: str
    label: str
    prefix: str

    @property
    def config_attribute(self) -> str:
        return f"{self.prefix}_config"

    @property
    def heads_attribute(self) -> str:
        return f"{self.prefix}_heads"

    def inject(
        self,
        model: nn.Module,
        settings: InjectionSettings,
        make_layer: Callable[[str, nn.Linear], LayerT],
    ) -> dict[str, LayerT]:
        """Replace every targeted Linear of ``model`` (outside the task head) in place by
        ``make_layer(name, linear)``; freeze everything but the layers' own parameters and,
        with ``train_head``, the head; record ``settings`` and the head on ``model``.

        A model that already carries these layers, and a rank above some target's
        min(d_in, d_out), are refused before anything changes."""
        if self.layers(model):
            raise ValueError(f"model already carries {self.label} layers")
        heads = find_head_modules(model, settings.head_modules)
        targets = find_target_linears(model, settings.target_modules, exclude=heads)
        for name, linear in targets.items():
            k = min(linear.in_features, linear.out_features)
            if settings.r > k:
                raise AdapterSettingError(
                    "rank", f"{name}: rank r={settings.r} exceeds k=min(d_in, d_out)={k}"
                )
        model.requires_grad_(False)
        layers: dict[str, LayerT] = {}
        for name, linear in targets.items():
            layer = make_layer(name, linear)
            replace_module(model, name, layer)
            layers[name] = layer
        if settings.train_head:
            for p in module_parameters(model, heads).values():
                p.requires_grad_(True)
        setattr(model, self.config_attribute, settings)
        setattr(model, self.heads_attribute, heads)
        return layers

    def layers(self, model: nn.Module) -> dict[str, LayerT]:
        """Every layer of this kind in ``model``, by module name."""
        return {n: m for n, m in model.named_modules() if isinstance(m, self.layer_type)}

    def heads(self, model: nn.Module) -> list[str]:
        """The task head's module names, as injection found them."""
        return getattr(model, self.heads_attribute)

    def trained_tensors(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """What a client trains and sends: each layer's part as '<module>.<part>', plus the
        head's parameters as '<head>.<param>' where the head trains."""
        tensors: dict[str, torch.Tensor] = {
            f"{n}.{self.part}": getattr(m, self.part) for n, m in self.layers(model).items()
        }
        if getattr(model, self.config_attribute).train_head:
            tensors.update(module_parameters(model, self.heads(model)))
        return tensors

    def get_state(self, model: nn.Module) -> dict[str, np.ndarray]:
        """``trained_tensors`` as float32 arrays, what travels."""
        return {key: to_numpy(t) for key, t in self.trained_tensors(model).items()}

    def set_state(self, model: nn.Module, state: Mapping[str, np.ndarray]) -> None:
        """Load ``state`` into ``trained_tensors``; keys and shapes must match exactly."""
        load_arrays(self.trained_tensors(model), state)

    def strip(self, model: nn.Module) -> None:
        """Put each layer's frozen base back in its place and drop the attributes injection
        set, in place: run on a copy, it leaves the plain base model."""
        for name, layer in self.layers(model).items():
            replace_module(model, name, layer.base_layer)
        for attribute in (self.config_attribute, self.heads_attribute):
            model.__dict__.pop(attribute, None)


def peft_task_type(model: nn.Module) -> str | None:
    """PEFT's ``task_type`` of ``model``: ``CAUSAL_LM`` for a transformers causal LM (what
    ``AutoPeftModelForCausalLM`` requires, and PEFT's generation wrapper), else ``None``."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    names: set[str] = set()
    for value in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values():
        names.update((value,) if isinstance(value, str) else value)
    return "CAUSAL_LM" if type(model).__name__ in names else None


def save_peft_lora(
    base: nn.Module,
    factors: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
    *,
    rank: int,
    alpha: float,
    heads: Sequence[str],
    out_dir: str | Path,
    base_model_name_or_path: str | None,
    config_file: str,
    config: Any,
) -> Path:
    """Write ``base`` (a stripped copy, ``CustomLayers.strip``) with a PEFT LoRA of ``rank`` and
    ``lora_alpha`` ``alpha`` on every module of ``factors``, whose (lora_B, lora_A) it holds,
    the head through ``modules_to_save``; the adapter's own ``config`` (a dataclass) goes
    beside it as ``config_file``. ``PeftModel.from_pretrained(base_model, out_dir)`` then
    loads it."""
    from peft import LoraConfig

    lora_config = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        target_modules=sorted(factors),
        lora_dropout=0.0,
        bias="none",
        modules_to_save=list(heads) or None,
        base_model_name_or_path=base_model_name_or_path,
        task_type=peft_task_type(base),
    )
    peft_model = quiet_get_peft_model(base, lora_config)
    peft_modules = dict(peft_model.base_model.model.named_modules())
    with torch.no_grad():
        for name, (B, A) in factors.items():
            lora = peft_modules[name]
            lora.lora_B["default"].weight.copy_(B.to(lora.lora_B["default"].weight.dtype))
            lora.lora_A["default"].weight.copy_(A.to(lora.lora_A["default"].weight.dtype))
    out = Path(out_dir)
    peft_model.save_pretrained(out)
    (out / config_file).write_text(json.dumps(asdict(config), indent=2))
    return out
