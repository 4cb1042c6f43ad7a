"""LoRA-SB (flower_app/adapters/lora_sb/layer.py): W = W0 + s B R A with B (d_out x r) and
A (r x d_in) fixed and identical on every node (a method's hook loads them) and only the
r x r R trained. State: '<layer>.R' plus the head; export: a PEFT LoRA (B R, A)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from flower_app.adapters.base import AdapterKind, Part

if TYPE_CHECKING:
    from torch.nn import Module as Model

    from flower_app.methods.contract import Method
    from flower_app.settings.run_settings import RunSettings


class LoRASBKind(AdapterKind):
    def adapter_config(self, config: RunSettings, method: Method):
        """The layers' settings (``LoRASBConfig``), every field from the run's settings; the
        scale from the method (``Method.adapter_alpha``)."""
        from flower_app.adapters.lora_sb.layer import LoRASBConfig

        return LoRASBConfig(
            r=config.rank,
            alpha=method.adapter_alpha(config),
            target_modules=config.targets,
            head_modules=config.heads,
            train_head=config.train_head,
        )

    def inject(self, model: Model, config: RunSettings, method: Method):
        from flower_app.adapters.lora_sb.layer import inject_lora_sb

        inject_lora_sb(model, self.adapter_config(config, method))
        return model

    def shared_state(self, model: Model, config: RunSettings, method: Method):
        from flower_app.adapters.lora_sb.layer import get_lora_sb_state

        return get_lora_sb_state(model)

    def load_shared_state(self, model: Model, arrays, config: RunSettings, method: Method) -> None:
        from flower_app.adapters.lora_sb.layer import set_lora_sb_state

        set_lora_sb_state(model, arrays)

    def delta_weights(self, model: Model):
        import torch

        from flower_app.adapters.lora_sb.layer import lora_sb_layers

        return {
            name: (layer.base_layer.weight.detach().to(torch.float64),
                   layer.delta_weight().detach().to(torch.float64))
            for name, layer in lora_sb_layers(model).items()
        }  # fmt: skip

    def save_peft(self, model: Model, out_dir: Path, base_model: str) -> Path:
        from flower_app.adapters.lora_sb.layer import export_peft_lora_sb

        return export_peft_lora_sb(model, out_dir, base_model)

    def export_peft(self, model: Model, out_dir: Path, base_model: str) -> bool:
        self.save_peft(model, out_dir, base_model)
        return True


LORA_SB = LoRASBKind(
    name="lora-sb",
    summary="W0 + s B R A: B, A fixed and shared, R (r x r) trained",
    parts={"R": Part("R", lambda d_out, d_in, r: (r, r))},
)

KINDS = (LORA_SB,)
