"""FLoRG's own run settings: where its server step runs, how it treats clients of larger
rank, and which diagnostic it records (``FLoRGSettings``; every method of the ``FLoRG``
class reads them, the ablation and the signed variant included: they build their strategy
as FLoRG does). The adapter's own
settings (``init``, ``subtract-init``, ``projection-sharing``) are the core's: the FLoRG
adapter kind (flower_app/adapters/florg/kind.py) is built from them."""

from __future__ import annotations

from dataclasses import dataclass

from flower_app.settings import setting
from flower_app.settings.checks import one_of


@dataclass(frozen=True)
class FLoRGSettings:
    """Settings: FLoRG's server step (``FLoRG.build_strategy``, strategies/florg/method.py)."""

    server_device: str = setting(
        "auto",
        "FLoRG server step device",
        check=one_of("auto", "cpu", "cuda"),
        affects=(),
    )
    rank_mismatch: str = setting(
        "procrustes",
        "FLoRG when r' > r: Procrustes over all r' rows, or top-r eigenpairs then Procrustes",
        check=one_of("procrustes", "truncate"),
        affects=(),
    )
    fedavg_gap: str = setting(
        "both",
        "FLoRG's per-round diagnostic fedavg_gap_<policy> (how far the server step lands from "
        "FedAvg on A): 'both' rank-mismatch policies (runs the step a second time), 'own' "
        "(the run's policy only) or 'off'; no effect on the model",
        check=one_of("both", "own", "off"),
        affects=(),
    )
