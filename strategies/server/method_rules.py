"""What the common strategy reads from the method that builds it (``MethodRules``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

import numpy as np

from strategies.server.central_dp import CentralDP


class MethodRules(Protocol):
    """What the strategy reads from the method that builds it (a
    ``strategies.shared.base_method.BaseMethod``; the strategy never imports it, so the
    dependency runs method -> strategy)."""

    name: str
    heterogeneous_ranks: bool

    def check_dp_supported(self) -> str: ...

    def uplink(
        self, state: Mapping[str, np.ndarray], server_round: int
    ) -> Mapping[str, np.ndarray]: ...

    def aggregate(
        self,
        sent: Mapping[str, np.ndarray],
        payloads: list[dict[str, np.ndarray]],
        weights: np.ndarray,
    ) -> tuple[dict[str, np.ndarray], dict[str, float]]: ...

    def aggregate_private(
        self,
        dp: CentralDP,
        sent: Mapping[str, np.ndarray],
        payloads: list[dict[str, np.ndarray]],
        num_sampled: float,
    ) -> tuple[dict[str, np.ndarray], dict[str, float]]: ...
