"""A model carrying one method's adapter, and what of it travels between client and server.

The method (``flower_app/methods/``) says which adapter kind to inject (``flower_app/adapters/``)
and which of its parts travel (down and up, every round), stay on the client or stay frozen;
the kind owns the parts, their state keys, injection, state and export. What travels:

    florg adapters   '<layer>.A' + head
    lora adapters    '<layer>.lora_A' and/or '<layer>.lora_B' + head (the method's shared parts)
    lora-sb adapters '<layer>.R' + head (B and A fixed: a method's hook loads them)

A method's hooks may keep tensors on the model (``held_tensors``: e.g. a pristine W0); the
disk cache stores them with the model."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch
from torch import nn

from flower_app.methods.registry import get_method
from flower_app.settings.config import RunConfig


class AdaptedModel:
    """``model`` with the adapter of ``config.method`` injected (in place where its kind
    can); everything adapter-specific is the kind's (``Method.kind``,
    flower_app/adapters/)."""

    def __init__(self, model: nn.Module, config: RunConfig) -> None:
        self.method = get_method(config.method)
        self.kind = self.method.kind
        self.config = config
        self.held_tensors: dict[str, dict[str, torch.Tensor]] = {}
        self.model = self.kind.inject(model, config, self.method)
        self.method.prepare_model(self)

    # -- what travels -------------------------------------------------------------------
    def shared_state(self) -> dict[str, np.ndarray]:
        """The tensors this method sends (client -> server) and receives (server -> client)."""
        return self.kind.shared_state(self.model, self.config, self.method)

    def load_shared_state(self, arrays: Mapping[str, np.ndarray]) -> None:
        self.kind.load_shared_state(self.model, arrays, self.config, self.method)

    def train_parts_of_round(self, server_round: int) -> None:
        """Train in ``server_round`` exactly the parts the method trains then
        (``Method.trained_parts``) and its personal parts; freeze the others (a kind with
        one trained matrix has none to freeze)."""
        trained = set(self.method.trained_parts(server_round)) | set(self.method.local)
        self.kind.train_parts(self.model, trained)

    def uplink_state(self, server_round: int) -> dict[str, np.ndarray]:
        """What this client sends up in ``server_round`` (``Method.uplink``)."""
        return dict(self.method.uplink(self.shared_state(), server_round))

    def fingerprint(self) -> int:
        """The kind's fingerprint of the fixed parts every node shares (FLoRG's L and R: 48
        bits, fits a float64 metric); 0 where there are none."""
        return self.kind.fingerprint(self.model)

    # -- what stays on the client -------------------------------------------------------
    def local_state(self) -> dict[str, np.ndarray]:
        """The method's personal parts (``Method.local``; empty for most methods)."""
        if not self.method.local:
            return {}
        return self.kind.local_state(self.model, self.method.local)

    def load_local_state(self, arrays: Mapping[str, np.ndarray] | None) -> None:
        """Restore the personal parts; ``None`` resets them to their zero initialisation."""
        if not self.method.local:
            return
        if arrays is None:
            arrays = {k: np.zeros_like(v) for k, v in self.local_state().items()}
        self.kind.load_local_state(self.model, arrays, self.method.local)

    # -- export -------------------------------------------------------------------------
    def save_peft(self, out_dir: Path, base_model: str) -> Path:
        """The model as a PEFT LoRA checkpoint for ``PeftModel.from_pretrained`` on the
        unchanged base ``base_model`` (``AdapterKind.save_peft``: FLoRG's and LoRA-SB's
        equivalent LoRA, a LoRA method's own adapter)."""
        return self.kind.save_peft(self.model, out_dir, base_model)

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
        """Where the kind is not PEFT's own (FLoRG, LoRA-SB): write the model as a standard
        PEFT LoRA folder, True; False for LoRA methods (their adapter is PEFT's already, and
        the global arrays are saved as they are)."""
        return self.kind.export_peft(self.model, out_dir, base_model)
