"""FedEx-LoRA's own run setting: how its residual travels down (``FedExLoRASettings``)."""

from __future__ import annotations

from dataclasses import dataclass

from flower_app.settings import MODEL, setting
from flower_app.settings.checks import one_of


@dataclass(frozen=True)
class FedExLoRASettings:
    """Settings: FedEx-LoRA's residual transport (``FedExLoRA.build_strategy``)."""

    fedex_residual: str = setting(
        "dense",
        "FedEx residual transport",
        check=one_of("dense", "factored"),
        affects=(MODEL,),
    )
