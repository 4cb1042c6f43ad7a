"""What a secure sum returns (``SecureSumResult``), reports and exchanged, and its failure."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
from flwr.app import Message


@dataclass(frozen=True)
class SecureSumReport:
    """Who took part: ``survivors`` (their contributions are in the sum),
    ``dropped_after_keys`` (shared their keys, then sent no valid masked vector: their masks
    were rebuilt), ``dropped_before`` (lost before sharing keys: in no one's masks),
    ``silent_at_unmask`` (survivors that sent no shares), the resolved shares and threshold,
    whether every needed secret had threshold-many live holders, each failed reply's error."""

    sampled: tuple[int, ...]
    survivors: tuple[int, ...] = ()
    dropped_after_keys: tuple[int, ...] = ()
    dropped_before: tuple[int, ...] = ()
    silent_at_unmask: tuple[int, ...] = ()
    num_shares: int = 0
    threshold: int = 0
    threshold_met: bool = False
    errors: Mapping[int, str] = field(default_factory=dict)


@dataclass
class SecureSumTraffic:
    """What a secure sum exchanged, filled as it runs (also when it fails): the bytes sent
    to and received from each node over the four stages (``wire_bytes``) and each node's
    reply to the collect stage (its training reply's metrics travel there)."""

    down_bytes: dict[int, int] = field(default_factory=dict)
    up_bytes: dict[int, int] = field(default_factory=dict)
    collected: dict[int, Message] = field(default_factory=dict)


class SecureSumFailed(RuntimeError):
    """The secure sum could not be completed (``reason``); ``report`` says who was lost."""

    def __init__(self, reason: str, report: SecureSumReport | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.report = report


@dataclass(frozen=True)
class SecureSumResult:
    """The unmasked sums over the survivors: ``weighted_sums`` (sum w x per array name),
    ``weight_sum`` (sum w), and the round's ``report``."""

    weighted_sums: dict[str, np.ndarray]
    weight_sum: float
    report: SecureSumReport

    def weighted_mean(self) -> dict[str, np.ndarray]:
        if self.weight_sum <= 0:
            raise ValueError(f"the weights sum to {self.weight_sum}: no weighted mean")
        return {name: arr / self.weight_sum for name, arr in self.weighted_sums.items()}
