"""Settings: secure aggregation (SecAgg+, docs/secure-aggregation.md)."""

from __future__ import annotations

from dataclasses import dataclass

from flower_app.settings import setting
from flower_app.settings.checks import non_negative_finite, one_of, positive_finite


@dataclass(frozen=True)
class SecureAggregationSettings:
    """Settings: secure aggregation (SecAgg+, docs/secure-aggregation.md)."""

    secure_aggregation: str = setting(
        "off",
        "'secaggplus': the server learns only the sum of the clients' contributions "
        "(SecAgg+ with dropouts), never one client's update; 'off': plain replies",
        check=one_of("off", "secaggplus"),
        affects=(),
    )
    secaggplus_num_shares: float = setting(
        1.0,
        "secaggplus: each node's secrets are shared with this many nodes: a fraction in "
        "(0, 1] of the round's nodes, or a whole count >= 3",
        check=positive_finite,
        affects=(),
    )
    secaggplus_reconstruction_threshold: float = setting(
        0.7,
        "secaggplus: shares needed to rebuild a secret: a fraction in (0, 1] of the shares, "
        "or a whole count >= 2 (above half the shares rules out a server asking for both)",
        check=positive_finite,
        affects=(),
    )
    secaggplus_clipping_range: float = setting(
        8.0,
        "secaggplus: every value a client sends lies in [-c, c] (a client with a value "
        "beyond it refuses the round, counted as a dropout)",
        check=positive_finite,
        affects=(),
    )
    secaggplus_quantization_range: int = setting(
        4194304,
        "secaggplus: [-c, c] is quantised onto [0, Q] (error <= 2c/Q per value and client)",
        affects=(),
    )
    secaggplus_modulus_range: int = setting(
        4294967296,
        "secaggplus: masks are drawn modulo M, a power of 2 (clients x Q must stay below M)",
        affects=(),
    )
    secaggplus_timeout: float = setting(
        0.0,
        "secaggplus: seconds each of the four stages waits for replies (0: the round's timeout)",
        check=non_negative_finite,
        affects=(),
    )
    secaggplus_max_weight: float = setting(
        1000.0,
        "secaggplus, aggregation-weights=num-examples: a client's weight is its examples / "
        "this, at most 1 (Flower's max_weight: a client with more counts as this many)",
        check=positive_finite,
        affects=(),
    )
    secure_uplink_limit_mb: float = setting(
        1024.0,
        "secaggplus: refuse a run whose contribution per client and round exceeds this many "
        "MB as masked (8 bytes a value); FLoRG's Gram is k(k+1)/2 values a layer",
        check=positive_finite,
        affects=(),
    )
