"""Flower Message-API strategies: the shared base and one per aggregation rule.

The strategy of a run is built from its method (``flower_app.methods.build_strategy``)."""

from __future__ import annotations

from strategies.flower.base import AdapterStrategy

__all__ = ["AdapterStrategy"]
