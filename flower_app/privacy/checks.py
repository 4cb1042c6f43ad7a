"""The checks of central DP's settings (``dp``, ``dp-clipping-norm``, ``dp-noise-multiplier``,
``dp-delta``) and of the accountant's inputs, each ValueError naming its key."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

KEY_DP = "dp"
KEY_CLIPPING_NORM = "dp-clipping-norm"
KEY_NOISE_MULTIPLIER = "dp-noise-multiplier"
KEY_DELTA = "dp-delta"
DP_MODES: tuple[str, ...] = ("off", "central")


def _real(value: Any, key: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise ValueError(f"{key} must be a number, got {value!r}")
    return float(value)


def check_dp_mode(mode: Any) -> str:
    """The ``dp`` setting ('off' or 'central'), or ValueError naming it."""
    if mode not in DP_MODES:
        raise ValueError(f"{KEY_DP} must be one of {DP_MODES}, got {mode!r}")
    return str(mode)


def check_clipping_norm(clipping_norm: Any) -> float:
    """C as a float, or ValueError naming ``dp-clipping-norm`` (finite and > 0)."""
    c = _real(clipping_norm, KEY_CLIPPING_NORM)
    if not (math.isfinite(c) and c > 0):
        raise ValueError(f"{KEY_CLIPPING_NORM} must be finite and > 0, got {clipping_norm!r}")
    return c


def check_noise_multiplier(noise_multiplier: Any, allow_zero: bool = False) -> float:
    """z as a float, or ValueError naming ``dp-noise-multiplier``.

    A run setting must be > 0 (z = 0 adds no noise and has epsilon = infinity); the
    mechanisms accept z = 0 (``allow_zero``) so that tests can switch the noise off and
    check that everything after it is the noiseless rule.
    """
    z = _real(noise_multiplier, KEY_NOISE_MULTIPLIER)
    if not math.isfinite(z) or z < 0 or (z == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{KEY_NOISE_MULTIPLIER} must be finite and {bound}, got {z!r}")
    return z


def check_delta(delta: Any) -> float:
    """delta as a float, or ValueError naming ``dp-delta`` (strictly between 0 and 1)."""
    d = _real(delta, KEY_DELTA)
    if not (0.0 < d < 1.0):
        raise ValueError(f"{KEY_DELTA} must be strictly between 0 and 1, got {delta!r}")
    return d


def check_sample_rate(sample_rate: Any) -> float:
    """The per-round client sampling probability q in (0, 1]."""
    q = _real(sample_rate, "sample rate")
    if not (0.0 < q <= 1.0):
        raise ValueError(f"sample rate must be in (0, 1], got {sample_rate!r}")
    return q


def _check_steps(steps: Any) -> int:
    if isinstance(steps, bool) or not isinstance(steps, (int, np.integer)) or steps < 0:
        raise ValueError(f"steps must be an integer >= 0, got {steps!r}")
    return int(steps)


def check_dp_settings(
    *,
    clipping_norm: Any,
    noise_multiplier: Any,
    delta: Any,
    aggregation_weights: str = "uniform",
) -> None:
    """Every check a run with ``dp=central`` needs before it starts, each ValueError naming
    its run-config key: C > 0, z > 0, 0 < delta < 1, uniform weights.

    ``aggregation-weights=num-examples`` is refused: the weights are client-reported and
    data-dependent, and a weight w_n > 1/m multiplies that client's sensitivity by m w_n,
    which the noise std z C / m does not cover (Flower's accounted wrapper likewise
    requires equal weights).
    """
    check_clipping_norm(clipping_norm)
    check_noise_multiplier(noise_multiplier)
    check_delta(delta)
    if aggregation_weights != "uniform":
        raise ValueError(
            "dp=central needs aggregation-weights='uniform' (client-reported example counts "
            f"are data-dependent and raise one client's sensitivity), got {aggregation_weights!r}"
        )
