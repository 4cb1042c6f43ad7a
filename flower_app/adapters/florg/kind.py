"""FLoRG's adapter (the paper's eq. 1): W = W0 + s L AᵀA R with L, R fixed, semi-orthogonal
and identical on every node, and A (r x k, k = min(d_in, d_out)) the one trained matrix; its
layers are flower_app/adapters/florg/layer.py and florg_model.py. State: '<layer>.A' plus
the head; export: the equivalent PEFT LoRA (B = s' L Aᵀ, A' = A R)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from flower_app.adapters.base import AdapterKind, Part

if TYPE_CHECKING:
    from torch.nn import Module as Model

    from flower_app.methods.contract import Method
    from flower_app.settings.run_settings import RunSettings

# subtract-init writes s L A1^T A1 R into W0 with the node's own A1 (r_n rows): nodes of
# different rank would hold different W0, and Q = sum w_n A_n^T A_n would not be the
# update of any one model.
SUBTRACT_INIT_NEEDS_ONE_RANK = (
    "subtract-init=true subtracts each node's own initial Gram s L A1^T A1 R from W0, so "
    "nodes of different rank would not share W0: with client-ranks or a node-config rank, "
    "set subtract-init=false"
)


class FLoRGKind(AdapterKind):
    def check_settings(self, config: RunSettings, method: Method) -> None:
        if config.client_ranks.strip() and config.subtract_init:
            raise ValueError(SUBTRACT_INIT_NEEDS_ONE_RANK)

    def check_node_rank(self, config: RunSettings, r: int, r_max: int) -> None:
        if r != r_max and config.subtract_init:
            raise ValueError(f"node-config rank={r}: {SUBTRACT_INIT_NEEDS_ONE_RANK}")

    def adapter_config(self, config: RunSettings, method: Method):
        """The layers' settings (``FLoRGConfig``), every field from the run's settings."""
        from flower_app.adapters.florg.model import FLoRGConfig

        return FLoRGConfig(
            r=config.rank,
            alpha=method.adapter_alpha(config),
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

    def inject(self, model: Model, config: RunSettings, method: Method):
        from flower_app.adapters.florg.model import inject_florg

        inject_florg(model, self.adapter_config(config, method))
        return model

    def shared_state(self, model: Model, config: RunSettings, method: Method):
        from flower_app.adapters.florg.model import get_florg_state

        return get_florg_state(model)

    def load_shared_state(self, model: Model, arrays, config: RunSettings, method: Method) -> None:
        from flower_app.adapters.florg.model import set_florg_state

        set_florg_state(model, dict(arrays))

    def delta_weights(self, model: Model):
        import torch

        from flower_app.adapters.florg.model import florg_layers

        return {
            name: (layer.base_layer.weight.detach().to(torch.float64),
                   layer.delta_weight().detach().to(torch.float64))
            for name, layer in florg_layers(model).items()
        }  # fmt: skip

    def subtracts_initial_update(self, config: RunSettings, method: Method) -> bool:
        return bool(config.subtract_init)

    def fingerprint(self, model: Model) -> int:
        """48 bits of the L/R fingerprint (fits a float64 metric): the server checks every
        client's against its own."""
        from flower_app.adapters.florg.model import florg_fingerprint

        return int(florg_fingerprint(model)[:12], 16)

    def save_peft(self, model: Model, out_dir: Path, base_model: str) -> Path:
        from flower_app.adapters.florg.model import export_peft_lora

        return export_peft_lora(model, out_dir, base_model)

    def export_peft(self, model: Model, out_dir: Path, base_model: str) -> bool:
        self.save_peft(model, out_dir, base_model)
        return True


FLORG = FLoRGKind(
    name="florg",
    summary="W0 + s L AᵀA R: L, R fixed and shared, A (r x min(d_in, d_out)) trained",
    parts={"A": Part("A", lambda d_out, d_in, r: (r, min(d_in, d_out)))},
)

KINDS = (FLORG,)
