"""FedRot-LoRA's own run setting: which orthogonal matrices its rotation may be
(``FedRotLoRASettings``; ``rule.procrustes_rotation``)."""

from __future__ import annotations

from dataclasses import dataclass

from flower_app.settings import setting
from flower_app.settings.checks import one_of


@dataclass(frozen=True)
class FedRotLoRASettings:
    """Settings: FedRot-LoRA's rotation (``FedRotLoRA.build_strategy``)."""

    fedrot_rotation: str = setting(
        "orthogonal",
        "FedRot-LoRA: each client's Procrustes R, 'orthogonal' (R = U V^T in O(r), a "
        "reflection kept: the authors' default) or 'proper' (in SO(r): when det(U V^T) < 0 the "
        "last column of U is negated first, the Kabsch rotation); both keep each B A",
        check=one_of("orthogonal", "proper"),
        # the server's rule only: the model built before training is the same
        affects=(),
    )
