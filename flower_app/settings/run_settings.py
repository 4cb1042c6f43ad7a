"""The core's run settings as one type: every group of flower_app/settings/ together, with
what derives from their values (``RunSettings``). Methods and adapter kinds are typed against
it; ``RunConfig`` (config.py) adds the registered methods' own settings and serialisation."""

from __future__ import annotations

from dataclasses import dataclass

from flower_app.settings.model_and_data import AdapterSettings, DataSettings, LocalData, WhatRuns
from flower_app.settings.privacy import PrivacySettings
from flower_app.settings.rounds import (
    AsyncRoundSettings,
    EvaluationSettings,
    FederationSettings,
    PrecisionSettings,
    ScreeningSettings,
    TrainingSettings,
    VirtualClockSettings,
)
from flower_app.settings.run import LeaderboardSettings, OutputSettings, TestingSettings
from flower_app.settings.secure import SecureAggregationSettings


# The groups in reverse: a dataclass lists its bases' fields from the last base on, so the
# keys keep the order of flower_app/settings/.
@dataclass(frozen=True)
class RunSettings(
    TestingSettings,
    LeaderboardSettings,
    OutputSettings,
    SecureAggregationSettings,
    PrivacySettings,
    ScreeningSettings,
    EvaluationSettings,
    PrecisionSettings,
    TrainingSettings,
    VirtualClockSettings,
    AsyncRoundSettings,
    FederationSettings,
    AdapterSettings,
    DataSettings,
    LocalData,
    WhatRuns,
):
    """The core's settings: every group of flower_app/settings/ in one object.

    A field ``data_path`` is the key ``data-path`` (Flower's kebab-case convention);
    ``schema()``, ``defaults()``, pyproject's ``[tool.flwr.app.config]`` (generated:
    ``python -m florg_tools.settings --write``) and the cache keys derive from these."""

    @property
    def targets(self) -> tuple[str, ...]:
        return tuple(t.strip() for t in self.target_modules.split(",") if t.strip())

    @property
    def heads(self) -> tuple[str, ...] | None:
        names = tuple(h.strip() for h in self.head_modules.split(",") if h.strip())
        return names or None

    @property
    def head_lr(self) -> float:
        """The task head's learning rate: ``head-learning-rate``, or ``learning-rate``
        where that is 0 (the default: one rate for everything, the paper's protocol)."""
        return self.head_learning_rate or self.learning_rate

    def tests_round(self, server_round: int) -> bool:
        """Whether the server scores the held-out test split after ``server_round``:
        round 0, every ``test-every``-th round and the last three (the reported ones)."""
        return self.max_test_examples > 0 and self._scheduled(server_round, self.test_every)

    def validates_round(self, server_round: int) -> bool:
        """Whether the server scores the validation split after ``server_round``: round 0,
        every ``eval-every``-th round and the last three (what tuning reads)."""
        return self._scheduled(server_round, self.eval_every)

    def in_last_rounds(self, server_round: int) -> bool:
        """Whether ``server_round`` is one of the run's last three rounds, whose mean
        validation score the tuning reads (so every method is scored there)."""
        return server_round > self.num_server_rounds - 3

    def _scheduled(self, server_round: int, every: int) -> bool:
        periodic = every > 0 and server_round % every == 0
        return server_round == 0 or periodic or self.in_last_rounds(server_round)
