"""A model carrying one method's adapter, and what of it travels between client and server.

What travels (down and up, every round), per method:

    florg, florg-no-procrustes   '<layer>.A' + head
    fedit, federa, fedex-lora    '<layer>.lora_A', '<layer>.lora_B' + head
    ffa-lora                     '<layer>.lora_B' + head      (A frozen, seeded on every node)
    fedsa-lora                   '<layer>.lora_A' + head      (B personal: ``local_state``)

FedEx-LoRA's residuals are folded into the frozen base weights with ``set_residual``;
the pristine W0 is kept so a process can serve several clients with different folds.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch
from torch import nn

from flower_app.adapters.florg_model import (
    FLoRGConfig,
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
from flower_app.config import RunConfig

SHARED_PARTS: dict[str, tuple[str, ...]] = {
    "fedit": ("A", "B"),
    "federa": ("A", "B"),
    "fedex-lora": ("A", "B"),
    "ffa-lora": ("B",),
    "fedsa-lora": ("A",),
}


class AdaptedModel:
    """``model`` with the adapter of ``config.method`` injected (in place)."""

    def __init__(self, model: nn.Module, config: RunConfig) -> None:
        self.method = config.method
        self.config = config
        if config.is_florg:
            inject_florg(
                model,
                FLoRGConfig(
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
                ),
            )
            self.model = model
        else:
            self.model = inject_lora(
                model,
                LoRAConfig(
                    r=config.rank,
                    alpha=config.alpha,
                    target_modules=config.targets,
                    seed=config.seed,
                    init=config.lora_init if config.method == "federa" else "default",
                    freeze_A=config.method == "ffa-lora",
                    head_modules=config.heads,
                    train_head=config.train_head,
                ),
            )
        self._pristine: dict[str, torch.Tensor] = {}
        if self.method == "fedex-lora":
            self._pristine = {
                name: layer.get_base_layer().weight.detach().clone()
                for name, layer in lora_layers(self.model).items()
            }

    # -- what travels -------------------------------------------------------------------
    def shared_state(self) -> dict[str, np.ndarray]:
        """The tensors this method sends (client -> server) and receives (server -> client)."""
        if self.config.is_florg:
            return get_florg_state(self.model)
        return get_lora_state(self.model, SHARED_PARTS[self.method], self.config.train_head)

    def load_shared_state(self, arrays: Mapping[str, np.ndarray]) -> None:
        if self.config.is_florg:
            set_florg_state(self.model, dict(arrays))
        else:
            set_lora_state(self.model, arrays, SHARED_PARTS[self.method], self.config.train_head)

    def fingerprint(self) -> int:
        """FLoRG: 48-bit integer of the L/R fingerprint (fits a float64 metric); else 0."""
        if not self.config.is_florg:
            return 0
        from flower_app.adapters.florg_model import florg_fingerprint

        return int(florg_fingerprint(self.model)[:12], 16)

    # -- what stays on the client -------------------------------------------------------
    def local_state(self) -> dict[str, np.ndarray]:
        """FedSA-LoRA's personal B matrices (empty for every other method)."""
        if self.method != "fedsa-lora":
            return {}
        return get_lora_state(self.model, ("B",), include_head=False)

    def load_local_state(self, arrays: Mapping[str, np.ndarray] | None) -> None:
        """Restore FedSA-LoRA's B; ``None`` resets it to its zero initialisation."""
        if self.method != "fedsa-lora":
            return
        if arrays is None:
            arrays = {k: np.zeros_like(v) for k, v in self.local_state().items()}
        set_lora_state(self.model, arrays, ("B",), include_head=False)

    # -- FedEx-LoRA ---------------------------------------------------------------------
    def set_residual(self, cumulative: Mapping[str, np.ndarray]) -> None:
        """W0 <- W0_pristine + s * cumulative residual (dense, per layer); {} restores W0."""
        layers = lora_layers(self.model)
        with torch.no_grad():
            for name, w0 in self._pristine.items():
                weight = layers[name].get_base_layer().weight
                if name in cumulative:
                    scale = layers[name].scaling["default"]
                    delta = torch.as_tensor(np.asarray(cumulative[name], np.float64)) * scale
                    weight.copy_((w0.double() + delta.to(w0.device)).to(w0.dtype))
                else:
                    weight.copy_(w0)
