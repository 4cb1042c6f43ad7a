"""A model carrying one method's adapter, and what of it travels between client and server.

The method (``strategies/``) says which adapter to inject and which of its parts
travel (down and up, every round), stay on the client or stay frozen:

    florg adapters   '<layer>.A' + head
    lora adapters    '<layer>.lora_A' and/or '<layer>.lora_B' + head (the method's shared parts)
    lora-sb adapters '<layer>.R' + head (B and A fixed: a method's hook loads them)

A method's hooks may keep tensors on the model (``held_tensors``: e.g. a pristine
W0); the disk cache stores them with the model.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch
from torch import nn

from flower_app.adapters.florg_model import (
    FLoRGConfig,
    export_peft_lora,
    florg_fingerprint,
    get_florg_state,
    inject_florg,
    set_florg_state,
)
from flower_app.adapters.lora import (
    LoRAConfig,
    get_lora_state,
    inject_lora,
    lora_layers,
    set_lora_state,
)
from flower_app.adapters.lora_sb import (
    LoRASBConfig,
    export_peft_lora_sb,
    get_lora_sb_state,
    inject_lora_sb,
    set_lora_sb_state,
)
from flower_app.config import RunConfig
from strategies.registry import Method, get_method


def florg_config(config: RunConfig, method: Method) -> FLoRGConfig:
    """The FLoRG adapter of a run with the settings ``config`` (every field from them)."""
    return FLoRGConfig(
        r=config.rank,
        alpha=config.alpha,
        target_modules=config.targets,
        seed=config.seed,
        a_init_std=config.a_init_std,
        projection_init=config.projection_init,
        projection_sharing=config.projection_sharing,
        subtract_init=config.subtract_init,
        head_modules=config.heads,
        train_head=config.train_head,
        signs=method.florg_signs(config.rank),
    )


def lora_config(config: RunConfig, method: Method) -> LoRAConfig:
    """The LoRA adapter of a run with the settings ``config`` (every field from them)."""
    return LoRAConfig(
        r=config.rank,
        alpha=config.alpha,
        target_modules=config.targets,
        seed=config.seed,
        init=method.lora_init(config),
        freeze_A="A" in method.frozen,
        head_modules=config.heads,
        train_head=config.train_head,
    )


def lora_sb_config(config: RunConfig, method: Method) -> LoRASBConfig:
    """The LoRA-SB adapter of a run with the settings ``config`` (every field from them;
    its scale from the method, ``Method.adapter_alpha``)."""
    return LoRASBConfig(
        r=config.rank,
        alpha=method.adapter_alpha(config),
        target_modules=config.targets,
        head_modules=config.heads,
        train_head=config.train_head,
    )


class AdaptedModel:
    """``model`` with the adapter of ``config.method`` injected (in place)."""

    def __init__(self, model: nn.Module, config: RunConfig) -> None:
        self.method = get_method(config.method)
        self.config = config
        self.held_tensors: dict[str, dict[str, torch.Tensor]] = {}
        if self.method.adapter == "florg":
            inject_florg(model, florg_config(config, self.method))
            self.model = model
        elif self.method.adapter == "lora-sb":
            inject_lora_sb(model, lora_sb_config(config, self.method))
            self.model = model
        else:
            self.model = inject_lora(model, lora_config(config, self.method))
        self.method.prepare_model(self)

    @property
    def is_florg(self) -> bool:
        return self.method.adapter == "florg"

    @property
    def is_lora_sb(self) -> bool:
        return self.method.adapter == "lora-sb"

    # -- what travels -------------------------------------------------------------------
    def shared_state(self) -> dict[str, np.ndarray]:
        """The tensors this method sends (client -> server) and receives (server -> client)."""
        if self.is_florg:
            return get_florg_state(self.model)
        if self.is_lora_sb:
            return get_lora_sb_state(self.model)
        return get_lora_state(self.model, self.method.shared, self.config.train_head)

    def load_shared_state(self, arrays: Mapping[str, np.ndarray]) -> None:
        if self.is_florg:
            set_florg_state(self.model, dict(arrays))
        elif self.is_lora_sb:
            set_lora_sb_state(self.model, arrays)
        else:
            set_lora_state(self.model, arrays, self.method.shared, self.config.train_head)

    def train_parts_of_round(self, server_round: int) -> None:
        """Train in ``server_round`` exactly the parts the method trains then
        (``Method.trained_parts``) and its personal parts; freeze the other LoRA factors
        (a FLoRG adapter trains its one A, a LoRA-SB adapter its one R)."""
        if self.is_florg or self.is_lora_sb:
            return
        trained = set(self.method.trained_parts(server_round)) | set(self.method.local)
        for layer in lora_layers(self.model).values():
            layer.lora_A["default"].weight.requires_grad_("A" in trained)
            layer.lora_B["default"].weight.requires_grad_("B" in trained)

    def uplink_state(self, server_round: int) -> dict[str, np.ndarray]:
        """What this client sends up in ``server_round`` (``Method.uplink``)."""
        return dict(self.method.uplink(self.shared_state(), server_round))

    def fingerprint(self) -> int:
        """FLoRG: 48-bit integer of the L/R fingerprint (fits a float64 metric); else 0."""
        return int(florg_fingerprint(self.model)[:12], 16) if self.is_florg else 0

    # -- what stays on the client -------------------------------------------------------
    def local_state(self) -> dict[str, np.ndarray]:
        """The method's personal parts (``Method.local``; empty for most methods)."""
        if not self.method.local:
            return {}
        return get_lora_state(self.model, self.method.local, include_head=False)

    def load_local_state(self, arrays: Mapping[str, np.ndarray] | None) -> None:
        """Restore the personal parts; ``None`` resets them to their zero initialisation."""
        if not self.method.local:
            return
        if arrays is None:
            arrays = {k: np.zeros_like(v) for k, v in self.local_state().items()}
        set_lora_state(self.model, arrays, self.method.local, include_head=False)

    # -- export -------------------------------------------------------------------------
    def save_peft(self, out_dir: Path, base_model: str) -> Path:
        """The model as a PEFT LoRA checkpoint for ``PeftModel.from_pretrained`` on the
        unchanged base ``base_model``: FLoRG's equivalent LoRA (``export_peft_lora``), a
        LoRA method's own adapter (PEFT's ``save_pretrained``, its config naming the base
        and, for a causal LM, ``task_type`` CAUSAL_LM as FLoRG's export does)."""
        if self.is_florg:
            return export_peft_lora(self.model, out_dir, base_model)
        if self.is_lora_sb:
            return export_peft_lora_sb(self.model, out_dir, base_model)
        import json

        from flower_app.adapters.custom_adapter import peft_task_type

        out = Path(out_dir)
        self.model.save_pretrained(out)
        path = out / "adapter_config.json"
        adapter_config = json.loads(path.read_text())
        adapter_config["base_model_name_or_path"] = base_model
        adapter_config["task_type"] = peft_task_type(self.model.get_base_model())
        path.write_text(json.dumps(adapter_config, indent=2, sort_keys=True) + "\n")
        return out

    def save_merged(self, out_dir: Path) -> Path:
        """The whole model, W0 with the method's folds and the adapter merged in
        (W0 + s (cumulative fold + B A)), as a plain Hugging Face checkpoint: what a method
        that writes into W0 (``Method.writes_base_weights``) exports, since a LoRA over the
        unchanged base cannot hold its folds (their rank grows with rounds and clients).
        The merge runs on a copy; this model keeps its adapter."""
        import copy

        merged = copy.deepcopy(self.model).merge_and_unload()
        out = Path(out_dir)
        merged.save_pretrained(out)
        return out

    def export_peft(self, out_dir: Path, base_model: str) -> bool:
        """FLoRG and LoRA-SB: write the model as a standard PEFT LoRA folder; False for LoRA
        methods (their adapter is PEFT's already, and the global arrays are saved as they
        are)."""
        if self.is_florg:
            export_peft_lora(self.model, out_dir, base_model)
            return True
        if self.is_lora_sb:
            export_peft_lora_sb(self.model, out_dir, base_model)
            return True
        return False
