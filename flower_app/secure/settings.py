"""SecAgg+'s settings, ``SecAggPlusSettings``, named as Flower's ``SecAggPlusWorkflow`` names
them and checked when built (a ValueError naming the setting), and built from the run's
``secaggplus-*`` settings (``secaggplus_settings``). In the core, not beside the server's
protocol (strategies/server/secure_sum.py), so that the run settings' checks can build them."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from flower_app.settings.checks import ConfigError

if TYPE_CHECKING:
    from flower_app.settings.run_settings import RunSettings


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


@dataclass(frozen=True)
class SecAggPlusSettings:
    """SecAgg+'s settings, named as Flower's ``SecAggPlusWorkflow`` names them.

    ``num_shares``: an int >= 3, or a float in (0, 1], the fraction of the nodes; each node's
    neighbourhood (itself included) holds one share of its secrets. ``reconstruction_threshold``:
    an int >= 2 (below an int ``num_shares``), or a float in (0, 1], the fraction of the
    shares. The values sent are clipped to [-clipping_range, clipping_range] (refused on the
    client when outside) and quantised onto [0, quantization_range]; masks are drawn modulo
    ``modulus_range`` (a power of 2). ``max_weight`` bounds each client's weight, itself a
    sent value (so at most ``clipping_range``). ``timeout``: seconds per stage, or None.
    """

    num_shares: int | float
    reconstruction_threshold: int | float
    clipping_range: float = 8.0
    quantization_range: int = 2**22
    modulus_range: int = 2**32
    max_weight: float = 1.0
    timeout: float | None = None

    def __post_init__(self) -> None:
        shares, threshold = self.num_shares, self.reconstruction_threshold
        if _is_int(shares):
            if shares < 3:
                raise ValueError(
                    f"num_shares as an int must be >= 3 (1.0: all nodes), got {shares}"
                )
        elif not (_is_real(shares) and 0 < shares <= 1):
            raise ValueError(f"num_shares must be an int >= 3 or a float in (0, 1], got {shares!r}")
        if _is_int(threshold):
            if threshold < 2:
                raise ValueError(
                    f"reconstruction_threshold as an int must be >= 2 (a threshold of 1 "
                    f"hands the secret to every neighbour), got {threshold}"
                )
            if _is_int(shares) and threshold >= shares:
                raise ValueError(
                    f"reconstruction_threshold ({threshold}) must be below num_shares ({shares})"
                )
        elif not (_is_real(threshold) and 0 < threshold <= 1):
            raise ValueError(
                "reconstruction_threshold must be an int >= 2 or a float in (0, 1], "
                f"got {threshold!r}"
            )
        c = self.clipping_range
        if not (_is_real(c) and math.isfinite(c) and c > 0):
            raise ValueError(f"clipping_range must be a finite number > 0, got {c!r}")
        q, m = self.quantization_range, self.modulus_range
        # quantize rounds into int32: the top value q itself must fit.
        if not (_is_int(q) and 2 <= q < 2**31):
            raise ValueError(f"quantization_range must be an int in [2, 2**31), got {q!r}")
        if not (_is_int(m) and m > q and m <= 2**32 and m & (m - 1) == 0):
            raise ValueError(
                "modulus_range must be a power of 2 above quantization_range and at most "
                f"2**32, got {m!r}"
            )
        w = self.max_weight
        if not (_is_real(w) and math.isfinite(w) and 0 < w <= c):
            raise ValueError(
                f"max_weight must be > 0 and at most clipping_range ({c:g}): the weight is "
                f"sent as one of the clipped values; got {w!r}"
            )
        t = self.timeout
        if t is not None and not (_is_real(t) and math.isfinite(t) and t > 0):
            raise ValueError(f"timeout must be None or a finite number > 0, got {t!r}")


def _count_or_fraction(value: float, key: str, least: int) -> int | float:
    """A fraction in (0, 1] as a float, or a whole count >= ``least`` as an int."""
    if value <= 1:
        return float(value)
    if value != int(value) or value < least:
        raise ConfigError(f"{key}: a fraction in (0, 1] or a whole count >= {least}, got {value}")
    return int(value)


def secaggplus_settings(config: RunSettings, timeout: float | None = None) -> SecAggPlusSettings:
    """The run's ``SecAggPlusSettings`` (``secaggplus-*``, flower_app/settings/secure.py;
    checked: a ConfigError naming the key). The weight a client sends is at most 1 (1 with
    uniform weights; with num-examples its examples / ``secaggplus-max-weight``, capped:
    ``client_weight``), so the protocol's ``max_weight`` is 1."""
    keys = {
        "num_shares": "secaggplus-num-shares",
        "reconstruction_threshold": "secaggplus-reconstruction-threshold",
    }
    try:
        return SecAggPlusSettings(
            num_shares=_count_or_fraction(config.secaggplus_num_shares, keys["num_shares"], 3),
            reconstruction_threshold=_count_or_fraction(
                config.secaggplus_reconstruction_threshold, keys["reconstruction_threshold"], 2
            ),
            clipping_range=config.secaggplus_clipping_range,
            quantization_range=config.secaggplus_quantization_range,
            modulus_range=config.secaggplus_modulus_range,
            max_weight=1.0,
            timeout=config.secaggplus_timeout or timeout,
        )
    except ValueError as err:
        if isinstance(err, ConfigError):
            raise
        name = str(err).split(" ")[0]  # SecAggPlusSettings names its field first
        key = keys.get(name, "secaggplus-" + name.replace("_", "-"))
        raise ConfigError(f"{key}: {err}") from None


def client_weight(config: RunSettings, num_examples: float) -> float:
    """The weight a client adds to the secure sum: 1 with uniform weights; with
    ``aggregation-weights=num-examples`` its examples / ``secaggplus-max-weight``, at most 1
    (as Flower's SecAgg+ mod scales a reply: a client with more examples counts as that
    many), so that w x stays within the clipping range whenever x does."""
    if config.aggregation_weights == "uniform":
        return 1.0
    if not (math.isfinite(num_examples) and num_examples > 0):
        raise ValueError(f"num-examples must be finite and > 0, got {num_examples}")
    return min(1.0, float(num_examples) / config.secaggplus_max_weight)
