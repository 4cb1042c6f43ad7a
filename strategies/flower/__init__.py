"""Flower Message-API strategies: the shared base and one per aggregation rule.

The strategy of a run is built by its method from the run's settings
(``Method.build_strategy``, flower_app/methods/)."""

from __future__ import annotations

from strategies.flower.base import AdapterStrategy

__all__ = ["AdapterStrategy"]
