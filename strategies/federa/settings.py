"""FeDeRA's own run setting: its clients' LoRA initialisation (``FeDeRASettings``)."""

from __future__ import annotations

from dataclasses import dataclass

from flower_app.settings import MODEL, setting
from flower_app.settings.checks import one_of


@dataclass(frozen=True)
class FeDeRASettings:
    """Settings: FeDeRA's initialisation (``FeDeRA.lora_init``)."""

    lora_init: str = setting(
        "default",
        "FeDeRA: its clients' LoRA init, 'default' (PEFT's: B = 0, A seeded) or 'federa-svd' "
        "(the principal singular triplets of W0, PEFT's pissa)",
        check=one_of("default", "federa-svd"),
        affects=(MODEL,),
    )
