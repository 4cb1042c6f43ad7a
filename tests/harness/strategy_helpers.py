"""A method's strategy as the ServerApp builds it: from a run's settings (the defaults, the
method and ``settings``, whose keyword names are the setting keys with ``_`` for ``-``)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from flower_app.methods.registry import build_strategy
from flower_app.settings.config import RunConfig, resolve_config


def run_settings(method: str = "florg", **settings: Any) -> RunConfig:
    """The defaults with ``method`` and ``settings`` (``screen_kappa=2`` is ``screen-kappa``)."""
    values = {key.replace("_", "-"): value for key, value in settings.items()}
    return resolve_config({}, {"method": method, **values})


def strategy_for(
    method: str,
    initial_state: Mapping[str, np.ndarray],
    *,
    fingerprint: int | None = None,
    run_dir: Path | None = None,
    **settings: Any,
):
    """``method``'s strategy for a run with ``run_settings(method, **settings)``."""
    config = run_settings(method, **settings)
    return build_strategy(config, initial_state, fingerprint=fingerprint, run_dir=run_dir)
