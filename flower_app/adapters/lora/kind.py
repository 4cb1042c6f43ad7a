"""Standard LoRA through PEFT (flower_app/adapters/lora/layer.py): W = W0 + s B A with B (d_out x r)
and A (r x d_in); which of them travel, stay on the client or stay frozen is the method's
(``Method.shared``, ``local``, ``frozen``), its initialisation too (``Method.lora_init``).
State: '<layer>.lora_A', '<layer>.lora_B' plus the head; export: PEFT's own folder."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from flower_app.adapters.base import AdapterKind, Part

if TYPE_CHECKING:
    from torch.nn import Module as Model

    from flower_app.methods.contract import Method
    from flower_app.settings.run_settings import RunSettings


class LoRAKind(AdapterKind):
    def adapter_config(self, config: RunSettings, method: Method):
        """The adapter's settings (``LoRAConfig``), every field from the run's settings."""
        from flower_app.adapters.lora.layer import LoRAConfig

        return LoRAConfig(
            r=config.rank,
            alpha=method.adapter_alpha(config),
            target_modules=config.targets,
            seed=config.seed,
            init=method.lora_init(config),
            freeze_A="A" in method.frozen,
            head_modules=config.heads,
            train_head=config.train_head,
        )

    def inject(self, model: Model, config: RunSettings, method: Method):
        from flower_app.adapters.lora.layer import inject_lora

        return inject_lora(model, self.adapter_config(config, method))

    def shared_state(self, model: Model, config: RunSettings, method: Method):
        from flower_app.adapters.lora.layer import get_lora_state

        return get_lora_state(model, method.shared, config.train_head)

    def load_shared_state(self, model: Model, arrays, config: RunSettings, method: Method) -> None:
        from flower_app.adapters.lora.layer import set_lora_state

        set_lora_state(model, arrays, method.shared, config.train_head)

    def train_parts(self, model: Model, trained: set[str]) -> None:
        from flower_app.adapters.lora.layer import lora_layers

        for layer in lora_layers(model).values():
            layer.lora_A["default"].weight.requires_grad_("A" in trained)
            layer.lora_B["default"].weight.requires_grad_("B" in trained)

    def local_state(self, model: Model, parts):
        from flower_app.adapters.lora.layer import get_lora_state

        return get_lora_state(model, parts, include_head=False)

    def load_local_state(self, model: Model, arrays, parts) -> None:
        from flower_app.adapters.lora.layer import set_lora_state

        set_lora_state(model, arrays, parts, include_head=False)

    def delta_weights(self, model: Model):
        import torch

        from flower_app.adapters.lora.layer import lora_layers

        return {
            name: (layer.base_layer.weight.detach().to(torch.float64),
                   layer.get_delta_weight("default").detach().to(torch.float64))
            for name, layer in lora_layers(model).items()
        }  # fmt: skip

    def subtracts_initial_update(self, config: RunSettings, method: Method) -> bool:
        """The SVD initialisation (PEFT's PiSSA) freezes W0 - s B A."""
        return method.lora_init(config) == "svd"

    def save_peft(self, model: Model, out_dir: Path, base_model: str) -> Path:
        """PEFT's ``save_pretrained``, its config naming the base and, for a causal LM,
        ``task_type`` CAUSAL_LM (as the other kinds' exports do)."""
        from flower_app.adapters.custom_adapter import peft_task_type

        out = Path(out_dir)
        model.save_pretrained(out)
        path = out / "adapter_config.json"
        adapter_config = json.loads(path.read_text())
        adapter_config["base_model_name_or_path"] = base_model
        adapter_config["task_type"] = peft_task_type(model.get_base_model())
        path.write_text(json.dumps(adapter_config, indent=2, sort_keys=True) + "\n")
        return out


LORA = LoRAKind(
    name="lora",
    summary="W0 + s B A (PEFT): B (d_out x r), A (r x d_in)",
    parts={
        "A": Part("lora_A", lambda d_out, d_in, r: (r, d_in)),
        "B": Part("lora_B", lambda d_out, d_in, r: (d_out, r)),
    },
)

KINDS = (LORA,)
